#!/usr/bin/env bash
# The benchmark (issue 6): reuses the rig's cached environments (tests/envs.sh) plus py-spy for the profile, and
# holds the machine's rig lock while it measures, since the ratios only mean something on an otherwise idle machine.
#   bash bench/run.sh [--reps 3] [--concurrency 1,2,4,8] [--json results.json]
#   bash bench/run.sh learning [--steps 6] [--out PREFIX]   # bench/learning.py: the learning run beside its control
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/tests/envs.sh"
tools=$cache/bench-tools-$(sha256sum <"$root/bench/requirements-bench.txt" | cut -c1-16)
if [ ! -f "$tools/.complete" ]; then
  "$trainer/bin/python" -m pip install -q --target "$tools" -r "$root/bench/requirements-bench.txt" >&2
  touch "$tools/.complete"
fi
cd "$root"
if [ "${1:-}" = learning ]; then
  shift
  exec flock "${AGH_RIG_LOCK:-/tmp/agh-rig.lock}" env AGH_BENCH_TOOLS="$tools" "$trainer/bin/python" bench/learning.py "$@"
fi
exec flock "${AGH_RIG_LOCK:-/tmp/agh-rig.lock}" "$trainer/bin/python" bench/perf.py --py-spy "$tools/bin/py-spy" "$@"
