#!/usr/bin/env bash
# The test command. Builds the two environments of the CPU rig once (tests/envs.sh), then runs the suite (or the
# tests named in the arguments).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/tests/envs.sh"

cd "$root"
set +e
# The whole suite unless the arguments name tests themselves (a file, a node id). The whole suite runs on two
# workers, one per core of the CI machine: in one process it kept ~1.2 of 2 cores busy, waiting on its launches.
# --dist loadfile keeps each module, and so its module-scoped runs, on one worker; tests/conftest.py puts the longest
# modules first (xdist's own reorder, by number of tests, would undo that). Named tests run in this process (a
# worker's start costs ~15 s); `-n 2` spreads them too, `-n 0` keeps the whole suite in one process.
case " $* " in *" tests/"*) workers=() ;; *) set -- tests "$@"; workers=(-n 2) ;; esac
"$trainer/bin/python" -m pytest -ra --durations=15 "${workers[@]}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
