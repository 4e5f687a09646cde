"""Config.recompute on the CUDA kernels (mok_moe_fwd / mok_moe_bwd on platform CUDA): the forward
keeps no gu, the backward re-runs the forward's gate|up GEMM on the same rows, and the output and
every gradient have the bits of the save mode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mok_jax
from mok_jax import ops
from cases import BF16, CUDA_SHAPES, bits, cuda_routing, loss_and_grads, make_case

pytestmark = pytest.mark.gpu

# Tails of every tile, a shared expert (513, ..., Is = 64) and a larger one with many experts.
SHAPES = (CUDA_SHAPES[1], CUDA_SHAPES[3], CUDA_SHAPES[4])
MODES = (False, True)  # Config.recompute


def assert_same_bits(save, recompute, what=""):
  (y_save, g_save), (y_rec, g_rec) = save, recompute
  assert g_save.keys() == g_rec.keys()
  for name, a, b in [("y", y_save, y_rec), *((f"d{n}", g_save[n], g_rec[n]) for n in g_save)]:
    assert bits(a) == bits(b), f"{what} {name}: {np.sum(a != b)} of {a.size} elements differ"


def both_modes(case, block_m):
  return [loss_and_grads(case, "cuda", mok_jax.Config(block_m=block_m, recompute=r))
          for r in MODES]


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
@pytest.mark.parametrize("T,H,I,E,k,Is", SHAPES)
def test_same_bits(T, H, I, E, k, Is, block_m):
  case = make_case(T, H, I, E, k, Is=Is, dtype=BF16, seed=T + 2)
  assert_same_bits(*both_modes(case, block_m), f"{(T, H, I, E, k, Is)} block_m={block_m}")


@pytest.mark.parametrize("name", ["empty_experts", "out_of_range"])
def test_same_bits_adversarial_routing(name):
  T, E, k = 700, 8, 3
  case = make_case(T, 128, 192, E, k, Is=64, dtype=BF16, seed=4,
                   experts=cuda_routing(name, T, E, k, seed=5))
  assert_same_bits(*both_modes(case, 128), name)


@pytest.mark.parametrize("T,H,I,E,k,Is", SHAPES[1:])
def test_forward_keeps_no_gu(T, H, I, E, k, Is):
  """With recompute the residuals gu, gu_shared and xs have zero rows; y and the other
  residuals are those of the save mode."""
  case = make_case(T, H, I, E, k, Is=Is, dtype=BF16, seed=6)
  args = (case.x, jnp.asarray(case.experts, jnp.int32), case.weights, case.w_gate, case.w_up,
          case.w_down, case.shared)
  (y_save, res_save), (y_rec, res_rec) = (
      jax.jit(lambda *a, r=r: ops.moe_fwd(*a, out_dtype=BF16, block_m=128, recompute=r))(*args)
      for r in MODES)
  assert res_save.gu.shape == (ops.routed_rows(T * k, E, 128), 2 * I)
  assert res_rec.gu.shape == (0, 2 * I) and res_rec.gu_shared.shape == (0, 2 * Is)
  assert res_save.xs.shape == (ops.routed_rows(T * k, E, 128), H)
  assert res_rec.xs.shape == (0, H)
  assert bits(y_save) == bits(y_rec)
  for name in ("pos", "offsets", "rows"):
    assert bits(getattr(res_save, name)) == bits(getattr(res_rec, name)), name


def test_same_bits_f32_partial_output_under_shard_map():
  """Expert parallelism over a 1-GPU axis: f32 partial y, f32 dy into the recomputing backward."""
  case = make_case(512, 128, 128, 8, 2, dtype=BF16, seed=7)
  mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
  experts = jnp.asarray(case.experts)

  def loss(config, x, w, wg, wu, wd):
    f = jax.shard_map(
        functools.partial(mok_jax.moe, axis_name="ep", config=config, backend="cuda"), mesh=mesh,
        in_specs=(P("ep"), P("ep"), P("ep"), P("ep"), P("ep"), P("ep")), out_specs=P("ep"))
    y = f(x, experts, w, wg, wu, wd)
    return jnp.sum(y.astype(jnp.float32) * case.dy)

  args = (case.x, case.weights, case.w_gate, case.w_up, case.w_down)
  save, rec = (
      jax.jit(jax.grad(functools.partial(loss, mok_jax.Config(recompute=r)), argnums=range(5)))(
          *args) for r in MODES)
  for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), save, rec):
    assert bits(a) == bits(b), name
