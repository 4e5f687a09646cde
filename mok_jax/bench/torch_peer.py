"""The PyTorch peer: the same MoE layer on `torch._grouped_mm` (eager, autograd), in a process
of its own (JAX there only on the CPU, for routing), on inputs bit-identical to the JAX
workers'. A call is timed by CUDA events around it, synchronised; the peak memory is that of
torch's caching allocator, reset before each mode.
"""

from __future__ import annotations

from mok_jax.bench import inputs
from mok_jax.bench.records import failed, failure, measure, resolve_dtype, stage
from mok_jax.bench.shapes import Shape


def run(job: dict):
  """The job's events, as jobs.iter_job yields them."""
  modes, device = job["modes"], None
  try:
    import torch  # pylint: disable=import-outside-toplevel

    why = (None if torch.cuda.is_available() and hasattr(torch, "_grouped_mm") else
           f"torch {torch.__version__} sees no CUDA device or has no torch._grouped_mm")
  except Exception as exc:  # pylint: disable=broad-except
    why = "import torch failed: " + failure(exc)["reason"]
  if why:
    yield from ({"event": "record", "record": r, "device": None}
                for r in failed(modes, "unavailable", why))
    return
  device = {"platform": "gpu", "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count()}
  dtype = resolve_dtype(job["dtype"], "gpu")
  shape = Shape(**job["shape"])
  common = {"dtype": dtype, "note": None if dtype == "bf16" else
            "torch._grouped_mm runs its per-group fallback for non-bf16 inputs"}
  yield stage(modes[0], "building inputs")
  params, sets = _inputs(torch, shape, {"bf16": torch.bfloat16, "f32": torch.float32}[dtype], job)
  common["load"] = inputs.load_stats(sets[0][1].cpu().numpy(), shape.E)
  for mode in modes:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    record = dict(mode=mode, **common, **(yield from _time_mode(torch, job, params, sets, mode)))
    record.setdefault("peak_mem_bytes", int(torch.cuda.max_memory_allocated()))
    torch.cuda.empty_cache()
    yield {"event": "record", "record": record, "device": device}


def layer(torch, x, experts, weights, w_gate, w_up, w_down, shared):
  """Routes sorted by expert, grouped gate and up products, SwiGLU, grouped down product, each
  route's row back, the weighted sum over k in f32 (+ the shared expert): y of x's dtype."""
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
  return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & inputs.MASK32


def uniform(torch, dims, salt: int, width, dtype, device):
  """inputs.uniform's bits, a slice of the leading axis at a time (small int64 temporaries)."""
  out = torch.empty(tuple(dims), dtype=dtype, device=device)
  flat = out.view(dims[0], -1)
  inner = flat.shape[1]
  step = max(1, (1 << 26) // max(inner, 1))
  for first in range(0, dims[0], step):
    count = min(step, dims[0] - first)
    h = torch.arange(first * inner, (first + count) * inner, dtype=torch.int64, device=device)
    h = (_mulmod32(h & inputs.MASK32, inputs.GOLDEN) + salt) & inputs.MASK32
    h = _mulmod32(h ^ (h >> 16), inputs.FMIX[0])
    h = _mulmod32(h ^ (h >> 13), inputs.FMIX[1])
    unit = ((h ^ (h >> 16)) >> 8).to(torch.float32) * (2.0 ** -23) - 1.0
    flat[first:first + count] = (unit * float(width)).view(count, inner).to(dtype)
  return out


def _inputs(torch, shape, dtype, job):
  """As inputs.jax_inputs."""
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
  w_gate, w_up, w_down, shared = params
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

  def call(i):  # (out, an event after it), to wait for this call alone
    x, experts, weights, dy = sets[i]
    with torch.set_grad_enabled(mode != "fwd"):
      out = layer(torch, x, experts, weights, w_gate, w_up, w_down, shared)
    if mode != "fwd":
      out = [out, *torch.autograd.grad(out, [x, weights, w_gate, w_up, w_down, *(shared or ())],
                                       grad_outputs=dy)]
    done = torch.cuda.Event()
    done.record()
    return out, done

  def run_once(i):
    torch.cuda.synchronize()
    start.record()
    out = call(i)
    end.record()
    end.synchronize()
    del out
    return start.elapsed_time(end) / 1e3

  def sums(out):
    return [_abs_sum(t) for t in (out[0] if mode != "fwd" else [out[0]])]

  return (yield from measure(mode, job, lambda: (call, None), lambda out: out[1].synchronize(),
                             sums, lambda: int(torch.cuda.max_memory_allocated()), run_once))


def _abs_sum(t) -> float:
  """A slice of the leading axis at a time: no f32 copy of a whole gradient (15 GiB for dsv3's)
  while the peak memory is being read."""
  t = t.detach()
  rows = max(1, (1 << 26) // max(t[0].numel() if t.dim() > 1 else 1, 1))
  return sum(float(t[i:i + rows].float().abs().sum()) for i in range(0, t.shape[0], rows))
