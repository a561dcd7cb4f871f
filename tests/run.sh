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
# Two workers, each taking whole test files, so a file's shared run (a module fixture) is made once: a launch is
# single-core while it starts and stops, and the other worker's rollouts fill the second core meanwhile.
"$trainer/bin/python" -m pytest -n "${AGH_TEST_WORKERS:-2}" --dist loadfile -ra --durations=15 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
