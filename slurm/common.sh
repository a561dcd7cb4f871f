# shellcheck shell=bash
# shellcheck disable=SC2034  # the *_CMD / *_ENV / *_ARGS arrays set here are read by the wrappers that source this
# Shared by single_node.sbatch and multi_node.sbatch (sourced, after they set REPO and their knobs): how the vLLM
# server and the trainer are started, what they are told, and how a preempted job checkpoints and requeues itself.

SCRIPT=$REPO/async_grpo_harbor.py
# One environment for both sides, built by uv from the script's PEP 723 header: vLLM's NCCL weight-transfer
# helpers run in the trainer and in the server, and must be the same vLLM release on both ends.
UV_RUN=(uv run --no-project --python 3.12 --with-requirements "$SCRIPT" --)
# What the script exits with when it saved a checkpoint on SIGUSR1/SIGTERM and wants the job requeued.
EXIT_REQUEUE=75

CHILDREN=()
TRAINER_PID=""
STOP_SIGNAL=""

die() {
  echo "error: $*" >&2
  exit 2
}

log() {
  echo "[slurm] $*"
}

# --dry-run is the wrapper's own flag; every other argument goes to the script untouched.
parse_wrapper_args() {
  DRY_RUN=0
  SCRIPT_ARGS=()
  local arg
  for arg in "$@"; do
    if [ "$arg" = --dry-run ]; then DRY_RUN=1; else SCRIPT_ARGS+=("$arg"); fi
  done
}

# Prints the value the user gave a script flag (argparse keeps the last one); fails when the flag is absent.
flag_value() {
  local flag=$1 i found=1 value=""
  for ((i = 0; i < ${#SCRIPT_ARGS[@]}; i++)); do
    case ${SCRIPT_ARGS[i]} in
      "$flag") value=${SCRIPT_ARGS[i + 1]:-} found=0 ;;
      "$flag"=*) value=${SCRIPT_ARGS[i]#*=} found=0 ;;
    esac
  done
  printf '%s' "$value"
  return $found
}

# The script's own default for a flag, read from its dataclass field (`model: str = arg("...",`), so it is written
# down in one place only.
script_default() {
  local name=${1#--}
  name=${name//-/_}
  sed -n "s/^ *$name: [^=]*= arg(\"\([^\"]*\)\".*/\1/p" "$SCRIPT" | head -n 1
}

# The model vLLM serves must be the model the trainer trains: both come from the script's --model.
resolve_model() {
  MODEL=$(flag_value --model) || MODEL=$(script_default --model)
  [ -n "$MODEL" ] || die "cannot find the default of --model in $SCRIPT; pass --model"
}

# The script's arguments: the engine URL the wrapper started, --resume auto unless the user chose a --resume (so a
# requeued job continues from its latest checkpoint and a first start begins fresh), then everything the user gave.
trainer_args() {
  local vllm_url=$1
  if flag_value --vllm-url >/dev/null; then
    die "--vllm-url is set by this wrapper (it starts vLLM itself at $vllm_url); remove it from the arguments"
  fi
  TRAINER_ARGS=(--vllm-url "$vllm_url")
  flag_value --resume >/dev/null || TRAINER_ARGS+=(--resume auto)
  TRAINER_ARGS+=("${SCRIPT_ARGS[@]}")
}

# `vllm serve` as the script's docstring gives it; extra flags (parallelism, --host) are appended, ENGINE_ARGS last so
# that the user's own flags win. WEIGHT_BACKEND: nccl (the trainer on GPUs of its own) or ipc (the trainer on vLLM's
# GPU; the script reads which one from vLLM's /server_info).
vllm_command() {
  local extra=()
  read -ra extra <<<"${ENGINE_ARGS:-}"
  VLLM_CMD=("${UV_RUN[@]}" vllm serve "$MODEL" --port "$ENGINE_PORT" --max-model-len "$MAX_MODEL_LEN"
    --enable-auto-tool-choice --tool-call-parser hermes --logprobs-mode processed_logprobs
    --return-tokens-as-token-ids --weight-transfer-config "{\"backend\":\"${WEIGHT_BACKEND:-nccl}\"}" "$@" "${extra[@]}")
}

# One GPU: the script itself. Several: accelerate with FSDP2, the only multi-GPU mode TRL's AsyncGRPO supports.
trainer_command() {
  local gpus=$1
  if [ "$gpus" -gt 1 ]; then
    TRAINER_CMD=("${UV_RUN[@]}" accelerate launch --config_file "$REPO/slurm/fsdp2.yaml" --num_processes "$gpus"
      "$SCRIPT" "${TRAINER_ARGS[@]}")
  else
    TRAINER_CMD=("${UV_RUN[@]}" python "$SCRIPT" "${TRAINER_ARGS[@]}")
  fi
}

# Environment of the trainer's processes. VLLM_HOST_IP / VLLM_PORT are where the trainer (rank 0 of the weight
# transfer group) listens for the vLLM workers' NCCL rendezvous; vLLM's get_ip() would otherwise guess an address
# from the default route, which compute nodes often lack. accelerate's launcher (torchrun) forwards SIGTERM to its
# ranks but SIGKILLs them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30): long enough for a checkpoint.
trainer_env() {
  local address=$1 gpus=$2
  TRAINER_ENV=(VLLM_HOST_IP="$address" VLLM_PORT="$WEIGHT_SYNC_PORT")
  if [ "$gpus" -gt 1 ]; then TRAINER_ENV+=(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$STOP_GRACE"); fi
}

# A command as it can be pasted into a shell.
show() {
  local out="" arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+="$arg "
    else
      out+="'${arg//\'/\'\\\'\'}' "
    fi
  done
  printf '%s\n' "${out% }"
}

# Starts a command in the background (its pid in LAST_PID), or only prints it under --dry-run.
start() {
  local what=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    printf '# %s\n%s\n\n' "$what" "$(show "$@")"
    return
  fi
  log "starting $what: $(show "$@")"
  "$@" &
  LAST_PID=$!
  CHILDREN+=("$LAST_PID")
}

# The USR1 warning (#SBATCH --signal=B:USR1@...) or SIGTERM (preemption, time limit, scancel) reach this shell; the
# trainer is sent SIGTERM, which it answers like SIGUSR1 (checkpoint, stop sessions, exit): unlike SIGUSR1,
# accelerate's launcher forwards it to every rank instead of dying from it.
# A child's pid is ours to signal only while the child is: once it has exited and been reaped, the kernel may give the
# pid to any process of the node (seen: a job's exit SIGKILLed an unrelated process that had reused its trainer's pid).
is_child() {
  [ "$(ps -o ppid= -p "$1" 2>/dev/null | tr -d ' ')" = "$$" ]
}

on_stop_signal() {
  [ -z "$STOP_SIGNAL" ] || return 0
  STOP_SIGNAL=$1
  if [ -n "$TRAINER_PID" ]; then
    log "SIG$1: asking the trainer to save a checkpoint and exit"
    if is_child "$TRAINER_PID"; then kill -TERM "$TRAINER_PID" 2>/dev/null || true; fi
  else
    log "SIG$1 before the trainer started"
  fi
}

# Every child is stopped when the job's shell exits, however it exits.
stop_children() {
  local pid deadline=$((SECONDS + 30))
  for pid in "${CHILDREN[@]}"; do
    if is_child "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for pid in "${CHILDREN[@]}"; do
    while is_child "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done
    if is_child "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
}

install_traps() {
  trap 'on_stop_signal USR1' USR1
  trap 'on_stop_signal TERM' TERM
  trap stop_children EXIT
}

# Waits until vLLM answers /health, or a stop signal came (run_trainer then requeues); fails if any engine process
# ends first or after ENGINE_START_TIMEOUT seconds.
wait_for_engine() {
  local url=$1 pid deadline=$((SECONDS + ENGINE_START_TIMEOUT))
  shift
  log "waiting for vLLM at $url/health"
  until curl -sf -o /dev/null "$url/health"; do
    [ -z "$STOP_SIGNAL" ] || return 0
    for pid in "$@"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "error: vLLM exited before answering $url/health; its log is above" >&2
        return 1
      fi
    done
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "error: vLLM did not answer $url/health within ${ENGINE_START_TIMEOUT}s; its log is above (raise" \
        "ENGINE_START_TIMEOUT for a slow model download)" >&2
      return 1
    fi
    sleep 2 &
    wait $! || true
  done
  log "vLLM is ready"
}

# Requeues this job when its run is unfinished because it was stopped: the script exited 75 (checkpoint saved), or
# a stop signal came and the trainer did not finish (accelerate's launcher reports its ranks' 75 as 1).
requeue_if_stopped() {
  local rc=$1
  if [ "$rc" = "$EXIT_REQUEUE" ] || { [ -n "$STOP_SIGNAL" ] && [ "$rc" != 0 ]; }; then
    if [ -z "${SLURM_JOB_ID:-}" ]; then
      log "stopped (exit $rc); not a SLURM job, so nothing to requeue: rerun the same command to resume"
    elif scontrol requeue "$SLURM_JOB_ID"; then
      log "stopped (exit $rc): job $SLURM_JOB_ID requeued; it resumes from its latest checkpoint"
    else
      echo "error: scontrol requeue $SLURM_JOB_ID failed; resubmit the job to resume" >&2
    fi
  fi
}

# Starts the trainer, waits for it (stop signals interrupt `wait`, so it is resumed until the trainer is gone), and
# requeues the job if it was stopped. Exits with the trainer's code. Arguments: a label, then the command.
run_trainer() {
  if [ -n "$STOP_SIGNAL" ]; then
    requeue_if_stopped "$EXIT_REQUEUE"
    exit "$EXIT_REQUEUE"
  fi
  start "$@"
  TRAINER_PID=$LAST_PID
  if [ -n "$STOP_SIGNAL" ]; then kill -TERM "$TRAINER_PID" 2>/dev/null || true; fi
  while is_child "$TRAINER_PID"; do wait "$TRAINER_PID" || true; done
  local rc=0
  wait "$TRAINER_PID" || rc=$?
  log "trainer exited with code $rc"
  requeue_if_stopped "$rc"
  exit "$rc"
}

positive_int() {
  [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge "${3:-1}" ] || die "$1 must be an integer >= ${3:-1} (got '$2')"
}
