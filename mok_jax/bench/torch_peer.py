"""The PyTorch peer: the same MoE layer on `torch._grouped_mm` (bf16, eager, autograd).

sort routes by expert -> grouped gate and up products -> SwiGLU -> grouped down product ->
gather each route's row back -> weighted sum over the k routes in f32 (+ shared expert).

It runs in its own process (JAX there only on the CPU, for routing), times each call with CUDA
events around a synchronised call (warm-up and repetitions as in timing.repeat), then back to
back as the JAX workers do (records.back_to_back), and reads the peak of torch's caching
allocator, reset before each mode, before the back-to-back calls. Inputs are bit-identical to
the JAX workers' (inputs.py), so output checksums compare across frameworks.
"""

from __future__ import annotations

import time

from mok_jax.bench import clocks, inputs, peers, timing
from mok_jax.bench.records import back_to_back, failed, finite_or_text, resolve_dtype, stage
from mok_jax.bench.shapes import Shape

MASK32 = inputs.MASK32
DEVICE = "cuda"


def run(job: dict):
  """Yields the job's events, as jobs.iter_job does: stages, and a record per mode."""
  modes = job["modes"]

  def fail_all(status, reason, device=None, **extra):
    for raw in failed(modes, status, reason, **extra):
      yield {"event": "record", "record": raw, "device": device}

  try:
    import torch  # pylint: disable=import-outside-toplevel
  except BaseException as exc:  # pylint: disable=broad-except
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
      raise
    yield from fail_all("unavailable", f"import torch failed: {peers.describe_exception(exc)}")
    return
  if not torch.cuda.is_available():
    yield from fail_all("unavailable", f"torch {torch.__version__} sees no CUDA device")
    return
  if not hasattr(torch, "_grouped_mm"):
    yield from fail_all("unavailable", f"torch {torch.__version__} has no torch._grouped_mm")
    return
  device = {"platform": "gpu", "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count()}
  dtype = resolve_dtype(job["dtype"], "gpu")
  shape = Shape(**job["shape"])
  common = {"dtype": dtype, "note": None if dtype == "bf16" else
            "torch._grouped_mm runs its per-group fallback for non-bf16 inputs"}
  torch_dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
  try:
    yield stage(modes[0], "building inputs")
    params, sets = _inputs(torch, shape, torch_dtype, job)
  except Exception as exc:  # pylint: disable=broad-except
    yield from fail_all(peers.failure_status(exc),
                        "building inputs: " + peers.describe_exception(exc), device, **common)
    return
  common["load"] = inputs.load_stats(sets[0][1].cpu().numpy(), shape.E)
  for mode in modes:
    record = dict(mode=mode, **common)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    record.update((yield from _time_mode(torch, job, params, sets, mode)))
    if "peak_mem_bytes" not in record:  # a failed mode: the peak as it stands
      record["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
    torch.cuda.empty_cache()
    yield {"event": "record", "record": record, "device": device}


def layer(torch, x, experts, weights, w_gate, w_up, w_down, shared):
  """y (T, H) of x's dtype. experts (T, k) int64 in [0, E); weights (T, k) f32."""
  F = torch.nn.functional
  T, k = experts.shape
  E, H = w_gate.shape[0], x.shape[1]
  flat = experts.reshape(-1)
  order = torch.argsort(flat, stable=True)
  # End of each expert's rows; searchsorted needs no device-to-host copy (bincount would).
  offsets = torch.searchsorted(flat[order], torch.arange(E, device=flat.device, dtype=flat.dtype),
                               right=True).to(torch.int32)
  xs = x.index_select(0, order // k)
  h = F.silu(torch._grouped_mm(xs, w_gate, offs=offsets)) * torch._grouped_mm(  # pylint: disable=protected-access
      xs, w_up, offs=offsets)
  y_sorted = torch._grouped_mm(h, w_down, offs=offsets)  # pylint: disable=protected-access
  inverse = torch.empty_like(order)
  inverse[order] = torch.arange(order.numel(), device=order.device)
  y_routes = y_sorted.index_select(0, inverse).view(T, k, H)
  y = torch.einsum("tkh,tk->th", y_routes.float(), weights)
  if shared is not None:
    ws_gate, ws_up, ws_down = shared
    y = y + ((F.silu(x @ ws_gate) * (x @ ws_up)) @ ws_down).float()
  return y.to(x.dtype)


def _mulmod32(torch, h, c: int):
  """(h * c) mod 2^32 for int64 h in [0, 2^32), without int64 overflow."""
  lo, hi = c & 0xFFFF, c >> 16
  return (h * lo + (((h * hi) & 0xFFFF) << 16)) & MASK32


def uniform(torch, dims, salt: int, width, dtype, device):
  """inputs.uniform in PyTorch: the same bits, built one leading-axis slice at a time so that
  the int64 temporaries stay small."""
  dims = tuple(dims)
  rows = dims[0]
  inner = 1
  for size in dims[1:]:
    inner *= size
  out = torch.empty(dims, dtype=dtype, device=device)
  flat = out.view(rows, inner)
  step = max(1, (1 << 26) // max(inner, 1))
  for first in range(0, rows, step):
    count = min(step, rows - first)
    index = torch.arange(first * inner, (first + count) * inner, dtype=torch.int64,
                         device=device) & MASK32
    h = (_mulmod32(torch, index, inputs.GOLDEN) + salt) & MASK32
    h = h ^ (h >> 16)
    h = _mulmod32(torch, h, inputs.FMIX[0])
    h = h ^ (h >> 13)
    h = _mulmod32(torch, h, inputs.FMIX[1])
    h = h ^ (h >> 16)
    unit = (h >> 8).to(torch.float32) * (2.0 ** -23) - 1.0
    flat[first:first + count] = (unit * float(width)).view(count, inner).to(dtype)
  return out


def _inputs(torch, shape, dtype, job):
  device = torch.device(DEVICE)
  seed = job["seed"]
  std = inputs.stds(shape)

  def make(dims, tensor_id, sd=1.0, grad=True):
    t = uniform(torch, dims, inputs.salt(seed, tensor_id), inputs.half_width(sd), dtype, device)
    return t.requires_grad_(grad)

  T, H, I, E, k, Is = shape.T, shape.H, shape.I, shape.E, shape.k, shape.Is
  w_gate = make((E, H, I), inputs.W_GATE, std[inputs.W_GATE])
  w_up = make((E, H, I), inputs.W_UP, std[inputs.W_UP])
  w_down = make((E, I, H), inputs.W_DOWN, std[inputs.W_DOWN])
  shared = None
  if Is:
    shared = (make((H, Is), inputs.WS_GATE, std[inputs.WS_GATE]),
              make((H, Is), inputs.WS_UP, std[inputs.WS_UP]),
              make((Is, H), inputs.WS_DOWN, std[inputs.WS_DOWN]))
  sets = []
  for i in range(job["sets"]):
    experts, weights = inputs.routing(T, E, k, seed + 1 + i, job["skew"])
    sets.append((make((T, H), inputs.x_id(i)),
                 torch.from_numpy(experts.astype("int64")).to(device),
                 torch.from_numpy(weights.copy()).to(device).requires_grad_(True),
                 make((T, H), inputs.dy_id(i), grad=False)))
  torch.cuda.synchronize()
  return (w_gate, w_up, w_down, shared), sets


def _time_mode(torch, job, params, sets, mode):
  """Yields stage events; returns the mode's figures (or its failure)."""
  w_gate, w_up, w_down, shared = params
  wrt_params = [w_gate, w_up, w_down] + ([] if shared is None else list(shared))

  if mode == "fwd":
    def call(i):
      x, experts, weights, _ = sets[i]
      with torch.no_grad():
        return layer(torch, x, experts, weights, w_gate, w_up, w_down, shared)
  elif mode == "fwd+bwd":
    def call(i):
      x, experts, weights, dy = sets[i]
      y = layer(torch, x, experts, weights, w_gate, w_up, w_down, shared)
      return y, torch.autograd.grad(y, [x, weights] + wrt_params, grad_outputs=dy)
  else:
    raise ValueError(f"unknown mode {mode!r}")

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
    out = call(i)
    done = torch.cuda.Event()
    done.record()
    return out, done

  try:
    yield stage(mode, "first call")
    t0 = time.perf_counter()
    first = call(0)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    check = _checksums(torch, first, mode)
    del first
    yield stage(mode, f"warm-up and timing (first call {first_s * 1e3:.1f} ms)")
    gpu = {}
    with clocks.sampling(gpu, "gpu") as mark:
      seconds, how = timing.repeat(run_once, n_sets=job["sets"], warmup=job["warmup"],
                                   warmup_s=job.get("warmup_s", 0.0), reps=job["reps"],
                                   min_reps=job["min_reps"], budget_s=job["budget_s"],
                                   prior_s=first_s, on_timed=mark)
    peak = int(torch.cuda.max_memory_allocated())
    yield stage(mode, "back-to-back timing")
    b2b = back_to_back(call_and_event, lambda out: out[1].synchronize(), job)
  except Exception as exc:  # pylint: disable=broad-except
    return {"status": peers.failure_status(exc), "reason": peers.describe_exception(exc)}
  # Eager PyTorch compiles nothing: compile_s is its first call (kernel loading, cuBLAS setup).
  return {"status": "ok", "ms": timing.summarize(seconds), "timing": how, "compile_s": first_s,
          "check": check, "peak_mem_bytes": peak, **gpu, **b2b}


def _checksums(torch, out, mode) -> dict:
  """As jobs._checksums, a slice of the leading axis at a time so that no f32 copy of a whole
  gradient (15 GiB for dsv3's) is made while the peak memory is being read."""

  def abs_sum(t):
    t = t.detach()
    rows = max(1, (1 << 26) // max(t[0].numel() if t.dim() > 1 else 1, 1))
    total = 0.0
    for first in range(0, t.shape[0], rows):
      total += float(t[first:first + rows].float().abs().sum())
    return total

  if mode == "fwd":
    return {"y": finite_or_text(abs_sum(out))}
  y, grads = out
  names = ["dx", "dweights", "dw_gate", "dw_up", "dw_down"]
  sums = {"y": abs_sum(y)}
  sums.update({name: abs_sum(g) for name, g in zip(names, grads)})
  if len(grads) > len(names):
    sums["dws"] = sum(abs_sum(g) for g in grads[len(names):])
  return {name: finite_or_text(value) for name, value in sums.items()}
