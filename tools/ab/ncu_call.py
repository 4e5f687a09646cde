"""One call of the layer on a bench shape, to run under Nsight Compute: the kernels of one
forward (MODE fwd) or forward+backward (fwd+bwd, the default), nothing else of mok_jax's.
Usage: python tools/ab/ncu_call.py SHAPE [MODE]; MOK_AB_BACKEND as for measure.py. On the
device machine, e.g. (as for docs/performance.md's "What bounds dsv3"):
  ncu --clock-control none --kernel-name regex:Chain --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed \
python3 tools/ab/ncu_call.py dsv3"""

import sys

import jax

from measure import mode_call


def main(argv):
  mode = argv[1] if len(argv) > 1 else "fwd+bwd"
  f, args = mode_call(argv[0], mode)
  jax.block_until_ready(f(*args))
  print(f"{argv[0]} {mode}: one call", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
