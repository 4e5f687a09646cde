#!/usr/bin/env bash
# compute-sanitizer over the CUDA forward and backward of mok_jax on small cases
# (tests/cases.py: sanitizer_cases): tile tails, a shared expert, out-of-range ids, an expert
# without routes, block_m 64 and 128.
#
# Usage: bash tools/sanitize.sh [TOOL ...]    (default: memcheck initcheck racecheck)
# Needs the CUDA module built (MOK_CUDA=ON pip install -e .), compute-sanitizer and nvcc on
# PATH. initcheck and racecheck run the two small cases only (racecheck's cost grows with every
# shared-memory access; initcheck prints every report, below). Each tool's report goes to
# $SANITIZE_LOGS/TOOL.log (default: sanitize-logs/ here); the script prints one line a tool and
# where its reports were found (the innermost device frame's file:line), and exits non-zero if
# any tool found an error.
#
# XLA allocates with the platform allocator here (XLA_PYTHON_CLIENT_ALLOCATOR=platform): each
# buffer is a cudaMalloc of its own, so initcheck tracks every buffer's bytes from the moment XLA
# hands it out (inside XLA's default pool, bytes written by an earlier user of the pool would
# count as initialized). racecheck looks at shared memory, where it can see all of it.
#
# TMA stores: before the kernels, initcheck runs tools/sanitize_tma_store.cu, which writes a
# matrix by a TMA store and reads it back with plain loads. Where this initcheck reports that
# read (it takes bytes that only a TMA store wrote for uninitialized), its reports at the loads
# of TMA-stored rows (TMA_READERS) and at host copies of device memory are listed and not
# counted as errors: tests/test_transforms.py checks those reads instead (NaN in the free device
# memory before each call, poisoned residual padding). Every other report is an error, and so is
# a run that does not reach the cases' last line.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${SANITIZE_LOGS:-$root/sanitize-logs}
mkdir -p "$logs"
sanitizer=$(command -v compute-sanitizer) || { echo "compute-sanitizer is not on PATH"; exit 2; }
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck initcheck racecheck)
# The frames whose plain loads read what the GEMMs wrote by TMA stores: the combine of y_routed
# and dx_routed (line 50) and of the shared expert's output (55), the SwiGLU backward's loads
# of gu (epilogue.cuh).
TMA_READERS=("combine.cuh:50" "combine.cuh:55" "epilogue.cuh:241")
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform

# Prints "N SITE TMA" a line for the reports in log $1: SITE the innermost device frame's
# file:line (host: a host-side copy of device memory), TMA 1 if a frame of the report is one of
# TMA_READERS, or a host copy (of outputs that TMA stores wrote, the weight gradients'), else 0.
sites() {
  TMA_READERS="${TMA_READERS[*]}" python3 - "$1" <<'PY'
import collections, os, re, sys
readers = set(os.environ["TMA_READERS"].split())
counts = collections.Counter()
def close(report):
  if report is None: return
  head, frames = report
  if head.startswith("Host API"): counts["host", 1] += 1
  elif frames: counts[frames[0], int(any(f.rsplit("/", 1)[-1] in readers for f in frames))] += 1
  else: counts["?", 0] += 1
report = None
for line in open(sys.argv[1], errors="replace"):
  m = re.match(r"=+ (\S.*)", line)
  if m and re.match(
      r"(Uninitialized|Invalid|Race|Error|Warning|Host API|Program hit|Barrier|Misaligned)",
      m.group(1)):
    close(report)
    report = (m.group(1), [])
  f = re.search(r"Device Frame:.* in (\S+:\d+)", line)
  if report is not None and f: report[1].append(f.group(1))
close(report)
for (site, tma), n in counts.most_common(): print(n, site, tma)
PY
}

tma_seen=yes
if printf '%s\n' "${tools[@]}" | grep -qx initcheck; then
  probe="$logs/sanitize_tma_store"
  nvcc -std=c++17 -arch=sm_90a -I"$root/cuda/sm90" "$root/tools/sanitize_tma_store.cu" \
      "$root/cuda/sm90/tensor_map.cc" -o "$probe" > "$logs/tma_probe.log" 2>&1 ||
      { echo "tools/sanitize_tma_store.cu did not build (see $logs/tma_probe.log)"; exit 2; }
  # Exit 10: initcheck reported the read; any other failure is the probe's own.
  "$sanitizer" --tool initcheck --error-exitcode 10 "$probe" plain >> "$logs/tma_probe.log" 2>&1 ||
      { echo "the TMA probe failed with plain stores (see $logs/tma_probe.log)"; exit 2; }
  "$sanitizer" --tool initcheck --error-exitcode 10 "$probe" tma >> "$logs/tma_probe.log" 2>&1
  rc=$?
  [ $rc -eq 10 ] && tma_seen=no
  [ $rc -ne 0 ] && [ $rc -ne 10 ] &&
      { echo "the TMA probe failed with TMA stores (see $logs/tma_probe.log)"; exit 2; }
  echo "initcheck sees the bytes of TMA stores: $tma_seen (tools/sanitize_tma_store.cu)"
fi

status=0
for tool in "${tools[@]}"; do
  extra=(--show-backtrace device) small=False
  [ "$tool" = memcheck ] && extra+=(--leak-check no)
  [ "$tool" = racecheck ] && small=True
  [ "$tool" = initcheck ] && small=True && extra+=(--print-limit 1000000)
  start=$SECONDS
  (cd "$root/tests" && "$sanitizer" --tool "$tool" "${extra[@]}" --error-exitcode 1 \
      python3 -c "import cases; cases.sanitizer_cases(small_only=$small)") > "$logs/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/$tool.log" | tail -1)
  echo "$tool: exit $rc, $((SECONDS - start)) s: ${summary:-no summary (see $logs/$tool.log)}"
  errors=0 listed=0
  while read -r n site tma; do
    [ -n "$site" ] || continue
    if [ "$tool" = initcheck ] && [ $tma_seen = no ] && [ "$tma" = 1 ]; then
      echo "  $n at $site: reads of TMA-stored bytes (not counted)"
      listed=$((listed + n))
    else
      echo "  $n at $site"
      errors=$((errors + n))
    fi
  done < <(sites "$logs/$tool.log")
  if ! grep -q "^sanitizer_cases: .* cases ran" "$logs/$tool.log"; then
    echo "  the cases did not run to the end (see $logs/$tool.log)"
    status=1
  elif ! grep -q "SUMMARY: " "$logs/$tool.log"; then
    status=1  # stopped before its summary
  elif [ $errors -gt 0 ] || { [ $rc -ne 0 ] && [ $listed -eq 0 ]; }; then
    status=1
  fi
done
exit $status
