#!/usr/bin/env bash
# The whole suite, N times in a row, each from a fresh clone, while a busy loop keeps every core busy.
#
#   bash scripts/test_under_load.sh [COMMIT] [RUNS] [WORK_DIR]
#
# COMMIT defaults to HEAD, RUNS to 3, WORK_DIR to a new temporary directory. Each run clones this
# repository into WORK_DIR/runN/main (with this checkout's ../shared linked beside it, as CI has it),
# runs `.ci/run` there (install from scratch, then the README's test command) and keeps its output in
# WORK_DIR/runN/ci.log. One line per run goes to WORK_DIR/series.log and to stdout. Stops at the first
# failing run; exits with its status.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")" || exit 2
runs="${2:-3}"
work="${3:-$(mktemp -d -t kvflow-under-load.XXXXXX)}"
mkdir -p "$work"
log="$work/series.log"

burners=()
for _ in $(seq "$(nproc)"); do
  python3 -c 'while True: pass' &
  burners+=($!)
done
trap 'kill "${burners[@]}" 2>/dev/null' EXIT

rc=0
for i in $(seq "$runs"); do
  dir="$work/run$i"
  rm -rf "$dir" && mkdir -p "$dir"
  [ -d "$repo/../shared" ] && ln -s "$(cd "$repo/../shared" && pwd)" "$dir/shared"
  git clone -q "$repo" "$dir/main" && git -C "$dir/main" checkout -q "$commit"
  start=$(date +%s)
  (cd "$dir/main" && CI=true bash .ci/run >"$dir/ci.log" 2>&1)
  rc=$?
  summary="$(grep -E '[0-9]+ (passed|failed)' "$dir/ci.log" | tail -1)"
  echo "run $i of $runs, ${commit:0:7}: exit $rc after $(( $(date +%s) - start )) s; $summary" | tee -a "$log"
  [ "$rc" -ne 0 ] && break
done
exit "$rc"
