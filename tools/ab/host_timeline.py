"""The host's side of a call of the layer: which host events (JAX, PjRt, XLA's thunks, mok_jax's
FFI handler, its CUDA API calls) take how long, and when each starts relative to the call's first
GPU work (jax.profiler, five calls after five untraced ones). Usage: python
tools/ab/host_timeline.py SHAPE [MODE]; MOK_AB_BACKEND as for measure.py."""

import collections
import os
import sys

import jax
from mok_jax.bench import shapes as bench_shapes

from measure import CALL_GAP_US, call_spans, layer_calls, trace_events

CALLS = 5


def main(argv):
  mode = argv[1] if len(argv) > 1 else "fwd"
  if mode not in bench_shapes.MODES:
    raise SystemExit(f"MODE must be one of {bench_shapes.MODES}, got {mode}")
  f_fwd, f_step, args = layer_calls(argv[0], os.environ.get("MOK_AB_BACKEND", "cuda"))
  f = f_fwd if mode == "fwd" else f_step
  for _ in range(CALLS):
    jax.block_until_ready(f(*args))
  path = f"/tmp/host_timeline_{os.getpid()}"
  with jax.profiler.trace(path):
    for _ in range(CALLS):
      jax.block_until_ready(f(*args))
  host, gpu = trace_events(path)
  total, count = collections.Counter(), collections.Counter()
  for e in host:
    total[e["name"][:100]] += e["dur"] / CALLS
    count[e["name"][:100]] += 1 / CALLS
  print(f"{argv[0]} {mode}: host events, us a call (the 30 longest):")
  for name, us in total.most_common(30):
    print(f"{us:10.1f} x{count[name]:.0f} {name}")
  if not gpu:
    print("no GPU kernels in the trace")
    return
  # The last call: its host events from 300 us before its first GPU work to 50 us after.
  launches = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
  first = launches[0][0]
  for (_, end), (start, _) in zip(launches, launches[1:]):
    if start - end > CALL_GAP_US:
      first = start
  print(f"the last call, us from its first GPU work (its span: {call_spans(launches)[-1]:.1f} us):")
  for e in sorted(host, key=lambda e: e["ts"]):
    if first - 300 <= e["ts"] <= first + 50 and e["dur"] >= 3:
      print(f"{e['ts'] - first:9.1f} {e['dur']:8.1f} {e['name'][:100]}")


if __name__ == "__main__":
  main(sys.argv[1:])
