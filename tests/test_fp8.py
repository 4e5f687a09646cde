"""The FP8 precisions on the XLA backend (Config(precision="fp8" | "mxfp8"), mok_jax.quantize):
the block quantizer against a NumPy one (the same bits), the quantized products against float64
on the dequantized blocks, forward and backward, and the layer against the bf16 layer."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
import fp8_cases
from cases import (BF16, F32, GRAD_NAMES, assert_ep_bits, assert_same_bits, distinct_experts,
                   loss_and_grads,
                   make_case, mesh_of, named_grads, sharded_loss_and_grads)
from fp8_cases import numpy_quantize
from mok_jax import ops, quantize, reference

RECIPES = ("fp8", "mxfp8")


def random_array(shape, seed):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, (shape[0], 1)))
  a[: min(3, shape[0]), : min(40, shape[1])] = 0.0  # a zero block where the block is that small
  a[-1, -1] = 1e4  # past 448 times any other value of its block
  return a


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape, block", [((5, 300), (1, 128)), ((3, 300), (1, 32)),
                                          ((200, 130), (128, 128)), ((70, 45), (32, 1))])
def test_quantizer_has_the_numpy_bits(recipe, shape, block):
  a = random_array(shape, seed=shape[0])
  q = jax.jit(quantize.quantize, static_argnums=(1, 2))(jnp.asarray(a), block, recipe)
  data, scale = numpy_quantize(a, block, recipe)
  assert q.data.dtype == jnp.float8_e4m3fn and q.scale.shape == quantize.scale_shape(shape, block)
  np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint32), scale.view(np.uint32))
  np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
  if recipe == "mxfp8":  # e8m0: every scale a power of two
    mantissa = np.asarray(q.scale).view(np.uint32) & 0x7FFFFF
    assert not mantissa.any()
  deq = np.asarray(quantize.dequantize(q, block))
  want = data.astype(np.float64) * np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[
      :shape[0], :shape[1]]
  np.testing.assert_array_equal(deq, want.astype(np.float32))  # exact in f32
  assert np.abs(deq - a).max() <= np.abs(a).max() / 16 + 1e-30  # half an e4m3 step at most


def ulps_away(x, k):
  """x moved k f32 ulp (up for k > 0)."""
  for _ in range(abs(k)):
    x = np.nextafter(x, np.float32(np.inf if k > 0 else -np.inf))
  return x


@pytest.mark.parametrize("k", [-3, -1, 0, 1, 3])
def test_quantizer_takes_quotients_for_estimates(k):
  """XLA:GPU's f32 division is within 2 ulp, not correctly rounded (XLA:CPU's, by a block's
  scale, is a product by its reciprocal): the quantizer takes each quotient for an estimate and
  decides the bits that depend on it exactly. Estimates k ulp off give NumPy's bits, for scales
  and for quotients at and beside every e4m3 midpoint m (ties, which round to the even
  neighbour, where the scale has few bits) and beside the edges m +- ulp / 2 of the f32 values
  that round to m (where which f32 value the quotient rounds to decides tie or not)."""
  rng = np.random.default_rng(7)
  e4m3 = np.arange(0x7F, dtype=np.uint8).view(fp8_cases.E4M3).astype(np.float32)
  mids = (e4m3[:-1] + e4m3[1:]) / 2
  up, down = np.nextafter(mids, np.float32(np.inf)) - mids, mids - np.nextafter(mids, 0)
  targets = np.concatenate([mids, mids + up / 2.0, mids - down / 2.0]).astype(np.float64)
  scales = np.concatenate([rng.uniform(1e-3, 10, 40), 1.5 * np.exp2(rng.integers(-8, 8, 8)),
                           rng.uniform(1, 2, 8) * np.exp2(rng.integers(-120, 100, 8))])
  s = np.repeat(scales.astype(np.float32), targets.size)
  at = (np.tile(targets, scales.size) * s).astype(np.float32)  # s m exactly where s is short
  a = np.concatenate([ulps_away(at, j) for j in range(-2, 3)] +
                     [rng.standard_normal(at.size).astype(np.float32) * s * 100])
  a = np.where(rng.random(a.size) < 0.5, -a, a).astype(np.float32)
  s = np.tile(s, a.size // s.size)
  want = np.clip(a / s, -448, 448).astype(fp8_cases.E4M3)
  got = jax.jit(quantize._e4m3_of_quotient)(a, s, ulps_away(a / s, k))
  np.testing.assert_array_equal(np.asarray(got).astype(fp8_cases.E4M3).view(np.uint8),
                                want.view(np.uint8))
  amax = np.abs(rng.standard_normal(4096) * np.exp2(rng.integers(-40, 40, 4096))).astype(
      np.float32)
  got = jax.jit(quantize._over_e4m3_max)(amax, ulps_away(amax / np.float32(448), k))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                (amax / np.float32(448)).view(np.uint32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_dot_against_float64_on_its_blocks(recipe):
  rng = np.random.default_rng(1)
  M, K, N = 40, 256, 160
  a = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((K, N)) / 16, jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  dot = reference.quantized_dot(functools.partial(
      jnp.dot, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST), recipe)
  y, pull = jax.vjp(dot, a, w)
  da, dw = pull(g)
  blk = quantize.act_block(recipe)
  f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
  aq = f64(quantize.fake_quantize(a, (1, blk), recipe))
  wq_f = f64(quantize.fake_quantize(w, quantize.weight_block(recipe, -2), recipe))
  wq_b = f64(quantize.fake_quantize(w, quantize.weight_block(recipe, -1), recipe))
  gq = f64(quantize.fake_quantize(g, (1, blk), recipe))
  np.testing.assert_allclose(f64(y), aq @ wq_f, rtol=0, atol=1e-5 * np.abs(aq @ wq_f).max())
  want_da = gq @ wq_b.T  # the data gradient: the quantized cotangent and blocks of w
  np.testing.assert_allclose(f64(da), want_da, rtol=0, atol=1e-2 * np.abs(want_da).max())
  # The weight gradient: a GEMM of the operands in w's dtype, unquantized.
  want_dw = f64(a).T @ f64(g.astype(jnp.bfloat16))
  np.testing.assert_allclose(f64(dw), want_dw, rtol=0, atol=1e-2 * np.abs(want_dw).max())


# One e4m3 rounding is at most 2^-4 of its value; x, W and h each take one before the output,
# and the backward's cotangents one more. Seen on this case: at most 0.08 of the largest value,
# forward and every gradient, both recipes.
FP8_RTOL = 0.12


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_follows_bf16_to_fp8_rounding(recipe):
  case = make_case(T=64, H=256, I=128, E=4, k=2, Is=128, dtype=BF16)
  y0, g0 = loss_and_grads(case, "xla")
  y1, g1 = loss_and_grads(case, "auto", mok_jax.Config(precision=recipe))  # auto: xla
  f = lambda a: np.asarray(a, np.float32)  # noqa: E731
  assert y1.dtype == y0.dtype and np.all(np.isfinite(f(y1)))
  assert np.abs(f(y1) - f(y0)).max() <= FP8_RTOL * np.abs(f(y0)).max()
  assert not np.array_equal(f(y1), f(y0))  # the products were quantized
  for name in g0:
    assert np.all(np.isfinite(f(g1[name]))), name
    assert np.abs(f(g1[name]) - f(g0[name])).max() <= FP8_RTOL * np.abs(f(g0[name])).max(), name
  again = loss_and_grads(case, "xla", mok_jax.Config(precision=recipe))
  assert np.array_equal(f(again[0]), f(y1))  # the same bits every run


def test_fp8_under_expert_parallelism():
  case = make_case(T=24, H=128, I=128, E=8, k=3, Is=None, dtype=F32)
  config = mok_jax.Config(precision="fp8")
  want_y, want_g = loss_and_grads(case, "xla", config)
  y, g = sharded_loss_and_grads(case, "xla", mesh_of(4), P("ep"), P("ep"), "ep", config)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * np.abs(want_y).max())
  for name in want_g:
    np.testing.assert_allclose(g[name], want_g[name], rtol=1e-5,
                               atol=1e-5 * np.abs(want_g[name]).max(), err_msg=name)


def test_fp8_errors():
  with pytest.raises(ValueError, match="Config.precision must be one of"):
    mok_jax.Config(precision="int8")
  case = make_case(T=8, H=128, I=128, E=2, k=1, dtype=BF16)
  fp8, mx = mok_jax.Config(precision="fp8"), mok_jax.Config(precision="mxfp8")
  with pytest.raises(ValueError, match=r"backend='cuda' cannot run Config\(precision='fp8'\): "
                     "JAX's default backend is 'cpu'"):
    mok_jax.moe(*case.args(), config=fp8, backend="cuda")
  with pytest.raises(ValueError, match=r"the FP8 kernels implement Config\(precision='fp8'\)"
                     r".*'mxfp8' runs on backend='xla'"):  # the FP8 targets implement "fp8"
    mok_jax.moe(*case.args(), config=mx, backend="ffi")
  with pytest.raises(ValueError, match="recipe must be one of"):
    quantize.quantize(jnp.ones((2, 2)), (1, 2), "fp4")


# Calls that the FP8 targets refuse, with the reason (ops.fp8_unsupported_reason): backend
# "ffi" on CPU raises it, "auto" takes the XLA backend instead.
FP8_TARGET_REFUSALS = [
    ("H", dict(H=192), r"the FP8 kernels need H, I and Is divisible by 128 .*got 192, 128, 0"),
    ("I", dict(I=64), r"the FP8 kernels need H, I and Is divisible by 128 .*got 128, 64, 0"),
    ("Is", dict(Is=64), r"the FP8 kernels need H, I and Is divisible by 128 .*got 128, 128, 64"),
    ("f32", dict(dtype=F32), r"the FP8 kernels take bfloat16 tokens and weights, got float32"),
]


@pytest.mark.parametrize("change, message", [r[1:] for r in FP8_TARGET_REFUSALS],
                         ids=[r[0] for r in FP8_TARGET_REFUSALS])
def test_fp8_target_refusals(change, message):
  shape = dict(T=8, H=128, I=128, E=2, k=1, Is=None, dtype=BF16) | change
  case = make_case(**shape)
  fp8 = mok_jax.Config(precision="fp8")
  dims = ops.MoeDims(8, shape["H"], shape["I"], 2, 1, shape["Is"] or 0)
  assert re.search(message, ops.fp8_unsupported_reason(shape["dtype"], dims, fp8))
  with pytest.raises(ValueError, match=r"backend='ffi' cannot run Config\(precision='fp8'\): " +
                     message):
    mok_jax.moe(*case.args(), shared=case.shared, config=fp8, backend="ffi")
  y = mok_jax.moe(*case.args(), shared=case.shared, config=fp8, backend="auto")  # the XLA path
  want = mok_jax.moe(*case.args(), shared=case.shared, config=fp8, backend="xla")
  assert_same_bits(y, want, "auto")


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_fp8_target_under_expert_parallelism(ep):
  """backend 'ffi' with precision 'fp8' under shard_map: the FP8 targets on the routed rows
  (expert_parallel.FfiPieces) give the fused single-device call's bits for y and every gradient
  (the shared expert's weight gradients, which ranks sum, to rounding), invalid ids included;
  'auto' on a CPU takes the XLA backend, as without an axis."""
  rng = np.random.default_rng(2)
  experts = distinct_experts(rng, 24, 3, 8)
  experts[1, 2], experts[10, 0] = -1, 8
  case = make_case(T=24, H=128, I=128, E=8, k=3, Is=128, dtype=BF16, seed=2, experts=experts)
  fp8 = mok_jax.Config(precision="fp8")
  want_y, want = loss_and_grads(case, "ffi", fp8)
  y, grads = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", fp8)
  assert_ep_bits(y, grads, want_y, want, f"FP8 EP={ep}", BF16)
  recomputed = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep",
                                      dataclasses.replace(fp8, recompute=True))
  assert_ep_bits(*recomputed, want_y, want, f"FP8 EP={ep} recompute", BF16)
  auto = sharded_loss_and_grads(case, "auto", mesh_of(ep), P("ep"), P("ep"), "ep", fp8)
  xla = sharded_loss_and_grads(case, "xla", mesh_of(ep), P("ep"), P("ep"), "ep", fp8)
  assert_same_bits(auto[0], xla[0], "auto under EP")


def test_moe_fwd_fp8_checks_its_operands():
  case = make_case(T=8, H=128, I=128, E=2, k=1, Is=128, dtype=BF16)
  qs = [ops.fp8_weight(q) for q in mok_jax.quantize_experts(case.w_gate, case.w_up, case.w_down)]
  shared = tuple(map(ops.fp8_weight, case.shared))
  e = jnp.asarray(case.experts, jnp.int32)

  def call(x=case.x, experts=e, weights=case.weights, ws=qs, shared=shared, out_dtype=BF16):
    return jax.eval_shape(lambda: ops.moe_fwd_fp8(x, experts, weights, *ws, shared,
                                                  out_dtype=out_dtype, block_m=64))

  y, buffers = call()
  assert y.shape == (8, 128) and buffers.xq.dtype == quantize.E4M3
  R = ops.routed_rows(8, 2, 64)
  assert buffers.xq_scale.shape == (1, ops.fp8_scale_pitch(R)) and ops.fp8_scale_pitch(R) % 4 == 0
  bad = [
      (dict(x=case.x.astype(F32)), r"x must be \(T, H\) bfloat16"),
      (dict(experts=e.astype(jnp.int16)), r"experts must be \(8, k\) int32"),
      (dict(weights=case.weights[:, :0]), r"weights must be \(8, 1\) float32"),
      (dict(ws=[qs[0], qs[1], qs[2]._replace(scale=qs[2].scale[:, :, :0])]),
       r"w_down must be an Fp8Weight of e4m3 \(2, 128, 128\) and f32 \(2, 1, 1\)"),
      (dict(ws=[qs[0], case.w_up, qs[2]]), r"w_up must be an Fp8Weight .*got ArrayImpl"),
      (dict(ws=[qs[0], qs[1], qs[2]._replace(
          k_major=jnp.swapaxes(qs[2].k_major, 1, 2)[:, :, :64])]),
       r"w_down must be an Fp8Weight of e4m3 \(2, 128, 128\) .*got float8_e4m3fn \(2, 128, 64\)"),
      (dict(shared=(shared[0], shared[1], shared[2]._replace(
          k_major=shared[2].k_major.astype(BF16)))),
       r"ws_down must be an Fp8Weight of e4m3"),
      (dict(out_dtype=jnp.float16), r"out_dtype must be bfloat16 or float32"),
  ]
  for kw, message in bad:
    with pytest.raises(ValueError, match=message):
      call(**kw)


# --- the C++ CPU target mok_moe_fwd_fp8 (backend "ffi"), checked as the CUDA one is ----------


@pytest.mark.parametrize("block_m", [64, 128])
def test_fp8_target_is_exact_where_the_products_are(block_m):
  fp8_cases.check_exact(fp8_cases.exact_case(), block_m)


@pytest.mark.parametrize("T, H, I, E, k, Is, routing", [
    (37, 128, 256, 5, 2, 0, "distinct"), (70, 256, 128, 4, 3, 128, "skewed"),
    (50, 128, 128, 3, 2, 128, "invalid")])
def test_fp8_target_against_the_reference(T, H, I, E, k, Is, routing):
  experts = fp8_cases.fp8_routing(routing, T, E, k)
  fp8_cases.check_against_reference(fp8_cases.random_case(T, H, I, E, k, Is, T, experts), 64)


def test_fp8_target_on_the_promotion_case():
  fp8_cases.check_against_reference(fp8_cases.promotion_case(), 64)


def test_fp8_target_layer_and_gradients():
  """moe on backend 'ffi' with precision 'fp8': y the bits of moe_fwd_fp8, whose stages pass
  fp8_cases.check_target against the XLA backend's y; the gradients (mok_moe_bwd_fp8) as close
  to the exact ones as the XLA reference's FP8 gradients (fp8_cases.check_fp8_grads), the same
  with Config.recompute, the same bits from quantize_experts' weights as from the arrays, and
  every run alike."""
  case = make_case(T=40, H=256, I=128, E=4, k=2, Is=128, dtype=BF16, seed=1)
  config = mok_jax.Config(precision="fp8")
  y, grads = loss_and_grads(case, "ffi", config)
  want_y, want = loss_and_grads(case, "xla", config)
  target = fp8_cases.run_target(case, 64)  # y does not depend on block_m
  assert_same_bits(y, target[0], "y of the layer and of moe_fwd_fp8")
  fp8_cases.check_target(case, *target, want_y)
  fp8_cases.check_fp8_grads(grads, want, loss_and_grads(case, "xla")[1])
  recomputed = loss_and_grads(case, "ffi", dataclasses.replace(config, recompute=True))[1]
  for name in grads:
    assert_same_bits(recomputed[name], grads[name], f"d{name} with recompute")
  again = loss_and_grads(case, "ffi", config)
  assert_same_bits(again[0], y, "y again")
  for name in grads:
    assert_same_bits(again[1][name], grads[name], f"d{name} again")
  (_, y0), g0 = layer_loss(case, config, quantized=False, backend="ffi")(*case.params())
  (_, y1), g1 = layer_loss(case, config, quantized=True, backend="ffi")(*case.params())
  assert_same_bits(y1, y0, "y from quantize_experts")
  g0, g1 = named_grads(case, g0), named_grads(case, g1)
  for name in g0:
    assert_same_bits(g1[name], g0[name], f"d{name} from quantize_experts")


@pytest.mark.parametrize("routing", ["skewed", "invalid"])
def test_fp8_target_gradients_under_routing(routing):
  """mok_moe_bwd_fp8 (backend 'ffi') where most routes go to one expert and others have none,
  and where ids fall outside [0, E): gradients as close to the exact ones as the reference's."""
  experts = fp8_cases.fp8_routing(routing, 50, 4, 2)
  case = make_case(T=50, H=128, I=128, E=4, k=2, Is=128, dtype=BF16, seed=3, experts=experts)
  config = mok_jax.Config(precision="fp8")
  fp8_cases.check_fp8_grads(loss_and_grads(case, "ffi", config)[1],
                            loss_and_grads(case, "xla", config)[1], loss_and_grads(case, "xla")[1])


# --- mok_jax.quantize_experts ---------------------------------------------------------------


def expert_weights(E=3, H=256, I=160, dtype=BF16, seed=3):
  """(w_gate, w_up, w_down) whose blocks differ in scale (I = 160: edge blocks of 32 columns)."""
  rng = np.random.default_rng(seed)
  scale = lambda *s: np.exp2(rng.integers(-4, 4, s))  # noqa: E731
  return tuple(jnp.asarray(rng.standard_normal(shape) * scale(shape[0], 1, shape[2]) / 16, dtype)
               for shape in ((E, H, I), (E, H, I), (E, I, H)))


def u8(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_experts_has_the_quantizer_bits(recipe):
  ws = expert_weights()
  qs = jax.jit(functools.partial(mok_jax.quantize_experts, recipe=recipe))(*ws)
  assert len(qs) == 3
  for w, q in zip(ws, qs):
    assert q.recipe == recipe and q.shape == w.shape and q.dtype == w.dtype
    assert np.array_equal(np.asarray(q.master).view(np.uint16), np.asarray(w).view(np.uint16))
    want = quantize.quantize(w, quantize.weight_block(recipe, -2), recipe)
    np.testing.assert_array_equal(u8(q.blocks.data), u8(want.data))
    np.testing.assert_array_equal(np.asarray(q.blocks.scale), np.asarray(want.scale))
    # Against the NumPy recipe too, on one expert.
    data, scale = numpy_quantize(np.asarray(w[1], np.float32),
                                 quantize.weight_block(recipe, -2), recipe)
    np.testing.assert_array_equal(u8(q.blocks.data[1]), data.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.blocks.scale[1]), scale)
    if recipe == "fp8":
      assert q.blocks_t is None  # the 128 x 128 blocks serve W^T
      np.testing.assert_array_equal(u8(q.k_major), u8(jnp.swapaxes(q.blocks.data, 1, 2)))
      assert q.blocks.scale.shape == (3, -(-w.shape[1] // 128), -(-w.shape[2] // 128))
    else:  # the data gradient's blocks run along N
      want_t = quantize.quantize(w, (1, 32), recipe)
      np.testing.assert_array_equal(u8(q.blocks_t.data), u8(want_t.data))
      np.testing.assert_array_equal(np.asarray(q.blocks_t.scale), np.asarray(want_t.scale))
      assert not np.array_equal(u8(q.blocks_t.data), u8(q.blocks.data)) and q.k_major is None
    for axis in (-2, -1):  # what each product reads: the per-call quantization's values
      np.testing.assert_array_equal(
          np.asarray(q.values(axis)),
          np.asarray(quantize.fake_quantize(w, quantize.weight_block(recipe, axis), recipe)))


@pytest.mark.parametrize("name, w", fp8_cases.quantize_weight_cases())
def test_quantize_weight_target_has_the_numpy_bits(name, w):
  """mok_quantize_weight (the C++ CPU target here), which quantize_experts' "fp8" calls."""
  fp8_cases.check_quantize_weight(w)


def test_quantize_weight_target_refuses_bad_buffers():
  w = jnp.ones((2, 256, 128), jnp.bfloat16)
  good = (jax.ShapeDtypeStruct((2, 256, 128), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((2, 128, 256), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((2, 2, 1), jnp.float32))
  for i, bad, message in [(1, jax.ShapeDtypeStruct((2, 256, 128), jnp.float8_e4m3fn),
                           r"k_major must be f8e4m3fn\[2, 128, 256\]"),
                          (2, jax.ShapeDtypeStruct((2, 1, 2), jnp.float32),
                           r"scale must be f32\[2, 2, 1\]"),
                          (0, jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16),
                           r"data must be f8e4m3fn")]:
    results = list(good)
    results[i] = bad
    with pytest.raises(Exception, match=message):
      jax.ffi.ffi_call("mok_quantize_weight", tuple(results))(w)
  with pytest.raises(Exception, match=r"w must be bf16 or f32 \(\.\.\., K, N\)"):
    jax.ffi.ffi_call("mok_quantize_weight", good)(w.astype(jnp.float16))
  with pytest.raises(ValueError, match="quantize_weight: w must be"):
    ops.quantize_weight(jnp.ones((128,), jnp.bfloat16))


def layer_loss(case, config, quantized, recipe=None, backend="xla"):
  """jit(value_and_grad) of sum(dy * y) w.r.t. (x, weights, w_gate, w_up, w_down, shared), the
  expert weights passed as they are or through quantize_experts inside the loss."""

  def loss(x, weights, w_gate, w_up, w_down, shared):
    ws = (w_gate, w_up, w_down)
    if quantized:
      ws = mok_jax.quantize_experts(*ws, recipe=recipe or config.precision)
    y = mok_jax.moe(x, case.experts, weights, *ws, shared=shared, config=config,
                    backend=backend)
    return jnp.sum(y.astype(jnp.float32) * case.dy), y

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


@pytest.mark.parametrize("recipe, Is", [("fp8", None), ("fp8", 128), ("mxfp8", 128)])
def test_quantized_weights_give_the_bits_of_the_arrays(recipe, Is):
  case = make_case(T=40, H=256, I=160, E=4, k=2, Is=Is, dtype=BF16, seed=4)
  # Rows and columns of the expert weights at scales up to 2^10 apart, so that blocks along K
  # and along N (mxfp8's two orientations) quantize them differently.
  rng = np.random.default_rng(7)
  spread = lambda w: (w * np.exp2(rng.integers(-5, 6, (*w.shape[:2], 1))) * np.exp2(  # noqa: E731
      rng.integers(-5, 6, (w.shape[0], 1, w.shape[2])))).astype(BF16)
  case = case._replace(w_gate=spread(case.w_gate), w_up=spread(case.w_up),
                       w_down=spread(case.w_down))
  config = mok_jax.Config(precision=recipe)
  (_, y0), g0 = layer_loss(case, config, quantized=False)(*case.params())
  (_, y1), g1 = layer_loss(case, config, quantized=True)(*case.params())
  (_, y_bf16), _ = layer_loss(case, mok_jax.Config(), quantized=False)(*case.params())
  assert not np.array_equal(np.asarray(y0, np.float32), np.asarray(y_bf16, np.float32))
  assert_same_bits(y1, y0, "y")
  g0, g1 = named_grads(case, g0), named_grads(case, g1)
  assert set(g1) == set(GRAD_NAMES[:5] if Is is None else GRAD_NAMES)
  for name in g0:
    assert np.abs(np.asarray(g0[name], np.float32)).max() > 0, name
    assert_same_bits(g1[name], g0[name], f"d{name}")


def test_the_layer_reads_the_blocks_not_the_master():
  case = make_case(T=16, H=128, I=128, E=2, k=1, dtype=BF16, seed=5)
  config = mok_jax.Config(precision="fp8")
  qs = mok_jax.quantize_experts(case.w_gate, case.w_up, case.w_down)
  other = [dataclasses.replace(q, master=q.master * 3) for q in qs]
  run = jax.jit(lambda *ws: mok_jax.moe(case.x, case.experts, case.weights, *ws, config=config))
  assert_same_bits(run(*other), run(*qs), "y")
  assert_same_bits(run(*qs), run(case.w_gate, case.w_up, case.w_down), "y")


def stacked_case(L=2, T=16, H=128, I=96, E=4, k=2, seed=6):
  rng = np.random.default_rng(seed)

  def normal(*shape, fan_in=1):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), BF16)

  ws = (normal(L, E, H, I, fan_in=H), normal(L, E, H, I, fan_in=H), normal(L, E, I, H, fan_in=I))
  experts = jnp.asarray(np.stack([distinct_experts(rng, T, k, E) for _ in range(L)]))
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (L, T, k)), jnp.float32)
  return normal(T, H), experts, weights, ws


@pytest.mark.parametrize("how", ["stacked", "in_body"])
def test_quantized_weights_under_scan(how):
  x, experts, weights, ws = stacked_case()
  config = mok_jax.Config(precision="fp8")

  def run(x, ws, quantize_how):
    if quantize_how == "stacked":  # quantized pytrees stacked over the layers, scanned over
      ws = jax.vmap(mok_jax.quantize_experts)(*ws)

    def body(h, layer):
      e, w, lw = layer
      if quantize_how == "in_body":
        lw = mok_jax.quantize_experts(*lw)
      return h + mok_jax.moe(h, e, w, *lw, config=config, backend="xla"), None

    h, _ = jax.lax.scan(body, x, (experts, weights, ws))
    return jnp.sum(h.astype(jnp.float32) ** 2)

  grad = jax.jit(jax.value_and_grad(run, argnums=(0, 1)), static_argnums=2)
  want_loss, (want_dx, want_dws) = grad(x, ws, None)
  loss, (dx, dws) = grad(x, ws, how)
  assert_same_bits(loss, want_loss, "loss")
  assert_same_bits(dx, want_dx, "dx")
  for name, a, b in zip(("w_gate", "w_up", "w_down"), dws, want_dws):
    assert a.shape == b.shape and np.abs(np.asarray(b, np.float32)).max() > 0, name
    assert_same_bits(a, b, f"d{name}")


def test_vmap_of_quantize_experts_is_per_layer():
  _, _, _, ws = stacked_case(L=3, I=64)
  for recipe in RECIPES:
    stacked = jax.vmap(functools.partial(mok_jax.quantize_experts, recipe=recipe))(*ws)
    for layer in range(3):
      alone = mok_jax.quantize_experts(*(w[layer] for w in ws), recipe=recipe)
      for s, a in zip(stacked, alone):
        assert s.recipe == a.recipe == recipe
        for leaf_s, leaf_a in zip(jax.tree.leaves(s), jax.tree.leaves(a)):
          np.testing.assert_array_equal(u8(leaf_s[layer]), u8(leaf_a))


def _replace_blocks(q, **kw):
  return dataclasses.replace(q, blocks=q.blocks._replace(**kw))


def _bad_moe_calls():
  """(id, call(case, qs_fp8, qs_mx), exception, message) for calls of moe and quantize_experts
  that must fail."""
  fp8, mx, bf16 = (mok_jax.Config(precision=p) for p in ("fp8", "mxfp8", "bf16"))

  def moe(case, ws, config=fp8, backend="xla", shared=None):
    return mok_jax.moe(case.x, case.experts, case.weights, *ws, shared=shared, config=config,
                       backend=backend)

  return [
      ("bf16_precision", lambda c, q, m: moe(c, q, bf16), ValueError,
       r"quantized expert weights \(recipe 'fp8'\) need Config\(precision='fp8'\)"),
      ("default_config", lambda c, q, m: moe(c, q, None), ValueError,
       r"need Config\(precision='fp8'\)"),
      ("fp8_weights_mxfp8_config", lambda c, q, m: moe(c, q, mx), ValueError,
       r"w_gate was quantized with recipe 'fp8', but Config\(precision='mxfp8'\)"),
      ("mxfp8_weights_fp8_config", lambda c, q, m: moe(c, m, fp8), ValueError,
       r"quantized with recipe 'mxfp8', but Config\(precision='fp8'\); quantize with "
       r"recipe='fp8'"),
      ("mixed_recipes", lambda c, q, m: moe(c, (q[0], q[1], m[2])), ValueError,
       r"w_down was quantized with recipe 'mxfp8'"),
      ("cuda", lambda c, q, m: moe(c, q, backend="cuda"), ValueError,
       r"backend='cuda' cannot run Config\(precision='fp8'\): JAX's default backend is 'cpu'"),
      ("mxfp8_ffi", lambda c, q, m: moe(c, m, mx, backend="ffi"), ValueError,
       r"the FP8 kernels implement Config\(precision='fp8'\)"),
      ("one_quantized", lambda c, q, m: moe(c, (q[0], c.w_up, c.w_down)), ValueError,
       r"w_gate quantized but not w_up, w_down; pass all three"),
      ("scale_shape", lambda c, q, m: moe(c, (_replace_blocks(q[0], scale=jnp.tile(
          q[0].blocks.scale, (1, 2, 1))), q[1], q[2])), ValueError, r"w_gate's blocks must be "
       r"e4m3 data .* f32 scales \(2, 1, 1\), got float8_e4m3fn \(2, 128, 128\) and float32 "
       r"\(2, 2, 1\)"),
      ("data_dtype", lambda c, q, m: moe(c, (q[0], _replace_blocks(q[1], data=q[1].blocks.data
          .astype(BF16)), q[2])), ValueError, r"w_up's blocks must be e4m3 data"),
      ("data_shape", lambda c, q, m: moe(c, (q[0], q[1], _replace_blocks(q[2], data=q[2].blocks
          .data[:, :64]))), ValueError, r"w_down's blocks must be e4m3 data of its master's "
       r"shape \(2, 128, 128\)"),
      ("master_shape", lambda c, q, m: moe(c, tuple(dataclasses.replace(w, master=w.master[:1])
                                                   for w in q)), ValueError,
       r"blocks must be e4m3 data of its master's shape \(1, 128, 128\)"),
      ("mxfp8_without_transpose", lambda c, q, m: moe(c, tuple(
          dataclasses.replace(w, blocks_t=None) for w in m), mx), ValueError,
       r"w_gate.blocks_t must be the blocks of W\^T for recipe 'mxfp8'"),
      ("fp8_with_transpose", lambda c, q, m: moe(c, tuple(
          dataclasses.replace(w, blocks_t=w.blocks) for w in q)), ValueError,
       r"w_gate.blocks_t must be None for recipe 'fp8'"),
      ("fp8_without_k_major", lambda c, q, m: moe(c, tuple(
          dataclasses.replace(w, k_major=None) for w in q)), ValueError,
       r"w_gate.k_major must be its blocks' e4m3 data K-major \(2, 128, 128\), got None"),
      ("k_major_dtype", lambda c, q, m: moe(c, (q[0], dataclasses.replace(
          q[1], k_major=q[1].k_major.astype(BF16)), q[2])), ValueError,
       r"w_up.k_major must be its blocks' e4m3 data K-major \(2, 128, 128\), got bfloat16"),
      ("mxfp8_with_k_major", lambda c, q, m: moe(c, tuple(
          dataclasses.replace(w, k_major=v.k_major) for w, v in zip(m, q)), mx), ValueError,
       r"w_gate.k_major must be None for recipe 'mxfp8'"),
      ("quantized_shared", lambda c, q, m: moe(c, q, shared=(q[0], c.w_up, c.w_down)),
       ValueError, r"the shared expert takes arrays"),
      ("master_dtype", lambda c, q, m: moe(c, mok_jax.quantize_experts(
          *(w.astype(F32) for w in (c.w_gate, c.w_up, c.w_down)))), ValueError,
       r"w_gate has dtype float32, x has bfloat16"),
      ("recipe", lambda c, q, m: mok_jax.quantize_experts(c.w_gate, c.w_up, c.w_down,
                                                          recipe="fp4"), ValueError,
       r"quantize_experts: recipe must be one of \('fp8', 'mxfp8'\), got 'fp4'"),
      ("shapes", lambda c, q, m: mok_jax.quantize_experts(c.w_gate, c.w_up, c.w_down[:, :64]),
       ValueError, r"w_gate, w_up must be \(E, H, I\) and w_down \(E, I, H\); got "
       r"\(2, 128, 128\), \(2, 128, 128\), \(2, 64, 128\)"),
      ("rank", lambda c, q, m: mok_jax.quantize_experts(c.w_gate[0], c.w_up, c.w_down),
       ValueError, r"w_gate must be a float array \(E, K, N\), got bfloat16 \(128, 128\)"),
      ("int_weights", lambda c, q, m: mok_jax.quantize_experts(
          c.w_gate, c.w_up.astype(jnp.int32), c.w_down), ValueError,
       r"w_up must be a float array \(E, K, N\), got int32"),
      ("twice", lambda c, q, m: mok_jax.quantize_experts(q[0], c.w_up, c.w_down), ValueError,
       r"w_gate is quantized already; pass its master weight"),
  ]


@pytest.mark.parametrize("call, exception, message",
                         [c[1:] for c in _bad_moe_calls()], ids=[c[0] for c in _bad_moe_calls()])
def test_quantized_weight_errors(call, exception, message):
  case = make_case(T=8, H=128, I=128, E=2, k=1, dtype=BF16)
  qs = mok_jax.quantize_experts(case.w_gate, case.w_up, case.w_down)
  mx = mok_jax.quantize_experts(case.w_gate, case.w_up, case.w_down, recipe="mxfp8")
  with pytest.raises(exception, match=message):
    call(case, qs, mx)
  with pytest.raises(exception, match=message):  # and the same at trace time under jit
    jax.jit(lambda q, m: call(case, q, m))(qs, mx)


def _layer_by_hand(params, x, config, top_k, quantized):
  """The layers' forward written out, the experts through quantize_experts or not."""
  x2 = x.reshape(-1, x.shape[-1])
  logits = jnp.dot(x2, params["router"], precision=jax.lax.Precision.HIGHEST)
  experts, weights = mok_jax.route(logits, top_k)
  cast = lambda n: params[n].astype(BF16)  # noqa: E731
  ws = tuple(map(cast, ("w_gate", "w_up", "w_down")))
  if quantized:
    ws = mok_jax.quantize_experts(*ws, recipe=config.precision)
  shared = tuple(map(cast, ("ws_gate", "ws_up", "ws_down")))
  y = mok_jax.moe(x2.astype(BF16), experts, weights, *ws, shared=shared, config=config,
                  backend="xla")
  return y.reshape(x.shape)


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_layers_with_fp8(framework):
  """The layers keep f32 master weights and quantize them in each call: the bits of
  quantize_experts on them, in y and in the parameters' gradients."""
  opts = dict(hidden_size=128, intermediate_size=64, num_experts=4, top_k=2,
              shared_intermediate_size=32, dtype=jnp.bfloat16, backend="xla",
              config=mok_jax.Config(precision="fp8"))
  x = jax.random.normal(jax.random.key(1), (2, 12, 128), jnp.float32)
  ct = jax.random.normal(jax.random.key(2), (2, 12, 128), jnp.float32)
  names = ("router", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
  if framework == "flax":
    nnx = pytest.importorskip("flax.nnx")
    from mok_jax.nn.flax import MoE
    moe = MoE(**opts, rngs=nnx.Rngs(0))
    params = {n: getattr(moe, n)[...] for n in names}
    y, grads = nnx.jit(lambda m: nnx.value_and_grad(
        lambda m: jnp.sum(m(x)[0].astype(jnp.float32) * ct))(m))(moe)
    grads = {n: grads[n][...] for n in names}
  else:
    eqx = pytest.importorskip("equinox")
    from mok_jax.nn.equinox import MoE
    moe = MoE(**opts, key=jax.random.key(0))
    params = {n: getattr(moe, n) for n in names}
    y, grads = eqx.filter_jit(eqx.filter_value_and_grad(
        lambda m: jnp.sum(m(x)[0].astype(jnp.float32) * ct)))(moe)
    grads = {n: getattr(grads, n) for n in names}

  def by_hand(params, quantized, config=opts["config"]):
    y = _layer_by_hand(params, x, config, opts["top_k"], quantized)
    return jnp.sum(y.astype(jnp.float32) * ct)

  for quantized in (False, True):
    want_y, want = jax.jit(jax.value_and_grad(by_hand), static_argnums=1)(params, quantized)
    assert_same_bits(y, want_y, f"loss, quantized={quantized}")
    for n in names:
      assert np.abs(np.asarray(want[n])).max() > 0, n
      assert_same_bits(grads[n], want[n], f"d{n}, quantized={quantized}")
  bf16_y = jax.jit(by_hand, static_argnums=(1, 2))(params, False, mok_jax.Config())
  assert not np.array_equal(np.asarray(bf16_y), np.asarray(y))  # the products were quantized


def test_quantized_weights_under_expert_parallelism():
  """Quantized expert stacks split over the ranks like the arrays (every leaf on its expert
  axis): the bits of the arrays with the same precision under the same sharding."""
  case = make_case(T=24, H=128, I=128, E=8, k=3, Is=None, dtype=BF16, seed=8)
  config = mok_jax.Config(precision="fp8")
  mesh, experts = mesh_of(4), jnp.asarray(case.experts)

  def layer(x, experts, weights, w_gate, w_up, w_down):
    return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, axis_name="ep", config=config,
                       backend="xla")

  sharded = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

  def loss(x, weights, w_gate, w_up, w_down, quantized):
    ws = (w_gate, w_up, w_down)
    if quantized:
      ws = mok_jax.quantize_experts(*ws)
    return jnp.sum(sharded(x, experts, weights, *ws).astype(jnp.float32) * case.dy)

  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))), static_argnums=5)
  args = (case.x, case.weights, case.w_gate, case.w_up, case.w_down)
  want_loss, want = grad(*args, False)
  got_loss, got = grad(*args, True)
  assert_same_bits(got_loss, want_loss, "loss")
  for name, a, b in zip(GRAD_NAMES, got, want):
    assert np.abs(np.asarray(b, np.float32)).max() > 0, name
    assert_same_bits(a, b, f"d{name}")
