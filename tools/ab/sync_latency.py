"""Where a synchronised call's wall clock goes besides its GPU work: for each of 20 profiled
calls, the host's call start to its first kernel's start (dispatch) and its last kernel's end to
block_until_ready's return (synchronisation), against a plain jnp.dot whose GPU time is about
the layer's. Usage: python tools/ab/sync_latency.py SHAPE [MODE]."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from measure import mode_call, trace_events

CALLS = 20


def profile(f, args, tag):
  """(median ms of wall, dispatch, GPU span and synchronisation over the synchronised calls
  that ran kernels, or None; how many calls the trace holds)."""
  for _ in range(5):
    jax.block_until_ready(f(*args))
  path = f"/tmp/sync_latency_{tag}"
  with jax.profiler.trace(path):
    for _ in range(CALLS):
      with jax.profiler.TraceAnnotation("ab_call"):
        jax.block_until_ready(f(*args))
  host, gpu = trace_events(path)
  calls = sorted((e["ts"], e["ts"] + e["dur"]) for e in host if e["name"] == "ab_call")
  kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
  rows = []
  for start, end in calls:
    inside = [k for k in kernels if start <= k[0] <= end]
    if inside:
      first, last = inside[0][0], max(k[1] for k in inside)
      rows.append((end - start, first - start, last - first, end - last))
  return (np.median(np.array(rows), axis=0) / 1e3 if rows else None), len(calls)


def main(argv):
  mode = argv[1] if len(argv) > 1 else "fwd"
  f, args = mode_call(argv[0], mode)
  layer, calls = profile(f, args, "layer")
  if layer is None:
    print(f"no GPU kernels in the {calls} calls traced")
    return
  # A dense matmul of about the layer's GPU time: 2 n^3 FLOPs at ~700 TFLOP/s.
  size = max(256, int(round((layer[2] * 1e-3 * 7e14 / 2) ** (1 / 3) / 256)) * 256)
  a = jnp.ones((size, size), jnp.bfloat16)
  dot, _ = profile(jax.jit(jnp.dot), (a, a), "dot")
  print(f"{argv[0]} {mode}: median ms of {CALLS} synchronised calls "
        "(wall, host start -> first kernel, GPU span, last kernel -> return)")
  for name, row in (("layer", layer), (f"dot {size}", dot)):
    print(f"  {name:10s} " + "  ".join(f"{v:7.3f}" for v in row))


if __name__ == "__main__":
  main(sys.argv[1:])
