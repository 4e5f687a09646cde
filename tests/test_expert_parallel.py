"""Expert parallelism on CPU devices: mok_jax.moe inside jax.shard_map with axis_name, experts
and tokens sharded over the same mesh axis, equals the single-device layer, forward and
gradients (jax.grad of a loss of the shard_mapped function), for EP sizes 1, 2, 4 and 8."""

import functools

import jax
import jax.extend
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
import oracle
from cases import (BF16, BF16_GRAD_RTOL, BF16_RTOL, CPU_BACKENDS, F32, F32_RTOL, assert_close,
                   assert_grads_close, distinct_experts, loss_and_grads, make_case, mesh_of,
                   sharded_grad_fn, sharded_loss_and_grads)

T, H, I, E, K, IS = 24, 16, 8, 8, 3, 8  # T and E divide by every EP size up to 8
OUT_OF_RANGE = (-1, E, 2**31 - 1)


def ep_case(Is, dtype=F32, seed=0):
  rng = np.random.default_rng(seed)
  experts = distinct_experts(rng, T, K, E)
  experts[1, 2], experts[10, 0], experts[T - 1, 1] = OUT_OF_RANGE  # on the first/middle/last rank
  return make_case(T=T, H=H, I=I, E=E, Is=Is, dtype=dtype, experts=experts, seed=seed)


@functools.cache
def single_device(backend, Is, dtype=F32, seed=0):
  return loss_and_grads(ep_case(Is, dtype, seed), backend)


@pytest.mark.parametrize("Is", [None, IS], ids=["routed", "shared"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_ep_matches_single_device(ep, backend, Is):
  case = ep_case(Is)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(ep), P("ep"), P("ep"), "ep")
  want_y, want_grads = single_device(backend, Is)
  assert_close(y, want_y, F32_RTOL, f"EP={ep} y")
  assert_grads_close(grads, want_grads, F32_RTOL, f"EP={ep}")
  assert np.all(grads["weights"][[1, 10, T - 1], [2, 0, 1]] == 0)


def test_single_device_matches_oracle():
  """The single-device results above are right (checked against the oracle, out-of-range ids
  included), so the EP results are too."""
  case = ep_case(IS)
  for backend in CPU_BACKENDS:
    y, _ = single_device(backend, IS)
    assert_close(y, oracle.moe(*case.args(), case.shared), F32_RTOL, f"{backend} y")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ep_bf16(backend):
  """bf16 partial outputs are reduced in f32 and rounded once, at the token's home rank."""
  case = ep_case(IS, BF16, seed=1)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(4), P("ep"), P("ep"), "ep")
  want_y, want_grads = single_device(backend, IS, BF16, seed=1)
  assert y.dtype == want_y.dtype
  assert_close(y, want_y, BF16_RTOL, "y")
  assert_grads_close(grads, want_grads, BF16_GRAD_RTOL, "EP=4 bf16")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ep_on_a_2d_mesh(backend):
  """Tokens over ('dp', 'ep'), experts over 'ep' only: the expert weights' gradients are also
  summed over 'dp', where they are replicated."""
  case = ep_case(IS, seed=2)
  mesh = mesh_of(2, 4, names=("dp", "ep"))
  y, grads = sharded_loss_and_grads(case, backend, mesh, P(("dp", "ep")), P("ep"), "ep")
  want_y, want_grads = loss_and_grads(case, backend)
  assert_close(y, want_y, F32_RTOL, "y")
  assert_grads_close(grads, want_grads, F32_RTOL, "dp=2 x ep=4")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replicated_experts_under_shard_map(backend):
  """Data parallelism without axis_name: every rank holds all experts, gradients are summed."""
  case = ep_case(IS, seed=3)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(4, names=("dp",)), P("dp"), P(),
                                    None)
  want_y, want_grads = loss_and_grads(case, backend)
  assert_close(y, want_y, F32_RTOL, "y")
  assert_grads_close(grads, want_grads, F32_RTOL, "replicated experts")


def shard_map_inputs(jaxpr):
  """The avals of every shard_map's inputs in a jaxpr, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      yield from (v.aval for v in eqn.invars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from shard_map_inputs(sub)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("Is", [None, IS], ids=["routed", "shared"])
def test_backward_shard_map_gets_no_empty_residual(Is, recompute):
  """No empty array (gu_shared without a shared expert, gu with recompute) crosses into the
  backward's shard_map: XLA folds such an input to a constant, and removing the unused input
  then crashed Shardy compiling forward+backward on 2 GPUs (jax 0.11.2, 2026-11-30)."""
  case = ep_case(Is)
  f = sharded_grad_fn(case, "ffi", mesh_of(2), P("ep"), P("ep"), "ep",
                      mok_jax.Config(recompute=recompute))
  avals = list(shard_map_inputs(jax.make_jaxpr(f)(*case.params()).jaxpr))
  assert len(avals) > 12  # the forward's and the backward's shard_map
  empty = [a.str_short() for a in avals if 0 in a.shape]
  assert not empty, empty


def ffi_calls(jaxpr):
  """The ffi_call equations of a closed jaxpr, those of its sub-jaxprs (shard_map, custom VJP,
  jit) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ffi_call":
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found.extend(ffi_calls(sub))
  return found


@pytest.mark.parametrize("ep", [1, 4])
def test_ep_tells_the_targets_its_ranks(ep):
  """Under shard_map each rank's forward and backward call gets `ranks` = the EP size: the
  CUDA kernel's launch choices then expect a rank's share of the routes, not all of them."""
  case = ep_case(None)
  f = sharded_grad_fn(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep")
  calls = ffi_calls(jax.make_jaxpr(f)(*case.params()).jaxpr)
  assert sorted(e.params["target_name"] for e in calls) == ["mok_moe_bwd", "mok_moe_fwd"]
  assert all(int(dict(e.params["attributes"])["ranks"]) == ep for e in calls)
