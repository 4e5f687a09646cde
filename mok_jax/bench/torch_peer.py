"""The PyTorch peer: the same MoE layer on `torch._grouped_mm` (eager, autograd).

It runs in its own process (JAX there only on the CPU, for routing) on inputs bit-identical to
the JAX workers' (inputs.py), times each call with CUDA events around a synchronised call, then
back to back (records.back_to_back), and reads the peak of torch's caching allocator, reset
before each mode, before the back-to-back calls.
"""

from __future__ import annotations

import time

from mok_jax.bench import inputs, timing
from mok_jax.bench.records import (CHECK_NAMES, back_to_back, failed, failure, finite_or_text,
                                   resolve_dtype, stage, timed)
from mok_jax.bench.shapes import Shape

def run(job: dict):
  """The job's events, as jobs.iter_job yields them."""
  modes = job["modes"]

  def fail_all(status, reason, device=None, **extra):
    for raw in failed(modes, status, reason, **extra):
      yield {"event": "record", "record": raw, "device": device}

  try:
    import torch  # pylint: disable=import-outside-toplevel
  except Exception as exc:  # pylint: disable=broad-except
    yield from fail_all("unavailable", "import torch failed: " + failure(exc)["reason"])
    return
  if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
    what = "sees no CUDA device" if not torch.cuda.is_available() else "has no torch._grouped_mm"
    yield from fail_all("unavailable", f"torch {torch.__version__} {what}")
    return
  device = {"platform": "gpu", "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count()}
  dtype = resolve_dtype(job["dtype"], "gpu")
  shape = Shape(**job["shape"])
  common = {"dtype": dtype, "note": None if dtype == "bf16" else
            "torch._grouped_mm runs its per-group fallback for non-bf16 inputs"}
  try:
    yield stage(modes[0], "building inputs")
    params, sets = _inputs(torch, shape, {"bf16": torch.bfloat16, "f32": torch.float32}[dtype],
                           job)
  except Exception as exc:  # pylint: disable=broad-except
    yield from fail_all(**failure(exc, "building inputs: "), device=device, **common)
    return
  common["load"] = inputs.load_stats(sets[0][1].cpu().numpy(), shape.E)
  for mode in modes:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    record = dict(mode=mode, **common, **(yield from _time_mode(torch, job, params, sets, mode)))
    record.setdefault("peak_mem_bytes", int(torch.cuda.max_memory_allocated()))
    torch.cuda.empty_cache()
    yield {"event": "record", "record": record, "device": device}


def layer(torch, x, experts, weights, w_gate, w_up, w_down, shared):
  """Sort routes by expert, grouped gate and up products, SwiGLU, grouped down product, each
  route's row back, the weighted sum over k in f32 (+ the shared expert). y (T, H) of x's dtype;
  experts (T, k) int64, weights (T, k) f32."""
  F, mm = torch.nn.functional, torch._grouped_mm  # pylint: disable=protected-access
  T, k = experts.shape
  flat = experts.reshape(-1)
  order = torch.argsort(flat, stable=True)
  # Each expert's end row; searchsorted needs no device-to-host copy (bincount would).
  ends = torch.arange(w_gate.shape[0], device=flat.device, dtype=flat.dtype)
  offsets = torch.searchsorted(flat[order], ends, right=True).to(torch.int32)
  xs = x.index_select(0, order // k)
  h = F.silu(mm(xs, w_gate, offs=offsets)) * mm(xs, w_up, offs=offsets)
  inverse = torch.empty_like(order)
  inverse[order] = torch.arange(order.numel(), device=order.device)
  y_routes = mm(h, w_down, offs=offsets).index_select(0, inverse).view(T, k, x.shape[1])
  y = torch.einsum("tkh,tk->th", y_routes.float(), weights)
  if shared is not None:
    ws_gate, ws_up, ws_down = shared
    y = y + ((F.silu(x @ ws_gate) * (x @ ws_up)) @ ws_down).float()
  return y.to(x.dtype)


def _mulmod32(h, c: int):
  """(h * c) mod 2^32 for int64 h in [0, 2^32), without int64 overflow."""
  lo, hi = c & 0xFFFF, c >> 16
  return (h * lo + (((h * hi) & 0xFFFF) << 16)) & inputs.MASK32


def uniform(torch, dims, salt: int, width, dtype, device):
  """inputs.uniform's bits, a slice of the leading axis at a time to keep int64 temporaries
  small."""
  out = torch.empty(tuple(dims), dtype=dtype, device=device)
  flat = out.view(dims[0], -1)
  inner = flat.shape[1]
  step = max(1, (1 << 26) // max(inner, 1))
  for first in range(0, dims[0], step):
    count = min(step, dims[0] - first)
    index = torch.arange(first * inner, (first + count) * inner, dtype=torch.int64,
                         device=device) & inputs.MASK32
    h = (_mulmod32(index, inputs.GOLDEN) + salt) & inputs.MASK32
    h = _mulmod32(h ^ (h >> 16), inputs.FMIX[0])
    h = _mulmod32(h ^ (h >> 13), inputs.FMIX[1])
    unit = ((h ^ (h >> 16)) >> 8).to(torch.float32) * (2.0 ** -23) - 1.0
    flat[first:first + count] = (unit * float(width)).view(count, inner).to(dtype)
  return out


def _inputs(torch, shape, dtype, job):
  device, seed = torch.device("cuda"), job["seed"]

  def make(dims, tensor_id, std=1.0, grad=True):
    return uniform(torch, dims, inputs.salt(seed, tensor_id), inputs.half_width(std), dtype,
                   device).requires_grad_(grad)

  w = [make(dims, tid, std) for tid, dims, std in inputs.specs(shape)]
  sets = []
  for i in range(job["sets"]):
    experts, weights = inputs.routing(shape.T, shape.E, shape.k, seed + 1 + i, job["skew"])
    sets.append((make((shape.T, shape.H), inputs.x_id(i)),
                 torch.from_numpy(experts.astype("int64")).to(device),
                 torch.from_numpy(weights.copy()).to(device).requires_grad_(True),
                 make((shape.T, shape.H), inputs.dy_id(i), grad=False)))
  torch.cuda.synchronize()
  return (*w[:3], tuple(w[3:]) or None), sets


def _time_mode(torch, job, params, sets, mode):
  """Yields stage events; returns the mode's figures or its failure."""
  w_gate, w_up, w_down, shared = params
  wrt = [w_gate, w_up, w_down, *(shared or ())]

  def call(i):
    x, experts, weights, dy = sets[i]
    if mode == "fwd":
      with torch.no_grad():
        return layer(torch, x, experts, weights, w_gate, w_up, w_down, shared)
    y = layer(torch, x, experts, weights, w_gate, w_up, w_down, shared)
    return y, torch.autograd.grad(y, [x, weights] + wrt, grad_outputs=dy)

  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

  def run_once(i):
    torch.cuda.synchronize()
    start.record()
    out = call(i)
    end.record()
    end.synchronize()
    del out
    return start.elapsed_time(end) / 1e3

  def call_and_event(i):  # back to back: an event after each call, to wait for that one alone
    out, done = call(i), torch.cuda.Event()
    done.record()
    return out, done

  try:
    yield stage(mode, "first call")
    t0 = time.perf_counter()
    first = call(0)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    check = _checksums(first, mode)
    del first
    yield stage(mode, f"warm-up and timing (first call {first_s * 1e3:.1f} ms)")
    seconds, how, gpu = timed(run_once, job, first_s)
    peak = int(torch.cuda.max_memory_allocated())
    yield stage(mode, "back-to-back timing")
    b2b = back_to_back(call_and_event, lambda out: out[1].synchronize(), job)
  except Exception as exc:  # pylint: disable=broad-except
    return failure(exc)
  # Eager PyTorch compiles nothing: compile_s is its first call (kernel loading, cuBLAS setup).
  return {"status": "ok", "ms": timing.summarize(seconds), "timing": how, "compile_s": first_s,
          "check": check, "peak_mem_bytes": peak, **gpu, **b2b}


def _checksums(out, mode) -> dict:
  """As jobs' checksums, a slice of the leading axis at a time: no f32 copy of a whole gradient
  (15 GiB for dsv3's) while the peak memory is being read."""

  def abs_sum(t):
    t = t.detach()
    rows = max(1, (1 << 26) // max(t[0].numel() if t.dim() > 1 else 1, 1))
    return sum(float(t[i:i + rows].float().abs().sum()) for i in range(0, t.shape[0], rows))

  if mode == "fwd":
    return {"y": finite_or_text(abs_sum(out))}
  y, grads = out
  sums = dict(zip(CHECK_NAMES, map(abs_sum, (y, *grads[:5]))))
  if grads[5:]:
    sums["dws"] = sum(abs_sum(g) for g in grads[5:])
  return {name: finite_or_text(value) for name, value in sums.items()}
