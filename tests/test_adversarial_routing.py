"""Adversarial routing on every CPU backend, forward and gradients against
the oracle: hot and empty experts, top_k = 1 and = E, duplicated ids in a row, ids out of
range (which contribute nothing and are never used as an address), T = 1, T = 0 and T not a
multiple of any tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
import oracle
from cases import (F32_RTOL, GRAD_NAMES, assert_close, assert_grads_close, distinct_experts,
                   loss_and_grads, make_case, oracle_grads_dict)

E = 6
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
OUT_OF_RANGE = (-1, E, E + 1, INT32_MAX, INT32_MIN)
# int64 ids that wrap onto a valid expert if cast to int32 before the range check.
WRAPPING_INT64 = (2**32 + 3, 2**32, -(2**32) + 1, 2**63 - 1, -(2**63))

# (backend, Config): the FFI target with the CUDA kernel's block_m and with a small one, so that
# experts span several tiles and padding rows appear between them.
BACKENDS = {"xla": ("xla", None), "ffi": ("ffi", None),
            "ffi-block_m4": ("ffi", mok_jax.Config(block_m=4))}


def routing(name, rng):
  """(T, experts) of the named adversarial routing, over E experts."""
  if name == "all_to_one":
    return np.full((13, 1), 4)
  if name == "hot_expert":  # every token's first choice is expert 0
    ids = distinct_experts(rng, 13, 3, E - 1) + 1
    ids[:, 0] = 0
    return ids
  if name == "empty_experts":  # experts 0, 2, 3, 5 receive nothing
    return np.where(rng.random((13, 2)) < 0.5, 1, 4)
  if name == "top_k_1":
    return distinct_experts(rng, 13, 1, E)
  if name == "top_k_E":
    return distinct_experts(rng, 13, E, E)
  if name == "duplicate_ids":
    ids = distinct_experts(rng, 13, 3, E)
    ids[:, 1] = ids[:, 0]
    ids[5] = 2
    return ids
  if name == "out_of_range":
    ids = distinct_experts(rng, 13, 3, E)
    ids.flat[::2] = np.resize(OUT_OF_RANGE, ids.flat[::2].shape)
    return ids
  if name == "all_out_of_range":
    return np.resize(OUT_OF_RANGE, (13, 2))
  if name == "T_1":
    return np.array([[5, 1]])
  if name == "T_0":  # no tokens at all: empty outputs, zero weight gradients
    return np.zeros((0, 2), int)
  if name == "tile_crossing":  # 131 routes to one expert: more than one 128-row tile
    return np.concatenate([np.zeros((131, 1), int), np.full((131, 1), 3)], axis=1)
  raise ValueError(name)


ROUTINGS = ("all_to_one", "hot_expert", "empty_experts", "top_k_1", "top_k_E", "duplicate_ids",
            "out_of_range", "all_out_of_range", "T_1", "T_0", "tile_crossing")


@pytest.mark.parametrize("routing_name", ROUTINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_routing_matches_oracle(backend, routing_name):
  rng = np.random.default_rng(sum(map(ord, routing_name)))
  experts = routing(routing_name, rng).astype(np.int32)
  shared = 4 if routing_name in ("all_out_of_range", "T_1", "T_0", "hot_expert") else None
  case = make_case(T=experts.shape[0], H=8, I=4, E=E, Is=shared, experts=experts,
                   seed=len(routing_name))
  name, config = BACKENDS[backend]
  y, grads = loss_and_grads(case, name, config)
  assert_close(y, oracle.moe(*case.args(), case.shared), F32_RTOL, "y")
  want = oracle_grads_dict(oracle.moe_grads(case.dy, *case.args(), case.shared))
  assert_grads_close(grads, want, F32_RTOL, routing_name)
  invalid = (experts < 0) | (experts >= E)
  assert np.all(grads["weights"][invalid] == 0), "an invalid route has a weight gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_routes_ignore_their_weights(backend):
  """An out-of-range route contributes nothing, whatever its weight: not even NaN * 0."""
  rng = np.random.default_rng(7)
  experts = routing("out_of_range", rng).astype(np.int32)
  invalid = (experts < 0) | (experts >= E)
  case = make_case(T=experts.shape[0], H=8, I=4, E=E, experts=experts, seed=7)
  poisoned = case._replace(weights=jnp.where(invalid, jnp.nan, case.weights))
  name, config = BACKENDS[backend]
  y, grads = loss_and_grads(poisoned, name, config)
  y_clean, grads_clean = loss_and_grads(case, name, config)
  np.testing.assert_array_equal(y, y_clean)
  for g in GRAD_NAMES[:5]:
    np.testing.assert_array_equal(grads[g], grads_clean[g], err_msg=g)


def wrapping_int64_case():
  rng = np.random.default_rng(11)
  experts = distinct_experts(rng, 10, 2, E).astype(np.int64)
  experts[:, 1] = np.resize(WRAPPING_INT64, 10)
  return make_case(T=10, H=8, I=4, E=E, experts=experts, seed=11), experts.astype(np.int32)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_int64_ids_do_not_wrap(backend):
  """With x64 on, int64 ids reach mok_jax.moe as int64 and are range-checked before any cast."""
  case, wrapped = wrapping_int64_case()
  assert np.any((wrapped[:, 1] >= 0) & (wrapped[:, 1] < E)), "the test needs wrapping ids"
  want_y = oracle.moe(*case.args())
  want_grads = oracle_grads_dict(oracle.moe_grads(case.dy, *case.args()))
  with jax.enable_x64(True):
    y, grads = loss_and_grads(case, backend)
  assert_close(y, want_y, F32_RTOL, "y")
  assert_grads_close(grads, want_grads, F32_RTOL, "int64 ids")


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_host_int64_ids_do_not_wrap_with_x64_off(backend):
  """A NumPy int64 array (NumPy's default integer) of ids, with JAX's default x64 off."""
  case, _ = wrapping_int64_case()
  y = mok_jax.moe(*case.args(), backend=backend)
  assert_close(y, oracle.moe(*case.args()), F32_RTOL, "y")


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_int64_ids_under_expert_parallelism(backend):
  """Ranks other than 0 subtract their first expert id: still no wrapping onto a local one."""
  case, _ = wrapping_int64_case()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))

  def f(x, experts, weights, w_gate, w_up, w_down):
    return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, axis_name="ep",
                       backend=backend)

  with jax.enable_x64(True):
    experts = jnp.asarray(case.experts)
    assert experts.dtype == jnp.int64
    y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        case.x, experts, *case.args()[2:])
  assert_close(y, oracle.moe(*case.args()), F32_RTOL, "y")
