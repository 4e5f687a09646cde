#!/usr/bin/env bash
# The checks of one GPU machine, in one go: build the CUDA module, run the GPU tests, the
# sanitizers and the benchmark, each stage's log in $OUT (default: gpu-logs/ here).
#
# Usage: bash tools/gpu_check.sh STAGE...
#   build              MOK_CUDA=ON pip install -e . (no build isolation: nanobind,
#                      scikit-build-core and CUTLASS must be installed)
#   tests[:FILES]      python -m pytest -m gpu on FILES (comma-separated; default: every test
#                      file, the transforms' first), one line a test as it ends, so that a
#                      stage stopped by its timeout still shows what ran (the sanitizer tests
#                      are left to the next stage); the failures' messages on stdout too
#   sanitize[:T,...]   tools/sanitize.sh with tools T (default: memcheck,initcheck,racecheck)
#   bench[:ARGS]       python -m mok_jax.bench ARGS (default: every shape, every peer), with its
#                      records, table, chart and workers' logs in $OUT
# Each stage stops after $STAGE_TIMEOUT seconds (default 600). The script prints one line a
# stage (exit status, seconds) and exits non-zero if any stage failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu-logs}
limit=${STAGE_TIMEOUT:-600}
mkdir -p "$out"
cd "$root"
status=0
for stage in "$@"; do
  name=${stage%%:*}
  arg=${stage#"$name"}
  arg=${arg#:}
  start=$SECONDS
  case $name in
    build)
      MOK_CUDA=ON timeout "$limit" python3 -m pip install -q --no-build-isolation --no-deps -e . \
        > "$out/build.log" 2>&1 ;;
    tests)
      # pytest keeps the order of the paths it is given, not of a folder given after them.
      first="tests/test_transforms.py tests/test_vmap.py tests/test_nan_locality.py"
      rest=$(ls tests/test_*.py | grep -v -F -x -f <(tr ' ' '\n' <<< "$first"))
      files=${arg:-$first $rest}
      timeout "$limit" python3 -m pytest -v --tb=short -rfE -m gpu -p no:cacheprovider \
        --durations=15 --deselect tests/test_sanitizer_cuda.py \
        ${files//,/ } > "$out/gpu-tests.log" 2>&1
      # The failures with their messages (pytest's short summary), else the last lines: a
      # stage's one file may not come back from the machine, its output does.
      rc=$?
      sed -n '/short test summary info/,$p' "$out/gpu-tests.log" | cut -c1-300 | head -40
      tail -3 "$out/gpu-tests.log"; (exit $rc) ;;
    sanitize)
      SANITIZE_LOGS="$out/sanitize" timeout "$limit" bash tools/sanitize.sh ${arg//,/ } ;;
    bench)
      args=${arg:---impls cuda,jax,tokamax,torch --mode-timeout 30}
      # shellcheck disable=SC2086  # ARGS are words
      timeout "$limit" python3 -m mok_jax.bench $args \
        --out "$out/bench.jsonl" \
        > "$out/bench.txt" 2>&1
      rc=$?; tail -20 "$out/bench.txt"; (exit $rc) ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  rc=$?
  echo "== $stage: exit $rc, $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=1
done
exit $status
