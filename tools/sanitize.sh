#!/usr/bin/env bash
# compute-sanitizer over the CUDA forward and backward of mok_jax on small cases
# (tests/cases.py: sanitizer_cases): tile tails, a shared expert, out-of-range ids, an expert
# without routes, block_m 64 and 128.
#
# Usage: bash tools/sanitize.sh [TOOL ...]    (default: memcheck initcheck racecheck)
# Needs the CUDA module built (MOK_CUDA=ON pip install -e .) and compute-sanitizer on PATH.
# racecheck runs the two small cases only (it is slow). Each tool's report goes to
# $SANITIZE_LOGS/TOOL.log (default: sanitize-logs/ here); the script prints one line a tool, the
# kernels its errors were found in, and exits non-zero if any tool found an error.
#
# XLA allocates with the platform allocator here (XLA_PYTHON_CLIENT_ALLOCATOR=platform): each
# buffer is a cudaMalloc of its own, so initcheck tracks every buffer's bytes from the moment XLA
# hands it out (inside XLA's default pool, bytes written by an earlier user of the pool would
# count as initialized). racecheck looks at shared memory, where it can see all of it.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${SANITIZE_LOGS:-$root/sanitize-logs}
mkdir -p "$logs"
sanitizer=$(command -v compute-sanitizer) || { echo "compute-sanitizer is not on PATH"; exit 2; }
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck initcheck racecheck)
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
status=0
for tool in "${tools[@]}"; do
  extra=() small=False
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  [ "$tool" = racecheck ] && small=True
  start=$SECONDS
  (cd "$root/tests" && "$sanitizer" --tool "$tool" "${extra[@]}" --error-exitcode 1 \
      python3 -c "import cases; cases.sanitizer_cases(small_only=$small)") > "$logs/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/$tool.log" | tail -1)
  echo "$tool: exit $rc, $((SECONDS - start)) s: ${summary:-no summary (see $logs/$tool.log)}"
  grep -E "^=+ +at " "$logs/$tool.log" | sed -E 's/^=+ +at //; s/\(.*//' | sort | uniq -c |
      sort -rn | head -8
  if [ $rc -ne 0 ] || ! grep -q "SUMMARY: 0 " "$logs/$tool.log"; then status=1; fi
done
exit $status
