"""One build's figures for tools/ab/run.sh: per bench shape, the bits of y and every gradient (a
fingerprint, `digest`); the wall-clock medians of the forward and of forward+backward, a call
and a synchronisation at a time and back to back (two calls in flight, with the SM clock and
power meanwhile, which a power limit lowers: compare builds at like clocks), as the bench times
them; and for each of the two the GPU time of each kernel and a call's span on the GPU, its
first kernel's start to its last one's end (jax.profiler, five calls; the span less the kernels'
time is the GPU idle inside a call; XLA runs without command buffers while profiling), then the
same of calls profiled back to back (`b2b-span`, `b2b-kernels`: about 0.3 s of calls, 5 to 100,
two in flight; a call's span is then the run's over the calls), which shows which kernels slow
down at the power limit and whether the GPU idles between calls.
Usage: python tools/ab/measure.py NAME SHAPES [MODES] (bench shapes, or tiny; the modes timed,
fwd,fwd+bwd by default: one of them takes half the time); MOK_AB_BACKEND (default cuda) picks
the backend, e.g. xla for a smoke run on a CPU; MOK_AB_SKEW (default 0, uniform) the Zipf
exponent of the routing, as the bench's --skew; MOK_AB_DATA=pow2 clears the mantissas of x, dy
and the expert weights (each value a signed power of two), to see what the operands' values cost
at the power limit. MOK_AB_RANKS=P measures instead the expert call of one rank of P
expert-parallel ranks whose tokens together are the shape's: the routes to its E / P experts,
one row each in global (t, j) order among T k rows (the rest empty), as
mok_jax.expert_parallel hands them to it; the call is told ranks = MOK_AB_RANKS_HINT (default
P), the hint for the kernel's launch choices (ffi backends only)."""

import collections
import glob
import gzip
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax
from mok_jax import expert_parallel, functional
from mok_jax.bench import inputs as bench_inputs
from mok_jax.bench import shapes as bench_shapes
from mok_jax.bench import timing

import clocks  # tools/ab/clocks.py, beside this file


# Kernels of one call follow each other within microseconds; between two calls lie the host's
# synchronisation and dispatch (0.1 ms or more).
CALL_GAP_US = 50.0


def kernel_ms(f, args, tag, calls=5, in_flight=0):
  """(GPU ms per call of each kernel of f(*args), summed over its launches; the median span
  of a call on the GPU, its first kernel's start to its last one's end, in ms). With
  in_flight > 0 the calls go back to back, at most in_flight on the device as the b2b timing
  has them, and a call's span is the whole run's (first kernel's start to last one's end)
  over the calls."""
  path = f"/tmp/ab_trace_{tag}"
  with jax.profiler.trace(path):
    pending = collections.deque()
    for _ in range(calls):
      if in_flight and len(pending) == in_flight:
        jax.block_until_ready(pending.popleft())
      pending.append(f(*args))
      if not in_flight:
        jax.block_until_ready(pending.popleft())
    jax.block_until_ready(list(pending))
  kernels = gpu_events(path)
  total = collections.Counter()
  for e in kernels:
    total[e["name"]] += e["dur"] / calls / 1e3
  launches = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  if in_flight and launches:
    return total, (max(end for _, end in launches) - launches[0][0]) / calls / 1e3
  spans = call_spans(launches)
  return total, float(np.median(spans)) / 1e3 if spans else 0.0


def gpu_events(path):
  """The GPU kernels of the newest jax.profiler trace under `path`: its complete ("X") events
  on a stream of a GPU process."""
  newest = sorted(glob.glob(f"{path}/**/*.trace.json.gz", recursive=True))[-1]
  trace = json.load(gzip.open(newest))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
         and "GPU" in str(e.get("args", {}).get("name", ""))}
  streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
             and e.get("name") == "thread_name" and e.get("pid") in gpu
             and "Stream" in str(e["args"].get("name", ""))}
  return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


def call_spans(launches, gap_us=CALL_GAP_US):
  """Spans (us) of the calls in (start, end) kernel intervals sorted by start: a call ends
  where the GPU then idles more than gap_us."""
  spans, start, end = [], None, None
  for begin, finish in launches:
    if start is not None and begin - end > gap_us:
      spans.append(end - start)
      start = None
    if start is None:
      start, end = begin, finish
    end = max(end, finish)
  if start is not None:
    spans.append(end - start)
  return spans


def _fmix32(h):
  """MurmurHash3's finaliser: every input bit moves about half of the output bits."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


@jax.jit
def _fingerprint(a):
  """Two 32-bit sums over a's elements of a mix of each element's bits with its position,
  modulo 2^32: integer sums, so the same whatever order the device adds them in."""
  width = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  words = jax.lax.bitcast_convert_type(a.reshape(-1), width).astype(jnp.uint32)
  at = jax.lax.iota(jnp.uint32, words.size)
  first = jnp.sum(_fmix32(words ^ _fmix32(at)), dtype=jnp.uint32)
  second = jnp.sum(_fmix32(words + _fmix32(at ^ jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)
  return jnp.stack([first, second])


def digest(a) -> str:
  """Ten hex digits of a fingerprint of a's bits, computed where a lives (dsv3's weight
  gradients are 22.5 GB: a copy to the host would cost more than the call)."""
  first, second = (int(v) for v in np.asarray(_fingerprint(a)))
  return f"{first:08x}{second:08x}"[:10]


def joules(gpu, how):
  """", X.XXX J a call (W W)": the joules that clocks.sampling read over a timing's timed calls
  over their count (the draw: the joules over the timed seconds), or "" where the GPU's energy
  was not counted. Under the power cap a call's time follows its energy: A/Bs compare builds
  by both (docs/performance.md, The power cap)."""
  energy, calls = (gpu or {}).get("energy_j"), (how or {}).get("timed_calls")
  if energy is None or not calls:
    return ""
  return f", {energy / calls:.3f} J a call ({energy / gpu['block_s']:.0f} W)"


def short(kernel):
  """GemmChainKernel<GemmKind<Major A, Major B, Epilogue, Schedule>...> -> gemm<A B epi sched>
  (the chain's first kind, e.g. gemm0030); any other kernel by its bare name."""
  kinds = ["".join(k) for k in re.findall(r"\)(\d+)[^)]*\)(\d+)[^)]*\)(\d+)[^)]*\)(\d+)",
                                             kernel)]
  if "GemmChainKernel" in kernel and kinds:
    return "gemm" + kinds[0]
  return kernel.split("(")[0].split("<")[0].replace("void ", "").replace("mok::sm90::", "")


@jax.jit
def pow2(a):
  """a's values with their mantissas cleared: sign and exponent kept (each value rounded down
  in magnitude to a power of two, zeros kept), so that the products' bits toggle less for the
  same routing, magnitudes and bytes (MOK_AB_DATA=pow2: how much of a call's time at the
  power limit is its operands' values)."""
  width, keep = {jnp.dtype(jnp.bfloat16): (jnp.uint16, 0xFF80),
                 jnp.dtype(jnp.float32): (jnp.uint32, 0xFF800000)}[a.dtype]
  bits = jax.lax.bitcast_convert_type(a, width)
  return jax.lax.bitcast_convert_type(bits & width(keep), a.dtype)


def layer_calls(shape_name, backend):
  """(jitted forward, jitted forward+backward (y and the gradients), their arguments) of the
  bench shape `shape_name` (or tiny) on the bench's inputs (seed 0; uniform routing, or the
  bench's Zipf skew MOK_AB_SKEW)."""
  shape = {s.name: s for s in (*bench_shapes.SHAPES.values(), *bench_shapes.TINY)}[shape_name]
  (wg, wu, wd, *_), sets = bench_inputs.jax_inputs(
      shape, jnp.bfloat16, seed=0, skew=float(os.environ.get("MOK_AB_SKEW", "0")), n_sets=1)
  x, experts, weights, dy = sets[0]
  if os.environ.get("MOK_AB_DATA", "normal") == "pow2":
    x, dy, wg, wu, wd = (pow2(a) for a in (x, dy, wg, wu, wd))
  ranks = int(os.environ.get("MOK_AB_RANKS", "1"))
  if ranks > 1:
    return rank_calls(ranks, int(os.environ.get("MOK_AB_RANKS_HINT", ranks)), x, experts,
                      weights, dy, wg, wu, wd)

  def fwd(x, weights, wg, wu, wd):
    return mok_jax.moe(x, experts, weights, wg, wu, wd, backend=backend)

  def step(x, weights, wg, wu, wd):
    y, pull = jax.vjp(fwd, x, weights, wg, wu, wd)
    return y, pull(dy)

  return jax.jit(fwd), jax.jit(step), (x, weights, wg, wu, wd)


def rank_calls(ranks, hint, x, experts, weights, dy, wg, wu, wd):
  """layer_calls for rank 0 of `ranks` expert-parallel ranks, told `ranks` = hint: the expert
  call on the rows that the routed layer's dispatch gives it (its experts the first E / ranks),
  each route a token of one route."""
  local = wg.shape[0] // ranks
  T, k = experts.shape
  plan = expert_parallel.plan(experts, local, ranks, T * k)
  route = plan.route[:T * k]  # block 0: the routes to rank 0, then empty slots
  rows = x[jnp.maximum(route, 0) // k]
  ids = jnp.where(route >= 0, experts.reshape(-1)[jnp.maximum(route, 0)], -1)
  ids = ids.astype(jnp.int32)[:, None]
  ones = jnp.ones(ids.shape, jnp.float32)
  dy_rows = dy[jnp.maximum(route, 0) // k]
  config = mok_jax.Config()

  def fwd(rows, weights, wg, wu, wd):
    return functional._moe_ffi(rows, ids, weights, wg, wu, wd, None, config=config, ranks=hint)

  def step(rows, weights, wg, wu, wd):
    y, pull = jax.vjp(fwd, rows, weights, wg, wu, wd)
    return y, pull(dy_rows)

  return jax.jit(fwd), jax.jit(step), (rows, ones, wg[:local], wu[:local], wd[:local])


def mode_call(shape_name, mode):
  """(the jitted call of `mode`, fwd or fwd+bwd, on the bench shape `shape_name`, its
  arguments), on MOK_AB_BACKEND (default cuda): layer_calls for the tools that time or profile
  one mode."""
  if mode not in bench_shapes.MODES:
    raise SystemExit(f"MODE must be one of {bench_shapes.MODES}, got {mode}")
  f_fwd, f_step, args = layer_calls(shape_name, os.environ.get("MOK_AB_BACKEND", "cuda"))
  return (f_fwd if mode == "fwd" else f_step), args


def main(argv):
  name, names = argv[0], argv[1].split(",")
  modes = argv[2].split(",") if len(argv) > 2 else list(bench_shapes.MODES)
  if not set(modes) <= set(bench_shapes.MODES):
    raise SystemExit(f"modes must be among {bench_shapes.MODES}, got {modes}")
  backend = os.environ.get("MOK_AB_BACKEND", "cuda")
  for shape_name in names:
    f_fwd, f_step, args = layer_calls(shape_name, backend)
    y, grads = f_step(*args)
    bits = " ".join(f"{n}={digest(a)}" for n, a in
                    zip(("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down"), (y, *grads)))
    print(f"{name} {shape_name} bits {bits}", flush=True)
    del y, grads
    timed = [(m, f) for m, f in (("fwd", f_fwd), ("fwd+bwd", f_step)) if m in modes]
    b2b_ms = {}
    for mode, f in timed:
      gpu = {}
      # Two seconds of timed calls or more: the energy counter moves every 100 ms.
      with clocks.sampling(gpu, "wall") as mark:
        seconds, info = timing.repeat(
            timing.wall_clock(lambda i, f=f: f(*args), jax.block_until_ready), n_sets=1,
            warmup=3, warmup_s=1.0, reps=1000, min_reps=30, budget_s=2.0, on_timed=mark)
      median = timing.summarize(seconds)["median"]
      print(f"{name} {shape_name} wall {mode} {median:.3f} ms{joules(gpu.get('wall'), info)}",
            flush=True)
      # Back to back the GPU reaches its power limit: the SM clock meanwhile, to compare at.
      with clocks.sampling(gpu, "b2b") as mark:
        seconds, info = timing.batched(lambda i, f=f: f(*args), jax.block_until_ready, n_sets=1,
                                       warmup_s=0.5, reps=10, min_reps=5, budget_s=10.0,
                                       sample_s=0.2, max_in_flight=2, on_timed=mark)
      median = b2b_ms[mode] = timing.summarize(seconds)["median"]
      clock = (f" at {gpu['b2b']['sm_mhz']:.0f} MHz, {gpu['b2b']['power_w']:.0f} W"
               if "b2b" in gpu else "")
      print(f"{name} {shape_name} b2b {mode} {median:.3f} ms{clock}{joules(gpu.get('b2b'), info)}",
            flush=True)
    for mode, f in timed:
      for label, calls, in_flight in (("", 5, 0),
                                      ("b2b-", max(5, min(100, round(300 / b2b_ms[mode]))), 2)):
        kernels = collections.Counter()
        per_kernel, span = kernel_ms(f, args, f"{name}_{shape_name}_{mode}_{label}", calls,
                                     in_flight)
        for kernel, ms in per_kernel.items():
          kernels[short(kernel)] += ms
        print(f"{name} {shape_name} {label}span {mode} {span:.3f} ms, kernels "
              f"{sum(kernels.values()):.3f} ms", flush=True)
        print(f"{name} {shape_name} {label}kernels {mode} ms " + " ".join(
            f"{k}={v:.3f}" for k, v in kernels.most_common(8)), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
