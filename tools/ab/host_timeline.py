"""The host's side of a call of the layer: which host events (JAX, PjRt, XLA's thunks, mok_jax's
FFI handler, its CUDA API calls) take how long, and when each starts relative to the call's first
GPU work (jax.profiler, five calls after five untraced ones). Usage: python
tools/ab/host_timeline.py SHAPE [MODE]; MOK_AB_BACKEND as for measure.py."""

import collections
import os
import sys

import jax

from measure import call_spans, mode_call, trace_events

CALLS = 5


def main(argv):
  mode = argv[1] if len(argv) > 1 else "fwd"
  f, args = mode_call(argv[0], mode)
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
  span = call_spans(launches)[-1]
  first = max(end for _, end in launches) - span  # the last call's, as call_spans splits them
  print(f"the last call, us from its first GPU work (its span: {span:.1f} us):")
  for e in sorted(host, key=lambda e: e["ts"]):
    if first - 300 <= e["ts"] <= first + 50 and e["dur"] >= 3:
      print(f"{e['ts'] - first:9.1f} {e['dur']:8.1f} {e['name'][:100]}")


if __name__ == "__main__":
  main(sys.argv[1:])
