#!/usr/bin/env bash
# The test command. Builds the two environments of the CPU rig once (tests/envs.sh), then runs the suite (or the
# tests named in the arguments).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/tests/envs.sh"

cd "$root"
set +e
# The whole suite unless the arguments name tests themselves (a file, a node id).
case " $* " in *" tests/"*) ;; *) set -- tests "$@" ;; esac
"$trainer/bin/python" -m pytest -ra --durations=15 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
