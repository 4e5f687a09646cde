#!/bin/bash
# On the device machine: builds each export of runs/ab (tools/ab/export.sh) into /tmp/ab/<name>
# with `pip install --target`, checks that each imports from there (a build that does not is
# left out), then runs tools/ab/measure.py for every build in turn, a fresh process each,
# ROUNDS times (default 2).
# Usage: bash tools/ab/run.sh SHAPES (e.g. gptoss_120b,dsv3); under $OUT: ab.log (the figures)
# and ab_logs.txt (each build's and measure's own output, one after another: the device tool
# brings back at most 8 files, and with a file a build and a round, three builds in two rounds
# lost some on 2026-12-01). MODES (default fwd,fwd+bwd) picks the modes measured: one of them
# takes half the device time. MEASURE_TIMEOUT (default 300) bounds each build's measure.py, in
# seconds (a build that hangs loses no more).
# ROUNDS=0 only builds; SKIP_BUILD=1 measures the builds an earlier call of this run made.
# TESTS=name[,name] runs this tree's GPU tests against those builds after the measures (their
# last lines in ab.log, their output in ab_logs.txt), so that an A/B and the tests of the build
# to keep fit in one call; TESTS_TIMEOUT (default 300) bounds each build's tests, in seconds.
# ENVS="VAR=value[,VAR=value] ..." measures every build once more with each of those settings of
# the launch choices' environment (MOK_GEMM_CLUSTER, MOK_GEMM_TAILS, MOK_WGRAD_RUN, ...; read
# once per process, the same bits), named build@settings in ab.log: a sweep of one build's knobs
# by time and by joules a call, which the power cap makes two different questions.
#
# NOTES: an editable install of mok_jax (pip install -e) puts an import finder in front of
# PYTHONPATH: with one present, every name measured that one build (2026-11-30). It is
# uninstalled first; do not make one in the same call.
# JAX's default memory settings, as the bench has them: until 2026-12-04 19:00 UTC this set
# XLA_PYTHON_CLIENT_PREALLOCATE=false, under which dsv3's back-to-back forward+backward read
# 17.3 J a call at 773 W by NVML's energy counter and 370 W by nvidia-smi, where with
# preallocation the two agreed (15.9 J, 693 and 695 W; measure.py, one H200, 2026-12-04 18:57
# UTC): likely the allocator at work inside the timed calls (not looked at further).
set -uo pipefail
shapes=${1:?shapes}
rounds=${ROUNDS:-2}
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/.whl/stub PYTHONUNBUFFERED=1
python3 -m pip uninstall -y -q mok_jax > /dev/null 2>&1
names=$(ls runs/ab)
logs=/tmp/ab_logs
mkdir -p $logs
if [ -z "${SKIP_BUILD:-}" ]; then
  for v in $names; do
    (MOK_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab/$v \
       runs/ab/$v > $logs/build_$v.log 2>&1) &
  done
  wait
fi
built=""
for v in $names; do
  where=$(cd /tmp && PYTHONPATH=/tmp/ab/$v:$PYTHONPATH python3 -c \
          "import mok_jax._mok_cuda as m; print(m.__file__)" 2>&1)
  case $where in
    /tmp/ab/$v/*) built="$built $v" ;;
    *) echo "$v left out: it does not import from /tmp/ab/$v: $where" | tee -a $OUT/ab.log
       tail -5 $logs/build_$v.log ;;
  esac
done
for r in $(seq $rounds); do
  for v in $built; do
    for e in "" ${ENVS:-}; do
      name=$v${e:+@$e}
      env ${e//,/ } PYTHONPATH=/tmp/ab/$v:$PYTHONPATH timeout ${MEASURE_TIMEOUT:-300} \
        python3 tools/ab/measure.py $name $shapes ${MODES:-fwd,fwd+bwd} \
        2> "$logs/measure_${name//[^A-Za-z0-9_.-]/_}_$r.err" | tee -a $OUT/ab.log
    done
  done
done
tests=${TESTS:-}
for v in ${tests//,/ }; do
  (cd tests && PYTHONPATH=/tmp/ab/$v:$PYTHONPATH timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q \
     -p no:cacheprovider --timeout=200 -m "gpu or multigpu" test_moe_fwd_cuda.py \
     test_moe_bwd_cuda.py test_recompute_cuda.py test_train_lm_gpu.py test_sanitizer_cuda.py \
     test_expert_parallel_gpu.py test_vmap.py > $logs/tests_$v.log 2>&1)
  echo "$v tests: $(tail -1 $logs/tests_$v.log)" | tee -a $OUT/ab.log
done
for f in $logs/*; do echo "=== $(basename $f)"; cat $f; done > $OUT/ab_logs.txt
[ -f $OUT/ab.log ] || exit 0
python3 - "$OUT/ab.log" <<'PY'
import collections, sys
digests = collections.defaultdict(set)
for line in open(sys.argv[1]):
  f = line.split()
  if len(f) > 3 and f[2] == "bits":
    digests[f[1]].add(" ".join(f[3:]))
for shape, d in digests.items():
  print(f"bits {shape}: {'the same in every build' if len(d) == 1 else 'DIFFER'}")
PY
