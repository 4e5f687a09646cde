#!/bin/bash
# A/B of builds on the device machine: builds each source tree under runs/ab (made by
# tools/ab/export.sh) into /tmp/ab/<name> with `pip install --target`, checks that each imports
# from there (a build that does not is left out), then runs tools/ab/measure.py for every build
# in turn, a fresh process each, ROUNDS times, and reports whether the bits of y and every
# gradient are the same in every build.
#
# Usage: bash tools/ab/run.sh SHAPES        (bench shapes, e.g. gptoss_120b,dsv3, or tiny)
# Output under $OUT: ab.log (measure.py's lines, prefixed by build name) and ab_logs.txt (each
# build's, measure's and the tests' own output, one after another, so that few files come back).
# Settings (environment):
#   ROUNDS=n          rounds over the builds (default 2; 0: build only)
#   SKIP_BUILD=1      measure the builds an earlier call left in /tmp/ab
#   MODES=fwd,fwd+bwd the modes measured (default both; one of them takes half the time)
#   MEASURE_TIMEOUT=s bound on each build's measure.py (default 300), so a hang costs no more
#   TESTS=name[,name] run this tree's GPU tests against those builds after the measures (their
#                     last line in ab.log), so an A/B and the tests of the build to keep fit in one
#                     call; TESTS_TIMEOUT=s bounds each (default 300)
# A .whl/ folder in the tree, if present, holds wheels the device machine lacks (installed into
# /tmp/site) and import stubs (.whl/stub); both go on PYTHONPATH.
#
# An editable install of mok_jax puts an import finder in front of PYTHONPATH, which would make
# every build name measure that one install: it is uninstalled first. JAX's memory settings stay
# at their defaults, as the bench has them (with preallocation off, the allocator works inside
# the timed calls and NVML's energy counter and nvidia-smi disagree by a factor of two).
set -uo pipefail
shapes=${1:?shapes}
rounds=${ROUNDS:-2}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
fi
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
    PYTHONPATH=/tmp/ab/$v:$PYTHONPATH timeout ${MEASURE_TIMEOUT:-300} \
      python3 tools/ab/measure.py $v $shapes ${MODES:-fwd,fwd+bwd} \
      2> "$logs/measure_${v}_$r.err" | tee -a $OUT/ab.log
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
