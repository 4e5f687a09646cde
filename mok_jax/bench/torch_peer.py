"""The PyTorch peer: the same MoE layer on `torch._grouped_mm` (eager, autograd, bf16), in a
process of its own (JAX there only on the CPU, for routing), on inputs bit-identical to the JAX
workers'. A call is timed by CUDA events around it, synchronised; the peak memory is that of
torch's caching allocator, reset before each mode.
"""

from __future__ import annotations

from mok_jax.bench import inputs
from mok_jax.bench.shapes import Shape
from mok_jax.bench.timing import failure, measure, record, stage


def run(job: dict):
  """The job's events, as jobs.iter_job yields them."""
  modes, why = job["modes"], "no expert parallelism in this implementation"
  try:
    import torch  # pylint: disable=import-outside-toplevel
    if job["ep"] == 1:
      why = (None if torch.cuda.is_available() and hasattr(torch, "_grouped_mm") else
             f"torch {torch.__version__} sees no CUDA device or has no torch._grouped_mm")
  except Exception as exc:  # pylint: disable=broad-except
    why = "import torch failed: " + failure(exc)["reason"]
  if why:
    yield from (record({"mode": m, "status": "unavailable", "reason": why}) for m in modes)
    return
  device = {"platform": "gpu", "name": torch.cuda.get_device_name(0)}
  shape = Shape(**job["shape"])
  yield stage(modes[0], "building inputs")
  params, sets = _inputs(torch, shape, job)
  common = {"dtype": "bf16", "load": inputs.load_stats(sets[0][1].cpu().numpy(), shape.E)}
  for mode in modes:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    raw = dict(mode=mode, **common, **(yield from _time_mode(torch, job, params, sets, mode)))
    raw.setdefault("peak_mem_bytes", int(torch.cuda.max_memory_allocated()))
    torch.cuda.empty_cache()
    yield record(raw, device)


def layer(torch, x, experts, weights, w_gate, w_up, w_down):
  """Routes sorted by expert, grouped gate and up products, SwiGLU, grouped down product, each
  route's row back, the weighted sum over k in f32: y of x's dtype."""
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
  return torch.einsum("tkh,tk->th", y_routes.float(), weights).to(x.dtype)


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
    h = inputs.fmix((_mulmod32(h & inputs.MASK32, inputs.GOLDEN) + salt) & inputs.MASK32,
                    _mulmod32)
    unit = (h >> 8).to(torch.float32) * (2.0 ** -23) - 1.0
    flat[first:first + count] = (unit * float(width)).view(count, inner).to(dtype)
  return out


def _inputs(torch, shape, job):
  """As inputs.jax_inputs: (w_gate, w_up, w_down), [(x, experts, weights, dy)] * sets."""
  device, seed, n = torch.device("cuda"), job["seed"], job["sets"]
  w = [uniform(torch, dims, inputs.salt(seed, tid), width, torch.bfloat16, device)
       for tid, dims, width in inputs.specs(shape, n)]
  sets = []
  for i in range(n):
    experts, weights = inputs.routing(shape.T, shape.E, shape.k, seed + 1 + i, job["skew"])
    experts = torch.from_numpy(experts.astype("int64")).to(device)
    weights = torch.from_numpy(weights.copy()).to(device).requires_grad_()
    sets.append((w[3 + 2 * i].requires_grad_(), experts, weights, w[4 + 2 * i]))
  torch.cuda.synchronize()
  return [a.requires_grad_() for a in w[:3]], sets


def _time_mode(torch, job, params, sets, mode):
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

  def call(i):  # (out, an event after it), to wait for this call alone
    x, experts, weights, dy = sets[i]
    with torch.set_grad_enabled(mode != "fwd"):
      out = layer(torch, x, experts, weights, *params)
    if mode != "fwd":
      out = [out, *torch.autograd.grad(out, [x, weights, *params], grad_outputs=dy)]
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
