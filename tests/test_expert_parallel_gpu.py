"""Expert parallelism over real GPUs (marked multigpu: needs 2 or more) with the collective
transport (the NVLink transport's are in test_ep_nvlink_cuda.py): mok_jax.moe with the CUDA
backend inside jax.shard_map over every GPU (a power of two, up to 8), its tokens and experts
sharded over one mesh axis, against the same layer on one GPU (its bits) and the XLA backend
(to rounding);
bitwise repeatable; data parallelism with replicated experts. The CPU tests
(test_expert_parallel.py) check the same on CPU devices against the float64 oracle."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from cases import (BF16, BF16_GRAD_RTOL, BF16_RTOL, assert_close, assert_ep_bits,
                   assert_grads_close, bits, distinct_experts, loss_and_grads, make_case, mesh_of,
                   sharded_loss_and_grads)

pytestmark = pytest.mark.multigpu

# T and E divide by every EP size up to 8; H and I multiples of 64 with tails of the 128-row
# and 256-column tiles (I = 192, H = 320); a shared expert.
T, H, I, E, K, IS = 1024, 320, 192, 16, 4, 128


def ranks() -> int:
  n = len(jax.devices())
  return min(8, 1 << (n.bit_length() - 1))


@functools.cache
def case_of(seed):
  rng = np.random.default_rng(seed)
  experts = distinct_experts(rng, T, K, E)
  # Out-of-range ids on the first, a middle and the last rank's tokens.
  experts[1, 2], experts[T // 2, 0], experts[T - 1, 3] = -1, E, 2**31 - 1
  return make_case(T=T, H=H, I=I, E=E, Is=IS, dtype=BF16, experts=experts, seed=seed)


@functools.cache
def one_gpu(backend, seed):
  return loss_and_grads(case_of(seed), backend)


@pytest.mark.parametrize("ep_capacity", [None, T // 2 * K], ids=["dropless", "bounded"])
def test_ep_over_every_gpu_has_one_gpus_bits(ep_capacity):
  """The same bits as the fused call on one GPU for y and every gradient (the shared expert's
  weight gradients, summed over ranks, to rounding), and the XLA backend's to rounding."""
  n = ranks()
  case = case_of(0)
  config = mok_jax.Config(ep_capacity=ep_capacity, ep_transport="collective")
  y, grads = sharded_loss_and_grads(case, "cuda", mesh_of(n), P("ep"), P("ep"), "ep", config)
  want_y, want_grads = one_gpu("cuda", 0)
  assert_ep_bits(y, grads, want_y, want_grads, f"EP={n}", BF16, "cuda")
  want_y, want_grads = one_gpu("xla", 0)
  assert_close(y, want_y, BF16_RTOL, f"EP={n} y vs one GPU (xla)")
  assert_grads_close(grads, want_grads, BF16_GRAD_RTOL, f"EP={n} vs one GPU (xla)")
  assert np.all(grads["weights"][[1, T // 2, T - 1], [2, 0, 3]] == 0)


def test_ep_same_bits_every_run():
  n = ranks()
  config = mok_jax.Config(ep_transport="collective")
  runs = [sharded_loss_and_grads(case_of(1), "cuda", mesh_of(n), P("ep"), P("ep"), "ep", config)
          for _ in range(2)]
  (y0, g0), (y1, g1) = runs
  assert bits(y0) == bits(y1), "y"
  for name in g0:
    assert bits(g0[name]) == bits(g1[name]), f"d{name}"


def test_replicated_experts_over_every_gpu():
  """Data parallelism without axis_name: every GPU holds all experts, gradients are summed."""
  n = ranks()
  case = case_of(2)
  y, grads = sharded_loss_and_grads(case, "cuda", mesh_of(n, names=("dp",)), P("dp"), P(), None)
  want_y, want_grads = one_gpu("cuda", 2)
  assert_close(y, want_y, BF16_RTOL, f"DP={n} y")
  assert_grads_close(grads, want_grads, BF16_GRAD_RTOL, f"DP={n}")
