"""The routed expert-parallel layer on one GPU (mok_jax.expert_parallel, P = 1 under
shard_map) with the collective transport (the NVLink transport's tests are in
test_ep_nvlink_cuda.py): the same bits as the fused call for y and every gradient, and
mok_moe_combine's CUDA kernel against the CPU-free definition of the combine (f32 FMAs in j
order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from cases import (BF16, assert_ep_bits, assert_same_bits, distinct_experts, loss_and_grads,
                   make_case, mesh_of, sharded_loss_and_grads)
from mok_jax import ops

pytestmark = pytest.mark.gpu

T, H, I, E, K, IS = 300, 320, 192, 16, 4, 128  # tails of the 128-row and 256-column tiles


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_one_rank_through_the_routed_path_has_the_fused_bits(block_m, recompute):
  rng = np.random.default_rng(block_m)
  experts = distinct_experts(rng, T, K, E)
  experts[3, 1], experts[T - 1, 0] = -1, E
  case = make_case(T=T, H=H, I=I, E=E, Is=IS, dtype=BF16, experts=experts, seed=block_m)
  config = mok_jax.Config(block_m=block_m, recompute=recompute, ep_transport="collective")
  want_y, want_grads = loss_and_grads(case, "cuda", config)
  y, grads = sharded_loss_and_grads(case, "cuda", mesh_of(1), P("ep"), P("ep"), "ep", config)
  assert_ep_bits(y, grads, want_y, want_grads, f"P=1 block_m={block_m}", BF16, "cuda")


def test_combine_kernel_sums_in_j_order():
  rng = np.random.default_rng(0)
  N, Tc, k, Hc = 50, 33, 3, 64
  rows = jnp.asarray(rng.standard_normal((N, Hc)), jnp.bfloat16)
  pos = rng.integers(-1, N, (Tc, k)).astype(np.int32)
  weights = rng.uniform(0.1, 1.0, (Tc, k)).astype(np.float32)
  extra = jnp.asarray(rng.standard_normal((Tc, Hc)), jnp.bfloat16)
  got = jax.jit(ops.moe_combine)(rows, jnp.asarray(pos), jnp.asarray(weights), extra)
  r, e = np.asarray(rows, np.float64), np.asarray(extra, np.float64)
  acc = np.zeros((Tc, Hc), np.float32)
  for j in range(k):
    term = np.where((pos[:, j] >= 0)[:, None], weights[:, j, None] * r[np.maximum(pos[:, j], 0)],
                    0.0)
    acc = (acc.astype(np.float64) + term).astype(np.float32)  # fmaf: one rounding a step
  want = (acc + e.astype(np.float32)).astype(jnp.bfloat16)
  assert_same_bits(np.asarray(got), want, "mok_moe_combine")
