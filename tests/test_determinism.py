"""Bitwise determinism: two runs of the forward and the backward give the same bits, in one
compiled program and across two compilations, on every CPU backend (docs/design.md, section
5: no float atomics, fixed summation orders)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from cases import BF16, CPU_BACKENDS, F32, bits, distinct_experts, make_case


def contended_case(dtype):
  """Many routes per expert, duplicates in rows and invalid ids: where the order of a sum
  would show if it changed from run to run."""
  rng = np.random.default_rng(0)
  experts = distinct_experts(rng, 64, 4, 4)
  experts[::3, 1] = experts[::3, 0]
  experts[::7, 2] = -1
  return make_case(T=64, H=32, I=16, E=4, Is=8, dtype=dtype, experts=experts)


def fwd_bwd(case, backend, config=None):
  """A freshly traced and compiled forward + backward."""

  def loss(x, weights, w_gate, w_up, w_down, shared):
    y = mok_jax.moe(x, case.experts, weights, w_gate, w_up, w_down, shared=shared,
                    config=config, backend=backend)
    return jnp.sum(y.astype(jnp.float32) * case.dy), y

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def run(f, case):
  out = f(case.x, case.weights, case.w_gate, case.w_up, case.w_down, case.shared)
  return [bits(a) for a in jax.tree.leaves(out)]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_two_runs_same_bits(backend, dtype):
  case = contended_case(dtype)
  config = mok_jax.Config(block_m=8)
  f = fwd_bwd(case, backend, config)
  first = run(f, case)
  assert len(first) == 1 + 1 + 8  # loss, y, 8 gradients
  assert run(f, case) == first, "a second run of the same program differs"
  assert run(fwd_bwd(case, backend, config), case) == first, "a second compilation differs"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_two_runs_same_bits_expert_parallel(backend):
  case = contended_case(F32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("ep",))

  def layer(x, experts, weights, w_gate, w_up, w_down, shared):
    return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared,
                       axis_name="ep", backend=backend)

  sharded = jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 6 + (P(),), out_specs=P("ep"))
  experts = jnp.asarray(case.experts)

  def loss(x, weights, w_gate, w_up, w_down, shared):
    return jnp.sum(sharded(x, experts, weights, w_gate, w_up, w_down, shared) * case.dy)

  f = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))
  first = run(f, case)
  assert run(f, case) == first
