"""The pure-JAX math of the `xla` backend (the layer itself is mok_jax.expert_parallel's, on one
device and under expert parallelism alike): dropless, differentiable, runs on any device.

It computes what the kernels compute, with the same rounding points (docs/design.md):
gate/up/down products accumulate in f32; the SwiGLU activation h and each route's expert output
are rounded to x's dtype (they are GEMM operands / kept outputs in the kernels), and so is the
shared expert's output (a route of weight 1); the sum over a token's k routes (j ascending) and
its shared output is taken in f32, and y is rounded once, at the end.

Grouping uses `jax.lax.ragged_dot` on rows sorted by expert (a stable sort, so the row order
within an expert is the rows' own, ascending (t, j) as in the kernels' layout). The combine
gathers each route's output from its slot and sums the k routes in j order: no scatter-add, so
results do not depend on the order in which a device executes atomic updates.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mok_jax import quantize


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


def shared_mlp(x, shared, precision="bf16"):
  """The shared expert's output, rounded to x's dtype and returned in f32:
  (silu(x @ ws_gate) * (x @ ws_up)) @ ws_down; its products block-quantized by `precision`'s
  recipe unless it is "bf16" (`quantized_dot`)."""
  ws_gate, ws_up, ws_down = shared
  if precision == "bf16":
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32,
                            precision=_precision(x.dtype))
    y = dot(swiglu(dot(x, ws_gate), dot(x, ws_up), x.dtype), ws_down)
  else:
    dot = quantized_dot(functools.partial(jnp.dot, preferred_element_type=jnp.float32,
                                          precision=jax.lax.Precision.HIGHEST), precision)
    y = dot(silu(dot(x, ws_gate)) * dot(x, ws_up), ws_down)
  return y.astype(x.dtype).astype(jnp.float32)


def quantized_dot(dot, recipe):
  """dot(a (M, K), w (..., K, N), *extra) -> (M, N) f32 (jnp.dot, or a ragged_dot whose group
  sizes are `extra`: arrays, not closed over, so that the custom VJP sees them) on
  block-quantized operands (mok_jax.quantize, `recipe`), as the FP8 kernels compute:

    forward      a in 1 x block along K, w in its weight blocks; f32 products and sums
    d a          the cotangent in 1 x block along N (its reduction there) times w^T in blocks
    d w          a^T times the cotangent, both in w's dtype, unquantized (a bf16 GEMM)

  The dequantized values are exact in f32, so HIGHEST-precision f32 products of them are the
  kernels' e4m3 products, summed in f32. w may be a quantize.QuantizedWeight: its blocks then
  serve the forward and d a as they are, d w is w.r.t. its master (the same GEMM: d w never
  reads w's values), and its blocks get zero cotangents."""
  blk = quantize.act_block(recipe)

  def vary_and_dot(a, w, *extra):
    # Under shard_map both operands vary like their union first, so that each gradient varies
    # like its operand (as in nan_local).
    a, w = vary((a, w), frozenset().union(*map(varying_axes, jax.tree.leaves((a, w)))))
    return f(a, w, *extra)

  def weight_values(w, reduce_axis):
    if isinstance(w, quantize.QuantizedWeight):
      return w.values(reduce_axis)
    return quantize.fake_quantize(w, quantize.weight_block(recipe, reduce_axis), recipe)

  @jax.custom_vjp
  def f(a, w, *extra):
    return forward(a, w, *extra)[0]

  def forward(a, w, *extra):
    aq = quantize.fake_quantize(a, (1, blk), recipe)
    return dot(aq, weight_values(w, -2), *extra), (a, w, extra)

  def backward(res, g):
    a, w, extra = res
    gq = quantize.fake_quantize(g, (1, blk), recipe)
    wq = weight_values(w, -1)
    master = w.master if isinstance(w, quantize.QuantizedWeight) else w
    _, data_t = jax.vjp(lambda a_: dot(a_, wq, *extra), a.astype(jnp.float32))  # linear in a_
    _, weight_t = jax.vjp(lambda w_: dot(a.astype(master.dtype), w_, *extra), master)
    (da,), (dw,) = data_t(gq), weight_t(g.astype(master.dtype).astype(jnp.float32))
    dw = dw.astype(master.dtype)
    if isinstance(w, quantize.QuantizedWeight):
      dw = dataclasses.replace(jax.tree.map(jnp.zeros_like, w), master=dw)
    return (da.astype(a.dtype), dw, *(None,) * len(extra))

  f.defvjp(forward, backward)
  return vary_and_dot


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


def expert_rows(x_rows, ids, w_gate, w_up, w_down, *, ragged_dot=None, precision="bf16"):
  """Each row through its expert: (N, H) f32, expert ids[r]'s MLP of x_rows[r] before its
  rounding to x's dtype; 0 for a row whose id is outside [0, E).

  The rows are sorted by expert (a stable sort: within an expert they keep their order) and
  multiplied by jax.lax.ragged_dot, or `ragged_dot` with its signature (the benchmark's peers);
  None: `nan_local` of jax.lax.ragged_dot. precision "fp8" or "mxfp8": each product on
  block-quantized operands (`quantized_dot`; the weights arrays or quantize.QuantizedWeight of
  that recipe), h = silu(g) u quantized from f32 as the FP8 kernels' epilogue does; "bf16": as
  written above, h rounded to x's dtype.
  """
  if ragged_dot is None:
    ragged_dot = nan_local(jax.lax.ragged_dot)
  if precision == "bf16" and any(isinstance(w, quantize.QuantizedWeight)
                                 for w in (w_gate, w_up, w_down)):
    raise ValueError("expert_rows: quantized weights need an FP8 precision")
  E = w_gate.shape[0]
  valid = (ids >= 0) & (ids < E)
  # Rows without an expert get group E: they sort after every real group and fall outside
  # sum(group_sizes), so ragged_dot reads no expert for them; `where` zeroes them anyway.
  group = jnp.where(valid, ids, E)
  order = jnp.argsort(group, stable=True)
  group_sizes = jnp.bincount(group, length=E + 1)[:E].astype(jnp.int32)
  xs = x_rows[order]
  if precision == "bf16":
    dot = functools.partial(ragged_dot, group_sizes=group_sizes,
                            preferred_element_type=jnp.float32,
                            precision=_precision(x_rows.dtype))
    out = dot(swiglu(dot(xs, w_gate), dot(xs, w_up), x_rows.dtype), w_down)
  else:
    grouped = quantized_dot(
        lambda a, w, sizes: ragged_dot(a, w, group_sizes=sizes,
                                       preferred_element_type=jnp.float32,
                                       precision=jax.lax.Precision.HIGHEST), precision)

    def dot(a, w):
      return grouped(a, w, group_sizes)

    out = dot(silu(dot(xs, w_gate)) * dot(xs, w_up), w_down)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  return jnp.where(valid[:, None], out[inverse], 0.0)


def combine(rows, slot, weights, extra, out_dtype):
  """out[t] = round(sum_j weights[t, j] rows[slot[t, j]] in j order + extra[t]), summed in f32.

  rows (N, H) of x's dtype; slot (T, k) int32, -1: no row (the route contributes nothing,
  whatever its weight); weights None (every weight 1) or (T, k) f32; extra None or (T, H) f32.
  The forward's y and the backward's dx on the XLA backend, on one device and under expert
  parallelism alike: the same ops on the same rows give the same bits.
  """
  has = slot >= 0
  got = jnp.where(has[..., None], rows[jnp.maximum(slot, 0)], 0).astype(jnp.float32)
  if weights is not None:
    # Each product rounded to f32 on its own before it is added: a compiler may fuse a multiply
    # and the add after it into an FMA in one program and not in another, which would change
    # y's bits with the number of ranks. An integer step between them is what no compiler fuses
    # through: p | [p == ~0] is p (all ones already has its low bit set), but no compiler
    # knows it, even where it knows p.
    product = jax.lax.bitcast_convert_type(weights[..., None] * got, jnp.uint32)
    product = product | (product == jnp.uint32(0xFFFFFFFF)).astype(jnp.uint32)
    got = jax.lax.bitcast_convert_type(product, jnp.float32)
  terms = jnp.where(has[..., None], got, 0.0)
  acc = jnp.zeros((slot.shape[0], rows.shape[1]), jnp.float32)
  for j in range(slot.shape[1]):
    acc = acc + terms[:, j]
  if extra is not None:
    acc = acc + extra
  return acc.astype(out_dtype)
