"""The FP8 precisions on the XLA backend (Config(precision="fp8" | "mxfp8"), mok_jax.quantize):
the block quantizer against a NumPy one (the same bits), the quantized products against float64
on the dequantized blocks, forward and backward, and the layer against the bf16 layer."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from cases import BF16, F32, loss_and_grads, make_case, mesh_of, sharded_loss_and_grads
from mok_jax import quantize, reference

RECIPES = ("fp8", "mxfp8")


def numpy_quantize(a, block, recipe):
  """The recipe in NumPy: per block, scale = amax / 448 ("fp8") or 2^ceil(log2(amax / 448))
  ("mxfp8"), 1 for a zero block; values a / scale, saturated at 448, rounded to e4m3."""
  a = np.asarray(a, np.float32)
  bm, bn = block
  M, N = a.shape
  scale = np.ones((-(-M // bm), -(-N // bn)), np.float32)
  data = np.zeros(a.shape, ml_dtypes.float8_e4m3fn)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      blk = a[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
      amax = np.float32(np.abs(blk).max())
      if amax > 0:
        s = amax / np.float32(448) if recipe == "fp8" else np.exp2(np.ceil(np.log2(
            amax / np.float32(448))))
        scale[i, j] = np.float32(s)
      v = np.clip(blk / scale[i, j], -448, 448).astype(ml_dtypes.float8_e4m3fn)
      data[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = v
  return data, scale


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
  for backend in ("ffi", "cuda"):
    with pytest.raises(ValueError, match="runs on backend='xla' so far"):
      mok_jax.moe(*case.args(), config=mok_jax.Config(precision="fp8"), backend=backend)
  with pytest.raises(ValueError, match="recipe must be one of"):
    quantize.quantize(jnp.ones((2, 2)), (1, 2), "fp4")
