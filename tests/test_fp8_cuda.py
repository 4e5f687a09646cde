"""The CUDA FP8 forward (mok_moe_fwd_fp8 on platform CUDA: moe with Config(precision="fp8") on
backend "cuda") against NumPy and the XLA reference, with the checks and tolerances of
tests/fp8_cases.py, whose sums' bound is the tensor cores' (fp8_cases.ETA_TENSOR_CORES, on
platform gpu; the C++ CPU target passes the same checks with f32 sums' in tests/test_fp8.py, and
tests/test_fp8_accumulation.py runs them on an emulation of the tensor cores' sums).

In order of diagnosis: one tile of products chosen to be exact (a failure there is the GEMM, the
scales' layout or the quantizers, against NumPy's bits); then random cases, routings and
shapes with tails; the layer with its gradients (mok_moe_bwd_fp8's kernels); the bits of
quantize_experts' weights against bf16 weights; determinism, with and without CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_cases
import mok_jax
from cases import (BF16, COMMAND_BUFFER_FLAGS, CUDA_ROUTINGS, NO_COMMAND_BUFFER_FLAGS, REPLAYS,
                   assert_same_bits, cuda_routing, digest, grad_fn, in_fresh_process,
                   loss_and_grads,
                   make_case, named_grads)
from mok_jax import ops

pytestmark = pytest.mark.gpu

FP8 = mok_jax.Config(precision="fp8")


def test_one_exact_tile():
  """128 tokens of one expert, H = I = 128: one gate|up tile, one down tile, one k-step each."""
  fp8_cases.check_exact(fp8_cases.exact_case(T=128, H=128, I=128, E=1, Is=0), 128)


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_exact_products(block_m):
  """Two experts of 100 rows (a tile with padding rows), two k-steps and two column tiles of
  gate|up, scales of their own in every block, a shared expert."""
  fp8_cases.check_exact(fp8_cases.exact_case(), block_m)


# (T, H, I, E, k, Is): T = 1; rows that end in a part of a tile; I of three gate|up column
# tiles; H = 384, whose second down tile has one 128-column half past H; 512 experts, most
# empty.
SHAPES = ((1, 128, 128, 1, 1, 0), (37, 128, 256, 5, 2, 0), (300, 256, 384, 8, 8, 128),
          (513, 384, 128, 16, 4, 128), (2048, 512, 256, 64, 6, 0), (40, 256, 128, 512, 16, 128))


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
@pytest.mark.parametrize("T, H, I, E, k, Is", SHAPES)
def test_forward_against_reference(T, H, I, E, k, Is, block_m):
  fp8_cases.check_against_reference(fp8_cases.random_case(T, H, I, E, k, Is, seed=T), block_m)


@pytest.mark.parametrize("name", CUDA_ROUTINGS)
def test_adversarial_routing(name):
  """All routes to one expert, empty experts, ids out of range (-1, E, 2^31 - 1: no row, never
  an address), every id invalid, one expert twice in a token's row."""
  experts = cuda_routing(name, T=700, E=8, k=3)
  fp8_cases.check_against_reference(fp8_cases.random_case(700, 128, 256, 8, 3, 128, 3, experts),
                                    64)


@pytest.mark.parametrize("name", CUDA_ROUTINGS)
def test_gradients_under_adversarial_routing(name):
  """mok_moe_bwd_fp8's kernels under test_adversarial_routing's routings: the gradients as close
  to the exact ones as the XLA reference's FP8 gradients, zeros where no route reaches."""
  case = make_case(T=300, H=128, I=256, E=8, k=3, Is=128, dtype=BF16, seed=5,
                   experts=cuda_routing(name, T=300, E=8, k=3))
  config = mok_jax.Config(precision="fp8")
  fp8_cases.check_fp8_grads(loss_and_grads(case, "cuda", config)[1],
                            loss_and_grads(case, "xla", config)[1], loss_and_grads(case, "xla")[1])


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_sums_are_promoted_every_k_block(block_m):
  """x's first 128-block one exact product larger than the rest of its row: sums that ran past
  that block in the tensor cores would truncate every later add at its scale (the emulation's
  no_promotion bug fails the hq scales by 1%, tests/test_fp8_accumulation.py)."""
  fp8_cases.check_against_reference(fp8_cases.promotion_case(), block_m)


def _used(buffers):
  """The buffers' rows that the call defines: routed rows past offsets[E] are never written."""
  used = int(buffers.offsets[-1])
  return ops.Fp8Buffers(*(
      a[:used] if name in ("xq", "hq", "y_routed") else
      a[:, :used] if name in ("xq_scale", "hq_scale") else a
      for name, a in zip(ops.Fp8Buffers._fields, buffers)))


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_bitwise_deterministic(block_m):
  case = fp8_cases.random_case(2048, 256, 256, 32, 6, 128, seed=5)
  first = fp8_cases.run_target(case, block_m)
  for _ in range(2):
    again = fp8_cases.run_target(case, block_m)
    assert_same_bits(again[0], first[0], "y")
    for name, a, b in zip(ops.Fp8Buffers._fields, _used(again[1]), _used(first[1])):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_layer_and_gradients(block_m):
  """y: the bits of moe_fwd_fp8 on the same weights, whose buffers pass every stage's check
  (fp8_cases.check_target) against the XLA backend's y; the gradients (mok_moe_bwd_fp8's
  kernels) as close to the exact ones as the XLA reference's FP8 gradients
  (fp8_cases.check_fp8_grads), and the same bits with Config.recompute."""
  case = make_case(T=600, H=256, I=384, E=8, k=2, Is=128, dtype=BF16, seed=9)
  config = mok_jax.Config(block_m=block_m, precision="fp8")
  y, grads = loss_and_grads(case, "cuda", config)
  want_y, want = loss_and_grads(case, "xla", config)
  target = fp8_cases.run_target(case, block_m)
  assert_same_bits(y, target[0], "y of the layer and of moe_fwd_fp8")
  fp8_cases.check_target(case, *target, want_y)
  fp8_cases.check_fp8_grads(grads, want, loss_and_grads(case, "xla")[1])
  recomputed = loss_and_grads(case, "cuda", dataclasses.replace(config, recompute=True))[1]
  for name in grads:
    assert_same_bits(recomputed[name], grads[name], f"d{name} with recompute")


def _layer_loss(case, quantized, backend="cuda"):
  def loss(x, weights, w_gate, w_up, w_down, shared):
    ws = (w_gate, w_up, w_down)
    if quantized:
      ws = mok_jax.quantize_experts(*ws)
    y = mok_jax.moe(x, case.experts, weights, *ws, shared=shared, config=FP8, backend=backend)
    return jnp.sum(y.astype(jnp.float32) * case.dy), y

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def test_quantized_weights_give_the_bits_of_the_arrays():
  case = make_case(T=300, H=256, I=256, E=8, k=4, Is=128, dtype=BF16, seed=4)
  (_, y0), g0 = _layer_loss(case, quantized=False)(*case.params())
  (_, y1), g1 = _layer_loss(case, quantized=True)(*case.params())
  assert_same_bits(y1, y0, "y")
  for name, a in named_grads(case, g1).items():
    assert_same_bits(a, named_grads(case, g0)[name], f"d{name}")


def test_auto_picks_cuda_for_fp8():
  dims = ops.MoeDims(T=64, H=128, I=256, E=4, k=2, Is=0)
  assert ops.cuda_unsupported_reason("gpu", BF16, dims, FP8) is None
  assert "divisible by 128" in ops.cuda_unsupported_reason("gpu", BF16, dims._replace(I=192), FP8)
  case = make_case(T=64, H=128, I=256, E=4, k=2, dtype=BF16, seed=2)
  run = lambda backend: jax.jit(functools.partial(  # noqa: E731
      mok_jax.moe, config=FP8, backend=backend))(*case.args())
  assert_same_bits(run("auto"), run("cuda"), "auto")
  with pytest.raises(ValueError, match="backend='cuda' cannot run .*divisible by 128"):
    mok_jax.moe(*make_case(T=8, H=192, I=128, E=2, k=1, dtype=BF16).args(), config=FP8,
                backend="cuda")


def fp8_digests() -> dict:
  """sha256 of y of the CUDA FP8 forward on one case (a shared expert, tails), and of y and
  every gradient of its jitted value_and_grad, each block_m's called REPLAYS times:
  {str(block_m): [[digest of y, then of each gradient]] * REPLAYS}."""
  case = make_case(600, 256, 384, 16, 4, Is=128, dtype=BF16, seed=7)
  out = {}
  for block_m in ops.CUDA_BLOCK_MS:
    config = mok_jax.Config(block_m=block_m, precision="fp8")
    fwd = jax.jit(functools.partial(mok_jax.moe, shared=case.shared, config=config,
                                    backend="cuda"))
    grad = jax.jit(grad_fn(case, "cuda", config))
    runs = []
    for _ in range(REPLAYS):
      (_, y), g = grad(*case.params())
      runs.append([digest(fwd(*case.args())), digest(y), *map(digest, jax.tree.leaves(g))])
    out[str(block_m)] = runs
  return out


def test_same_bits_with_command_buffers():
  """The forward and backward captured into CUDA graphs and replayed give the bits of the plain
  ones, and every run the same."""
  digests = functools.partial(in_fresh_process, "test_fp8_cuda.fp8_digests",
                              XLA_PYTHON_CLIENT_PREALLOCATE="false")
  plain = digests(NO_COMMAND_BUFFER_FLAGS)
  graphs = digests(COMMAND_BUFFER_FLAGS)
  for block_m, runs in plain.items():
    assert runs == [runs[0]] * REPLAYS, (block_m, runs)
  assert graphs == plain


@pytest.mark.parametrize("name, w", fp8_cases.quantize_weight_cases())
def test_quantize_weight_kernel_has_the_numpy_bits(name, w):
  """mok_quantize_weight's kernel, which quantize_experts' "fp8" runs on a GPU."""
  fp8_cases.check_quantize_weight(w)
