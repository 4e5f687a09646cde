"""The public operations: `route` and `moe` (the custom-VJP composition of the FFI targets).

`moe` validates its arguments at trace time, picks a backend, runs explicitly sharded inputs in
`shard_map` where their shardings place them (mok_jax.sharded), and, under `shard_map` with
`axis_name`, runs expert parallelism (mok_jax.expert_parallel): each routed row goes to the
rank of its expert and its output back to its home slot, and y has the same bits for every
number of ranks. Dropless unless Config.ep_capacity bounds the rows a rank sends to another.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from mok_jax import expert_parallel, ops, quantize, reference, sharded
from mok_jax.config import Config

BACKENDS = ("auto", "xla", "ffi", "cuda")
SCORES = ("softmax", "sigmoid")


def route(logits, top_k, *, score="softmax", renormalize=True, n_groups=None, topk_groups=None,
          bias=None):
  """Picks top_k experts per token from router logits.

  Args:
    logits: (..., E) router logits, any float dtype; scores are computed in f32.
    top_k: experts per token, 1 <= top_k <= E.
    score: "softmax" (over E) or "sigmoid" (per expert).
    renormalize: divide the k weights of a token by (their sum + 1e-20).
    n_groups, topk_groups: DeepSeek-V3 group-limited routing. Experts form n_groups contiguous
      groups; a group's score is the sum of its two highest biased scores (its highest when a
      group has one expert); experts outside the best topk_groups groups are not selectable.
    bias: optional (E,) selection bias (aux-loss-free balancing). It changes which experts are
      picked; the returned weights are the unbiased scores. No gradient flows into it.

  Returns:
    experts: (..., top_k) int32 ids, in descending order of biased score (ties: lower id first).
    weights: (..., top_k) f32, differentiable in logits.
  """
  logits = jnp.asarray(logits)
  if logits.ndim < 1 or not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"route: logits must be a float array (..., E), got {logits.dtype} "
                     f"{logits.shape}")
  E = logits.shape[-1]
  if not isinstance(top_k, int) or not 1 <= top_k <= E:
    raise ValueError(f"route: top_k must be an int in [1, E={E}], got {top_k!r}")
  if score not in SCORES:
    raise ValueError(f"route: score must be one of {SCORES}, got {score!r}")
  logits = logits.astype(jnp.float32)
  scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
  select = scores
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (E,):
      raise ValueError(f"route: bias must have shape (E,) = ({E},), got {bias.shape}")
    select = select + jax.lax.stop_gradient(bias.astype(jnp.float32))
  if (n_groups is None) != (topk_groups is None):
    raise ValueError("route: n_groups and topk_groups go together; got "
                     f"n_groups={n_groups!r}, topk_groups={topk_groups!r}")
  if n_groups is not None:
    select = _limit_to_groups(select, top_k, n_groups, topk_groups)
  _, experts = _top_k(jax.lax.stop_gradient(select), top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if renormalize:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return experts.astype(jnp.int32), weights


def _top_k(v, k):
  """jax.lax.top_k, without gathering tokens that explicit sharding splits."""
  return sharded.rowwise(lambda a: jax.lax.top_k(a, k), v)


def _limit_to_groups(select, top_k, n_groups, topk_groups):
  E = select.shape[-1]
  if not isinstance(n_groups, int) or n_groups < 1 or E % n_groups:
    raise ValueError(f"route: n_groups must be a positive int dividing E={E}, got {n_groups!r}")
  if not isinstance(topk_groups, int) or not 1 <= topk_groups <= n_groups:
    raise ValueError(f"route: topk_groups must be an int in [1, n_groups={n_groups}], got "
                     f"{topk_groups!r}")
  size = E // n_groups
  if top_k > topk_groups * size:
    raise ValueError(f"route: top_k={top_k} exceeds the {topk_groups * size} experts of "
                     f"topk_groups={topk_groups} groups of {size}")
  grouped = select.reshape(*select.shape[:-1], n_groups, size)
  group_score = _top_k(grouped, min(2, size))[0].sum(axis=-1)
  _, best = _top_k(jax.lax.stop_gradient(group_score), topk_groups)
  keep = jnp.any(best[..., :, None] == jnp.arange(n_groups), axis=-2)
  return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(select.shape)


def moe(x, experts, weights, w_gate, w_up, w_down, *, shared=None, axis_name=None, config=None,
        backend="auto"):
  """The MoE layer: y[t] = shared(x[t]) + sum_j weights[t, j] * expert_{experts[t, j]}(x[t]).

  expert_e(v) = (silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]; shared(v) is the same MLP
  with the shared weights, or 0. Products accumulate in f32; the SwiGLU activation and each
  route's expert output are rounded to x's dtype; y is rounded once, at the end.

  Args:
    x: (T, H) tokens of this rank, bfloat16 or float32.
    experts: (T, k) integer global expert ids. An id outside [0, E) contributes nothing.
    weights: (T, k) float combine weights (used in f32).
    w_gate, w_up: (E_local, H, I); w_down: (E_local, I, H); dtype of x. Or all three
      quantized once by `mok_jax.quantize_experts` (with an FP8 `Config.precision`, its recipe,
      on the "xla" backend): the bits of y and of every gradient that the arrays give, the
      weight gradients w.r.t. the master weights they were quantized from.
    shared: None or (ws_gate (H, Is), ws_up (H, Is), ws_down (Is, H)), dtype of x.
    axis_name: None, or the `shard_map` axis over which experts are sharded: with P ranks,
      E = P * E_local and global expert e lives on rank e // E_local. Without it, inputs with
      explicit shardings (AxisType.Explicit) place the layer themselves: tokens split over
      mesh axes stay where they are, expert stacks split over one axis run expert parallelism
      over it (mok_jax.sharded), and y is sharded as x.
    config: `mok_jax.Config` knobs for the FFI backends (default: `Config()`).
    backend: "auto" (the CUDA kernel where device, dtype and shapes allow it, else "xla"),
      "xla" (pure JAX, any device), "ffi" (this project's FFI targets: the C++ reference on CPU,
      the CUDA kernel on GPU), "cuda" (the CUDA kernel, or an error saying why it cannot run).

  Returns:
    y: (T, H), dtype of x. Differentiable in x, weights and every weight tensor.
  """
  if config is None:
    config = Config()
  elif not isinstance(config, Config):
    raise ValueError(f"moe: config must be a mok_jax.Config, got {type(config).__name__}")
  n_ranks = 1 if axis_name is None else jax.lax.axis_size(axis_name)
  experts, weights = _as_ids(experts), jnp.asarray(weights)
  _check_quantized(w_gate, w_up, w_down, shared, config, backend)
  dims = ops.check_moe_args(x, experts, weights, w_gate, w_up, w_down, shared)
  if not jnp.issubdtype(experts.dtype, jnp.integer):
    raise ValueError(f"moe: experts must be an integer array, got {experts.dtype}")
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise ValueError(f"moe: weights must be a float array, got {weights.dtype}")
  E = n_ranks * dims.E
  if dims.k > E:
    raise ValueError(f"moe: top_k = experts.shape[1] = {dims.k} exceeds the number of experts "
                     f"E = {E} ({n_ranks} rank(s) x {dims.E} local)")
  if axis_name is None:
    where = sharded.placement(x, experts, weights, *map(_master, (w_gate, w_up, w_down)),
                              shared)
    if where is not None:
      return placed_moe(x, experts, weights, w_gate, w_up, w_down, shared, where=where,
                        config=config, backend=backend)
  return _layer(x, experts, weights, w_gate, w_up, w_down, shared, axis_name=axis_name,
                config=config, backend=backend)


def _master(w):
  """The array a quantized weight stands for (the one its sharding is read from)."""
  return w.master if isinstance(w, quantize.QuantizedWeight) else w


def _check_quantized(w_gate, w_up, w_down, shared, config, backend):
  """Quantized expert weights (quantize.QuantizedWeight) go together, with the precision of
  their recipe, to the backend that has FP8 products; their blocks match their masters."""
  named = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
  quantized = [n for n, w in named.items() if isinstance(w, quantize.QuantizedWeight)]
  if any(isinstance(w, quantize.QuantizedWeight) for w in (shared or ())):
    raise ValueError("moe: the shared expert takes arrays (of x's dtype; an FP8 precision "
                     "quantizes them in the call); mok_jax.quantize_experts is for the routed "
                     "experts' w_gate, w_up, w_down")
  if not quantized:
    return
  if len(quantized) != 3:
    raise ValueError(f"moe: {', '.join(quantized)} quantized but not "
                     f"{', '.join(n for n in named if n not in quantized)}; pass all three "
                     "from mok_jax.quantize_experts(w_gate, w_up, w_down), or all three arrays")
  recipe = w_gate.recipe
  if config.precision == "bf16":
    raise ValueError(f"moe: quantized expert weights (recipe {recipe!r}) need "
                     f"Config(precision={recipe!r}); for bf16 products pass the master weights "
                     "(w.master)")
  for name, w in named.items():
    quantize.check_quantized(w, name, config.precision)


def _layer(x, experts, weights, w_gate, w_up, w_down, shared=None, *, axis_name, config,
           backend):
  """The layer on this rank's checked inputs (`moe`, or `sharded.sharded_moe` for each shard):
  the fused single-rank call where the backend has one and no axis is named, else the routed
  layer of mok_jax.expert_parallel."""
  config = Config() if config is None else config
  dims = ops.check_moe_args(x, experts, weights, w_gate, w_up, w_down, shared)
  n_ranks = 1 if axis_name is None else jax.lax.axis_size(axis_name)
  weights = weights.astype(jnp.float32)
  fused = _fused_impl(backend, x.dtype, dims, config)
  if fused is not None and axis_name is None:
    return fused(x, _local_ids(experts, dims.E), weights, w_gate, w_up, w_down, shared)
  pieces = (expert_parallel.XlaPieces(precision=config.precision) if fused is None else
            expert_parallel.FfiPieces(config, int(n_ranks)))
  layer = functools.partial(expert_parallel.routed_moe, pieces=pieces, axis_name=axis_name,
                            config=config)
  if fused is None and axis_name is None:
    return _in_explicit_shard_map(layer, x, experts, weights, w_gate, w_up, w_down, shared)
  return layer(x, experts, weights, w_gate, w_up, w_down, shared)


def _in_explicit_shard_map(layer, *args):
  """layer(*args), in shard_map over the mesh's Explicit axes if x is typed on such a mesh
  (replicated there: mok_jax.moe's placement takes anything split into shard_map), where
  ragged_dot and its transpose have no sharding rule (jax 0.10.2): every device runs the layer,
  as it would anyway."""
  mesh = getattr(jax.typeof(args[0]).sharding, "mesh", None)
  explicit = {a for a, t in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()))
              if t == AxisType.Explicit}
  if not explicit:
    return layer(*args)
  return jax.shard_map(layer, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                       axis_names=explicit)(*args)


@functools.partial(jax.jit, static_argnames=("where", "config", "backend"))
def placed_moe(x, experts, weights, w_gate, w_up, w_down, shared, *, where, config, backend):
  """The layer in shard_map over `where` (a sharded.Placement; jitted so that eager calls work
  too)."""
  layer = functools.partial(_layer, config=config, backend=backend)
  return sharded.sharded_moe(layer, x, experts, weights, w_gate, w_up, w_down, shared, where)


def _as_ids(experts):
  """experts as a JAX array, with no host id wrapped onto a valid one.

  With x64 off JAX keeps a host array of 64-bit ids in 32 bits, which would turn 2**32 + 3 into
  expert 3; an id that does not fit in int32 (out of range for any E) becomes -1 first.
  """
  if isinstance(experts, jax.Array):
    return experts
  host = np.asarray(experts)
  if (np.issubdtype(host.dtype, np.integer)
      and jax.dtypes.canonicalize_dtype(host.dtype).itemsize < host.dtype.itemsize):
    fits = (host >= 0) & (host <= np.iinfo(np.int32).max)
    host = np.where(fits, host, 0).astype(np.int32)
    host[~fits] = -1
  return jnp.asarray(host)


def _local_ids(experts, n_local):
  """int32 ids for the fused single-rank call: -1 for every id outside [0, n_local), except that
  int32 ids go as they are: every implementation drops ids outside [0, E) itself, and the select
  would be one more launch before the kernel's on every call.

  Comparing before the cast keeps an int64 id such as 2**32 + 3 from wrapping onto expert 3.
  """
  if experts.dtype == jnp.int32:
    return experts
  mine = (experts >= 0) & (experts < n_local)
  return jnp.where(mine, experts, -1).astype(jnp.int32)


def _fused_impl(backend, dtype, dims, config):
  """The FFI targets' fused single-rank layer for `backend` (None: the XLA backend's layer,
  mok_jax.expert_parallel with reference.py's math), or an error saying why `backend` cannot
  run here. Under an axis_name the same targets run on the routed rows
  (expert_parallel.FfiPieces)."""
  if backend not in BACKENDS:
    raise ValueError(f"moe: backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "xla":
    return None
  platform = jax.default_backend()
  if config.precision != "bf16":
    # The FP8 forward: the CUDA kernels, or (backend "ffi" on CPU) the C++ target.
    if backend == "ffi" and platform == "cpu":
      problem = ops.fp8_unsupported_reason(dtype, dims, config)
    else:
      problem = ops.cuda_unsupported_reason(platform, dtype, dims, config)
    if backend == "auto":
      return None if problem else functools.partial(_moe_fp8, config=config)
    if problem:
      raise ValueError(f"moe: backend={backend!r} cannot run Config(precision="
                       f"{config.precision!r}): {problem}")
    return functools.partial(_moe_fp8, config=config)
  cuda_problem = ops.cuda_unsupported_reason(platform, dtype, dims, config)
  if backend == "auto":
    return None if cuda_problem else functools.partial(_moe_ffi, config=config, ranks=1)
  if backend == "cuda" and cuda_problem:
    raise ValueError(f"moe: backend='cuda' cannot run: {cuda_problem}")
  if backend == "ffi":
    if platform == "cpu":
      ops.check_ffi_dtype(dtype)
    elif cuda_problem:
      raise ValueError(f"moe: backend='ffi' on platform {platform!r} cannot run: {cuda_problem}")
  return functools.partial(_moe_ffi, config=config, ranks=1)


def _moe_ffi(x, experts, weights, w_gate, w_up, w_down, shared, *, config, ranks):
  # Under shard_map (check_vma=True) a custom call needs operands that vary over the same mesh
  # axes. Casting them here, outside the custom VJP, lets JAX transpose the cast: the gradient
  # of an operand that is the same on every rank (a replicated weight) is summed over ranks.
  args = (x, experts, weights, w_gate, w_up, w_down, shared)
  axes = frozenset().union(*map(reference.varying_axes, jax.tree.leaves(args)))
  return _moe_ffi_vjp(jnp.dtype(x.dtype), config, ranks, *reference.vary(args, axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _moe_ffi_vjp(out_dtype, config, ranks, x, experts, weights, w_gate, w_up, w_down, shared):
  return _moe_ffi_infer(out_dtype, config, ranks)(x, experts, weights, w_gate, w_up, w_down,
                                                  shared)


def _moe_ffi_infer(out_dtype, config, ranks):
  """The primal, run when nothing is differentiated (inference).

  No backward will read the residuals, so the forward runs in recompute mode whatever
  config.recompute says, keeping no gu and writing none. y has the same bits in both modes (h
  comes from the f32 accumulators, not from the rounded gu). Under vmap with the weights
  unbatched, the batch goes into the token dimension: one call, each token's bits as alone.
  (Differentiated, the forward and backward run each element as a call of its own: their
  residuals and weight gradients are each element's.)
  """

  @jax.custom_batching.custom_vmap
  def infer(x, experts, weights, w_gate, w_up, w_down, shared):
    y, _ = _moe_ffi_call(out_dtype, config.block_m, True, ranks, x, experts, weights, w_gate,
                         w_up, w_down, shared)
    return y

  @infer.def_vmap
  def fold_batch(size, batched, *args):
    if any(jax.tree.leaves(batched[3:])):  # a batch of weights: a call per element
      def element(i):
        return infer(*(jax.tree.map(lambda v, b: v[i] if b else v, a, b)
                       for a, b in zip(args, batched)))
      return jax.lax.map(element, jnp.arange(size)), True
    x, experts, weights = (a if b else jnp.broadcast_to(a, (size, *a.shape))
                           for a, b in zip(args[:3], batched[:3]))
    flat = [a.reshape(-1, a.shape[-1]) for a in (x, experts, weights)]
    where = sharded.placement(*flat, *args[3:])
    if where is None:
      y = infer(*flat, *args[3:])
    else:  # the batch axis is split over mesh axes: its tokens stay where they are
      y = placed_moe(*flat, *args[3:], where=where, config=config, backend="ffi")
    return y.reshape(*x.shape[:-1], y.shape[-1]), True

  return infer


def _moe_ffi_call(out_dtype, block_m, recompute, ranks, x, experts, weights, w_gate, w_up,
                  w_down, shared):
  y, residuals = ops.moe_fwd(x, experts, weights, w_gate, w_up, w_down, shared,
                             out_dtype=out_dtype, block_m=block_m, recompute=recompute,
                             ranks=ranks)
  return reference.vary((y, residuals), reference.varying_axes(x))


def _moe_ffi_fwd(out_dtype, config, ranks, x, experts, weights, w_gate, w_up, w_down, shared):
  y, residuals = _moe_ffi_call(out_dtype, config.block_m, config.recompute, ranks, x, experts,
                               weights, w_gate, w_up, w_down, shared)
  return y, (x, experts, weights, w_gate, w_up, w_down, shared, residuals.saved())


def _moe_ffi_bwd(out_dtype, config, ranks, saved, dy):
  del out_dtype
  x, experts, weights, w_gate, w_up, w_down, shared, residuals = saved
  grads = ops.moe_bwd(dy, x, experts, weights, w_gate, w_up, w_down, shared, residuals,
                      block_m=config.block_m, recompute=config.recompute, ranks=ranks)
  grads = reference.vary(grads, reference.varying_axes(x))
  return (grads.x, None, grads.weights, grads.w_gate, grads.w_up, grads.w_down, grads.shared)


_moe_ffi_vjp.defvjp(_moe_ffi_fwd, _moe_ffi_bwd)


# The FP8 layer on the FFI targets (Config(precision="fp8")): mok_moe_fwd_fp8's forward, whose
# products are block-scaled e4m3 as reference.quantized_dot specifies them, and
# mok_moe_bwd_fp8's backward (its data gradients' products e4m3, its weight gradients bf16
# GEMMs, w.r.t. the weights quantized: straight through to the masters). The forward keeps gu
# and the weights' e4m3 blocks for the backward; with Config.recompute it keeps neither, and
# the backward runs the forward again.


def _moe_fp8(x, experts, weights, w_gate, w_up, w_down, shared, *, config):
  # As _moe_ffi: operands cast to vary like their union under shard_map, outside the VJP.
  args = (x, experts, weights, w_gate, w_up, w_down, shared)
  axes = frozenset().union(*map(reference.varying_axes, jax.tree.leaves(args)))
  return _moe_fp8_vjp(config, *reference.vary(args, axes))


def _fp8_forward(config, x, experts, weights, w_gate, w_up, w_down, shared, keep_gu=False):
  """y, and the Fp8Weights and Fp8Residuals that the backward takes (with keep_gu)."""
  blocks = tuple(map(ops.fp8_weight, (w_gate, w_up, w_down)))
  shared_blocks = None if shared is None else tuple(map(ops.fp8_weight, shared))
  y, buffers = ops.moe_fwd_fp8(x, experts, weights, *blocks, shared_blocks, out_dtype=x.dtype,
                               block_m=config.block_m, keep_gu=keep_gu)
  residuals = ops.Fp8Residuals(*buffers[:len(ops.Fp8Residuals._fields)])
  return reference.vary(y, reference.varying_axes(x)), (blocks, shared_blocks, residuals)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe_fp8_vjp(config, x, experts, weights, w_gate, w_up, w_down, shared):
  return _fp8_forward(config, x, experts, weights, w_gate, w_up, w_down, shared)[0]


def _moe_fp8_fwd(config, x, experts, weights, w_gate, w_up, w_down, shared):
  args = (x, experts, weights, w_gate, w_up, w_down, shared)
  if config.recompute:
    return _fp8_forward(config, *args)[0], (args, None)
  y, kept = _fp8_forward(config, *args, keep_gu=True)
  return y, (args, kept)


def _moe_fp8_bwd(config, saved, dy):
  args, kept = saved
  x, experts, weights, w_gate, w_up, w_down, shared = args
  if kept is None:
    kept = _fp8_forward(config, *args, keep_gu=True)[1]
  blocks, shared_blocks, residuals = kept
  grads = ops.moe_bwd_fp8(dy.astype(x.dtype), x, experts, weights, *blocks, shared_blocks,
                          residuals, block_m=config.block_m)
  grads = reference.vary(grads, reference.varying_axes(x))
  cotangent = quantize.master_cotangent
  d_shared = None if shared is None else tuple(map(cotangent, shared, grads.shared))
  return (grads.x, None, grads.weights, cotangent(w_gate, grads.w_gate),
          cotangent(w_up, grads.w_up), cotangent(w_down, grads.w_down), d_shared)


_moe_fp8_vjp.defvjp(_moe_fp8_fwd, _moe_fp8_bwd)
