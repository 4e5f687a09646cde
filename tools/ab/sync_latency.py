"""Where a synchronised call's wall clock goes besides its GPU work: for each of 20 profiled
calls, the host's call start to its first kernel's start (dispatch), its GPU span, the kernels'
busy time within it (the span less it: the GPU idle inside the call) and its last kernel's end
to block_until_ready's return (synchronisation), against a plain jnp.dot whose GPU time is about
the layer's; then the layer's calls one by one and its kernels' median ms a call, to tell a
call's idle GPU from slower kernels. Usage: python tools/ab/sync_latency.py SHAPE [MODE]."""

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np

from measure import mode_call, short, trace_events

CALLS = 20


def profile(f, args, tag):
  """(median ms of wall, dispatch, GPU span, kernels' busy time and synchronisation over the
  synchronised calls that ran kernels, or None; the per-call rows in ms; each kernel's median
  ms a call)."""
  for _ in range(5):
    jax.block_until_ready(f(*args))
  path = f"/tmp/sync_latency_{tag}"
  with jax.profiler.trace(path):
    for _ in range(CALLS):
      with jax.profiler.TraceAnnotation("ab_call"):
        jax.block_until_ready(f(*args))
  host, gpu = trace_events(path)
  calls = sorted((e["ts"], e["ts"] + e["dur"]) for e in host if e["name"] == "ab_call")
  kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in gpu)
  rows, per_kernel = [], collections.defaultdict(list)
  for start, end in calls:
    inside = [k for k in kernels if start <= k[0] <= end]
    if inside:
      first, last = inside[0][0], max(k[1] for k in inside)
      busy = sum(k[1] - k[0] for k in inside)
      rows.append((end - start, first - start, last - first, busy, end - last))
      mine = collections.Counter()
      for k in inside:
        mine[short(k[2])] += (k[1] - k[0]) / 1e3
      for name, ms in mine.items():
        per_kernel[name].append(ms)
  rows = np.array(rows) / 1e3
  medians = {name: float(np.median(v)) for name, v in per_kernel.items()}
  return (np.median(rows, axis=0) if len(rows) else None), rows, medians


def main(argv):
  mode = argv[1] if len(argv) > 1 else "fwd"
  f, args = mode_call(argv[0], mode)
  layer, rows, medians = profile(f, args, "layer")
  if layer is None:
    print(f"no GPU kernels in the {CALLS} calls traced")
    return
  # A dense matmul of about the layer's GPU time: 2 n^3 FLOPs at ~700 TFLOP/s.
  size = max(256, int(round((layer[2] * 1e-3 * 7e14 / 2) ** (1 / 3) / 256)) * 256)
  a = jnp.ones((size, size), jnp.bfloat16)
  dot, _, _ = profile(jax.jit(jnp.dot), (a, a), "dot")
  header = "(wall, host start -> first kernel, GPU span, kernels busy, last kernel -> return)"
  print(f"{argv[0]} {mode}: median ms of {CALLS} synchronised calls {header}")
  for name, row in (("layer", layer), (f"dot {size}", dot)):
    print(f"  {name:10s} " + "  ".join(f"{v:7.3f}" for v in row))
  print(f"  the layer's calls in turn {header}:")
  for row in rows:
    print("    " + "  ".join(f"{v:7.3f}" for v in row))
  print("  the layer's kernels, median ms a call: " + " ".join(
      f"{k}={v:.3f}" for k, v in sorted(medians.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
  main(sys.argv[1:])
