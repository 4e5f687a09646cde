"""The pure-JAX backend (`backend="xla"`): dropless, differentiable, runs on any device.

It computes exactly what the kernels compute, with the same rounding points (DESIGN.md):
gate/up/down products accumulate in f32; the SwiGLU activation h and each route's expert output
are rounded to x's dtype (they are GEMM operands / kept outputs in the kernels), and so is the
shared expert's output (a route of weight 1); the sum over a token's k routes (j ascending) and
its shared output is taken in f32, and y is rounded once, at the end.

Grouping uses `jax.lax.ragged_dot` on routes sorted by expert (a stable sort, so the row order
within an expert is ascending (t, j), as in the kernels' layout). The combine gathers each
route's output back by inverse permutation and sums the k routes in order: no scatter-add, so
results do not depend on the order in which a device executes atomic updates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec


def _precision(dtype):
  """HIGHEST for f32, so that f32 inputs do not silently drop to TF32 on GPUs; the default for
  bf16, whose products are exact either way (and some grouped matmuls, tokamax's among them,
  reject an explicit precision in their backward)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def silu(v):
  return v * jax.nn.sigmoid(v)


def swiglu(g, u, dtype):
  """h = silu(g) * u from f32 g, u, rounded to the GEMM operand dtype."""
  return (silu(g) * u).astype(dtype)


def shared_mlp(x, shared):
  """The shared expert's output, rounded to x's dtype and returned in f32:
  (silu(x @ ws_gate) * (x @ ws_up)) @ ws_down."""
  ws_gate, ws_up, ws_down = shared
  dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32,
                          precision=_precision(x.dtype))
  y = dot(swiglu(dot(x, ws_gate), dot(x, ws_up), x.dtype), ws_down)
  return y.astype(x.dtype).astype(jnp.float32)


def varying_axes(a) -> frozenset:
  """The shard_map axes over which `a` varies; empty outside shard_map or with check_vma off."""
  aval = jax.typeof(a)
  if hasattr(aval, "vma"):
    return frozenset(aval.vma)
  return frozenset(getattr(getattr(aval, "mat", None), "varying", ()))


def vary(tree, axes):
  """Types every leaf as varying over `axes` (a no-op at run time).

  The results of a custom call come back typed as varying over no axis, although a call on
  every rank of a shard_map returns what varies like its operands; and a custom VJP must give
  each operand a gradient that varies like it, which JAX's transpose of this cast sums over the
  axes it added."""

  def cast(a):
    missing = tuple(sorted(axes - varying_axes(a), key=str))
    if not missing:
      return a
    if hasattr(jax.lax, "pcast"):
      return jax.lax.pcast(a, missing, to="varying")
    return jax.lax.pvary(a, missing)  # older jax

  return jax.tree.map(cast, tree)


def _row_groups(group_sizes, rows):
  """The group of each of `rows` rows (G for the rows past sum(group_sizes))."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _finite(a):
  return jnp.where(jnp.isfinite(a), a, jnp.zeros((), a.dtype))


def _any_per_group(bad, groups, G):
  """(G, ...) whether any row of each group is `bad` (rows of group G are dropped)."""
  return jax.ops.segment_max(bad.astype(jnp.int32), groups, num_segments=G + 1)[:G] > 0


def nan_local(ragged_dot):
  """`ragged_dot` (lhs (M, K), rhs (G, K, N), group_sizes (G,), **kw) whose non-finite values
  stay where the math puts them, forward and backward.

  A grouped matmul may multiply each row by every group's weights and mask the products (0 x NaN
  is NaN): one expert's NaN would then reach every token. Here the product runs on the operands
  with their non-finite values zeroed, and its result is NaN exactly where a non-finite operand
  enters the sum: out[r, n] where row r of lhs, or column n of its group's rhs, has one; the
  gradients likewise. Finite operands give the bits of `ragged_dot`, and its own transpose."""

  def dot(lhs, rhs, group_sizes, **kw):
    # Under shard_map both operands vary like their union first (the expert weights may vary
    # over fewer axes than the tokens), so that each gradient varies like its operand.
    axes = varying_axes(lhs) | varying_axes(rhs)
    lhs, rhs = vary((lhs, rhs), axes)

    @jax.custom_vjp
    def local(lhs, rhs, group_sizes):
      return forward(lhs, rhs, group_sizes)[0]

    def forward(lhs, rhs, group_sizes):
      G = rhs.shape[0]
      groups = _row_groups(group_sizes, lhs.shape[0])
      out = ragged_dot(_finite(lhs), _finite(rhs), group_sizes=group_sizes, **kw)
      col_bad = jnp.concatenate([~jnp.all(jnp.isfinite(rhs), axis=1),
                                 jnp.zeros((1, rhs.shape[2]), bool)])[groups]
      bad = ~jnp.all(jnp.isfinite(lhs), axis=1)[:, None] | col_bad
      out = jnp.where(bad & (groups < G)[:, None], jnp.nan, out)
      return out, (lhs, rhs, group_sizes, groups)

    def backward(res, g):
      lhs, rhs, group_sizes, groups = res
      G = rhs.shape[0]
      _, transpose = jax.vjp(
          lambda a, b: ragged_dot(a, b, group_sizes=group_sizes, **kw), _finite(lhs),
          _finite(rhs))
      d_lhs, d_rhs = transpose(_finite(g))
      # d_lhs[r, k] = sum_n g[r, n] rhs[group r, k, n]; d_rhs[e, k, n] = sum over e's rows r of
      # lhs[r, k] g[r, n].
      k_bad = jnp.concatenate([~jnp.all(jnp.isfinite(rhs), axis=2),
                               jnp.zeros((1, rhs.shape[1]), bool)])[groups]
      lhs_bad = ~jnp.all(jnp.isfinite(g), axis=1)[:, None] | k_bad
      d_lhs = jnp.where(lhs_bad & (groups < G)[:, None], jnp.nan, d_lhs)
      rhs_bad = (_any_per_group(~jnp.isfinite(lhs), groups, G)[:, :, None] |
                 _any_per_group(~jnp.isfinite(g), groups, G)[:, None, :])
      return d_lhs, jnp.where(rhs_bad, jnp.nan, d_rhs), None

    local.defvjp(forward, backward)
    return local(lhs, rhs, group_sizes)

  return dot


def moe_local(x, experts, weights, w_gate, w_up, w_down, shared, *, out_dtype, config=None,
              ragged_dot=None):
  """The MoE layer over the experts held here.

  Args:
    x: (T, H) tokens.
    experts: (T, k) int32 expert ids local to w_gate's leading axis; an id outside [0, E) is a
      route to nobody and contributes nothing.
    weights: (T, k) f32 combine weights.
    w_gate, w_up: (E, H, I); w_down: (E, I, H); same dtype as x.
    shared: None or (ws_gate (H, Is), ws_up (H, Is), ws_down (Is, H)).
    out_dtype: dtype of y: x.dtype, or f32 for a partial sum that is reduced further.
    config: ignored (the XLA backend has no kernel knobs).
    ragged_dot: the grouped matmul, with jax.lax.ragged_dot's signature; None: `nan_local` of
      jax.lax.ragged_dot. The benchmark swaps in the peers' (jax's and tokamax's, as their users
      call them) to time the same layer on them.

  Returns:
    y: (T, H) of out_dtype.
  """
  del config
  if ragged_dot is None:
    ragged_dot = nan_local(jax.lax.ragged_dot)
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  explicit = {a for a, t in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()))
              if t == AxisType.Explicit}
  if explicit:
    # Typed replicated on Explicit axes (mok_jax.moe's placement takes anything split into
    # shard_map), where ragged_dot and its transpose have no sharding rule (jax 0.10.2):
    # every device runs the layer in shard_map, as it would anyway.
    local = functools.partial(moe_local, out_dtype=out_dtype, ragged_dot=ragged_dot)
    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                         axis_names=explicit)(
        x, experts, weights, w_gate, w_up, w_down, shared)
  f32 = jnp.float32
  T, k = experts.shape
  E = w_gate.shape[0]
  valid = (experts >= 0) & (experts < E)
  # Invalid routes get group id E: they sort after every real group and fall outside
  # sum(group_sizes), so ragged_dot never reads an expert for them; `where` zeroes them anyway.
  group = jnp.where(valid, experts, E).reshape(-1)
  order = jnp.argsort(group, stable=True)
  group_sizes = jnp.bincount(group, length=E + 1)[:E].astype(jnp.int32)
  xs = x[order // k]
  dot = functools.partial(ragged_dot, group_sizes=group_sizes,
                          preferred_element_type=f32, precision=_precision(x.dtype))
  h = swiglu(dot(xs, w_gate), dot(xs, w_up), x.dtype)
  y_routed = dot(h, w_down).astype(x.dtype)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  y_routed = y_routed[inverse].reshape(T, k, w_down.shape[-1])
  w = jnp.where(valid, weights, 0.0)
  y_routed = jnp.where(valid[:, :, None], y_routed, 0).astype(f32)
  y = jnp.einsum("tkh,tk->th", y_routed, w, precision=_precision(jnp.float32))
  if shared is not None:
    y = y + shared_mlp(x, shared)
  return y.astype(out_dtype)
