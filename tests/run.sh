#!/usr/bin/env bash
# The test command. Builds the two environments of the CPU rig once (tests/envs.sh), then runs the whole suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/tests/envs.sh"

cd "$root"
set +e
"$trainer/bin/python" -m pytest tests -ra "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
