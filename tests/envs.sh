# Sourced by tests/run.sh and bench/run.sh: builds the two environments of the CPU rig once (cached outside the
# clone, keyed by their requirements, so reruns on one machine install nothing) and exports AGH_SERVER_PYTHON,
# AGH_TRAINER_PYTHON and AGH_CACHE_DIR. Expects $root (the clone) to be set.
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

make_env() {  # name, python, requirements file -> prints the venv dir
  local name=$1 py=$2 req=$root/$3 dir
  dir=$cache/$name-$(cat "$req" | sha256sum | cut -c1-16)
  if [ ! -f "$dir/.complete" ]; then
    echo "installing the $name environment into $dir (once)" >&2
    rm -rf "$dir"
    "$py" -m venv "$dir"
    if ! "$dir/bin/pip" install -q -r "$req" >"$dir/install.log" 2>&1; then
      grep -v "is ignored: it is neither" "$dir/install.log" | tail -20 >&2
      exit 1
    fi
    touch "$dir/.complete"
  fi
  echo "$dir"
}

trainer=$(make_env trainer "$(find_python 3.11)" tests/requirements-trainer.txt)
server=$(make_env server "$(find_python 3.12)" tests/requirements-server.txt)
export AGH_SERVER_PYTHON=$server/bin/python AGH_TRAINER_PYTHON=$trainer/bin/python AGH_CACHE_DIR=$cache
