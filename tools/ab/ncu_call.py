"""One call of the layer on a bench shape, to run under Nsight Compute: the kernels of one
forward (MODE fwd) or forward+backward (fwd+bwd, the default), nothing else of mok_jax's.
Usage: python tools/ab/ncu_call.py SHAPE [MODE]; MOK_AB_BACKEND as for measure.py. On the
device machine, e.g. (as for docs/performance.md's "What bounds dsv3"):
  ncu --clock-control none --kernel-name regex:Chain --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed \
python3 tools/ab/ncu_call.py dsv3"""

import os
import sys

import jax
from mok_jax.bench import shapes as bench_shapes

from measure import layer_calls


def main(argv):
  mode = argv[1] if len(argv) > 1 else "fwd+bwd"
  if mode not in bench_shapes.MODES:
    raise SystemExit(f"MODE must be one of {bench_shapes.MODES}, got {mode}")
  f_fwd, f_step, args = layer_calls(argv[0], os.environ.get("MOK_AB_BACKEND", "cuda"))
  out = (f_fwd if mode == "fwd" else f_step)(*args)
  jax.block_until_ready(out)
  print(f"{argv[0]} {mode}: one call", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
