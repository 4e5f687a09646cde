"""The PyTorch peer: the same MoE layer on `torch._grouped_mm` (eager, autograd, bf16), or on
`torch._scaled_grouped_mm` (fp8), in a process of its own (JAX there only on the CPU, for
routing), on inputs bit-identical to the JAX workers'. A call is timed by CUDA events around it,
synchronised; the peak memory is that of torch's caching allocator, reset before each mode.
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
      why = (None if torch.cuda.is_available() and hasattr(torch, job["impl"][len("torch."):])
             else f"torch {torch.__version__} sees no CUDA device or has no {job['impl']}")
  except Exception as exc:  # pylint: disable=broad-except
    why = "import torch failed: " + failure(exc)["reason"]
  if why:
    yield from (record({"mode": m, "status": "unavailable", "reason": why}) for m in modes)
    return
  device = {"platform": "gpu", "name": torch.cuda.get_device_name(0)}
  shape, mm = Shape(**job["shape"]), grouped_mm(torch, job["impl"])
  yield stage(modes[0], "building inputs")
  params, sets = _inputs(torch, shape, job)
  common = {"dtype": "bf16", "load": inputs.load_stats(sets[0][1].cpu().numpy(), shape.E)}
  for mode in modes:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    raw = dict(mode=mode, **common, **(yield from _time_mode(torch, mm, job, params, sets, mode)))
    raw.setdefault("peak_mem_bytes", int(torch.cuda.max_memory_allocated()))
    torch.cuda.empty_cache()
    yield record(raw, device)


def grouped_mm(torch, impl: str):
  """mm(a (M, K), w (E, K, N), offs) -> a @ w of each expert's rows, bf16, by `impl`. fp8: e4m3
  of a by row and w by output column quantized in the call (f32 scales amax / 448), the data
  gradient so too (dy, w^T), the weight gradient bf16 (a^T dy), as mok_jax's FP8 has it."""
  # pylint: disable=protected-access
  if impl == "torch._grouped_mm":
    return lambda a, w, offs: torch._grouped_mm(a, w, offs=offs)

  def e4m3(t, dim):  # t / scale saturated, and the scales (dim dropped)
    amax = t.abs().amax(dim=dim, keepdim=True).float()
    scale = torch.where(amax > 0, amax / 448.0, 1.0)
    return (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.squeeze(dim)

  def mm8(a, w, offs):  # w's e4m3 made column-major, as the kernel reads it
    (aq, a_scale), (wq, w_scale) = e4m3(a, -1), e4m3(w, -2)
    return torch._scaled_grouped_mm(aq, wq.mT.contiguous().mT, a_scale, w_scale.contiguous(),
                                    offs=offs, out_dtype=torch.bfloat16)

  class ScaledGroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, offs):  # pylint: disable=arguments-differ
      ctx.save_for_backward(a, w, offs)
      return mm8(a, w, offs)

    @staticmethod
    def backward(ctx, dy):  # pylint: disable=arguments-differ
      a, w, offs = ctx.saved_tensors
      return mm8(dy, w.mT, offs), torch._grouped_mm(a.mT, dy, offs=offs), None

  return ScaledGroupedMm.apply


def layer(torch, mm, x, experts, weights, w_gate, w_up, w_down):
  """Routes sorted by expert, grouped gate and up products (mm, grouped_mm's), SwiGLU, grouped
  down product, each route's row back, the weighted sum over k in f32: y of x's dtype."""
  F = torch.nn.functional
  T, k = experts.shape
  flat = experts.reshape(-1)
  order = torch.argsort(flat, stable=True)
  # Each expert's end row; searchsorted needs no device-to-host copy (bincount would).
  ends = torch.arange(w_gate.shape[0], device=flat.device, dtype=flat.dtype)
  offsets = torch.searchsorted(flat[order], ends, right=True).to(torch.int32)
  xs = x.index_select(0, order // k)
  h = F.silu(mm(xs, w_gate, offsets)) * mm(xs, w_up, offsets)
  inverse = torch.empty_like(order)
  inverse[order] = torch.arange(order.numel(), device=order.device)
  y_routes = mm(h, w_down, offsets).index_select(0, inverse).view(T, k, x.shape[1])
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


def _time_mode(torch, mm, job, params, sets, mode):
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

  def call(i):  # (out, an event after it), to wait for this call alone
    x, experts, weights, dy = sets[i]
    with torch.set_grad_enabled(mode != "fwd"):
      out = layer(torch, mm, x, experts, weights, *params)
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
