# Sourced by tests/run.sh and bench/run.sh: builds the two environments of the CPU rig once (cached outside the
# clone, keyed by their requirements, so reruns on one machine install nothing) and exports AGH_SERVER_PYTHON,
# AGH_TRAINER_PYTHON and AGH_CACHE_DIR. Expects $root (the clone) to be set.
# Without $root every path below is empty, and an empty venv dir means the current one (seen: a venv in the clone).
: "${root:?set root to the clone before sourcing tests/envs.sh}"
cache=${AGH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/async_grpo_harbor}
mkdir -p "$cache"

find_python() {  # pyenv shims refuse versions that are not selected, so look behind them too
  local v=$1 c
  for c in "python$v" "$(pyenv root 2>/dev/null)"/versions/"$v"*/bin/"python$v" /usr/bin/"python$v"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import venv' >/dev/null 2>&1; then command -v "$c"; return; fi
  done
  echo "error: Python $v not found; install it (e.g. pyenv install $v) and rerun" >&2
  exit 2
}

requirements() {  # requirements file -> what its environment installs
  if [ ! -f "$root/$1" ]; then  # else every missing file would hash alike, to one empty environment
    echo "error: $root/$1 not found; set root to the clone" >&2
    exit 2
  fi
  cat "$root/$1"
  if [ "$1" = tests/requirements-trainer.txt ]; then
    # The script's exact pins, from its PEP 723 header (extras dropped, vllm left out: CUDA-only, the rig stands in
    # for it; harbor too: the server environment's, Python 3.12 only): the versions whose private code it overrides
    # are pinned in one place, and tested as installed.
    sed -n '/^# \/\/\/ script$/,/^# \/\/\/$/p' "$root/async_grpo_harbor.py" \
      | grep -o '"[A-Za-z0-9_.-]*\(\[[^]]*\]\)\?==[^"]*"' | tr -d '"' | sed 's/\[[^]]*\]//' \
      | grep -v '^\(vllm\|harbor\)=='
  fi
}

env_dir() {  # name, requirements file -> the venv dir for exactly these requirements
  local listed
  listed=$(requirements "$2") || exit 2
  echo "$cache/$1-$(echo "$listed" | sha256sum | cut -c1-16)"
}

build_env() {  # name, python, requirements file, venv dir
  local name=$1 py=$2 dir=$4
  echo "installing the $name environment into $dir (once)" >&2
  rm -rf "$dir"
  "$py" -m venv "$dir"
  requirements "$3" >"$dir/requirements.txt"
  if ! "$dir/bin/pip" install -q -r "$dir/requirements.txt" >"$dir/install.log" 2>&1; then
    grep -v "is ignored: it is neither" "$dir/install.log" | tail -20 >&2
    return 1
  fi
  touch "$dir/.complete"
}

trainer=$(env_dir trainer tests/requirements-trainer.txt) || exit 2
server=$(env_dir server tests/requirements-server.txt) || exit 2
py311=$(find_python 3.11)
py312=$(find_python 3.12)
# A fresh clone builds both at once: each pip is mostly one core, and this is a third of a first CI run.
building=()
if [ ! -f "$trainer/.complete" ]; then
  build_env trainer "$py311" tests/requirements-trainer.txt "$trainer" &
  building+=($!)
fi
if [ ! -f "$server/.complete" ]; then
  build_env server "$py312" tests/requirements-server.txt "$server" &
  building+=($!)
fi
failed=0
for pid in "${building[@]}"; do
  wait "$pid" || failed=1
done
[ "$failed" = 0 ] || exit 1
export AGH_SERVER_PYTHON=$server/bin/python AGH_TRAINER_PYTHON=$trainer/bin/python AGH_CACHE_DIR=$cache
