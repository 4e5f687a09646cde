"""Config.recompute on the C++ CPU targets (backend="ffi"): the forward keeps no gu / gu_shared
residuals, the backward recomputes them from x, and the forward and every gradient have the same
bits as in the save mode, on one device and under expert parallelism."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
import oracle
from cases import (BF16, F32, F32_RTOL, assert_grads_close, bits, cuda_routing,
                   loss_and_grads, make_case, oracle_grads_dict, sharded_loss_and_grads)
from mok_jax import ops

MODES = (False, True)  # Config.recompute

# id -> make_case arguments: T not a multiple of any tile, T = 1 with k = E, top-1.
CASES = {
    "routed": dict(T=37, H=16, I=8, E=5, k=2),
    "shared": dict(T=37, H=16, I=8, E=5, k=2, Is=12),
    "T1_k_eq_E": dict(T=1, H=16, I=8, E=3, k=3, Is=8),
    "top1": dict(T=50, H=32, I=16, E=6, k=1, Is=8),
}


def assert_same_bits(save, recompute, what=""):
  (y_save, g_save), (y_rec, g_rec) = save, recompute
  assert g_save.keys() == g_rec.keys()
  for name, a, b in [("y", y_save, y_rec), *((f"d{n}", g_save[n], g_rec[n]) for n in g_save)]:
    assert bits(a) == bits(b), f"{what} {name}: {np.sum(a != b)} of {a.size} elements differ"


def both_modes(case, block_m, backend="ffi"):
  return [loss_and_grads(case, backend, mok_jax.Config(block_m=block_m, recompute=r))
          for r in MODES]


@pytest.mark.parametrize("block_m", [1, 4, 128])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_same_bits(name, dtype, block_m):
  case = make_case(**CASES[name], dtype=dtype, seed=7)
  assert_same_bits(*both_modes(case, block_m), f"{name} {dtype} block_m={block_m}")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("routing", ["one_expert", "empty_experts", "out_of_range",
                                     "all_invalid", "duplicates"])
def test_same_bits_adversarial_routing(routing, dtype):
  ids = cuda_routing(routing, T=70, E=8, k=3, seed=3)
  case = make_case(T=70, H=16, I=8, E=8, Is=8, dtype=dtype, seed=8, experts=ids)
  assert_same_bits(*both_modes(case, 4), routing)


def test_recompute_matches_oracle():
  """Equal bits would also hold for two equally wrong modes: one check against the oracle."""
  case = make_case(**CASES["shared"], seed=9)
  _, grads = loss_and_grads(case, "ffi", mok_jax.Config(block_m=4, recompute=True))
  want = oracle_grads_dict(oracle.moe_grads(case.dy, *case.args(), case.shared))
  assert_grads_close(grads, want, F32_RTOL, "recompute")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("ep", [2, 4])
def test_same_bits_expert_parallel(ep, dtype):
  """Under shard_map each rank's call returns an f32 partial y and gets an f32 dy."""
  ids = cuda_routing("out_of_range", T=32, E=8, k=3, seed=4)
  case = make_case(T=32, H=16, I=8, E=8, Is=8, dtype=dtype, seed=10, experts=ids)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ep]), ("ep",))
  save, recompute = (sharded_loss_and_grads(case, "ffi", mesh, P("ep"), P("ep"), "ep",
                                            mok_jax.Config(block_m=4, recompute=r))
                     for r in MODES)
  assert_same_bits(save, recompute, f"EP={ep}")


def ffi_calls(jaxpr):
  """The ffi_call equations of a jaxpr and of the jaxprs nested in it (jit, custom_vjp)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ffi_call":
      yield eqn
    for param in eqn.params.values():
      for p in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(p, jax.extend.core.ClosedJaxpr):
          yield from ffi_calls(p.jaxpr)
        elif isinstance(p, jax.extend.core.Jaxpr):
          yield from ffi_calls(p)


@pytest.mark.parametrize("recompute", MODES, ids=["save", "recompute"])
def test_residuals_of_the_mode(recompute):
  """mok_jax.moe passes Config.recompute to both targets; with it, the gu and gu_shared that
  the forward hands to the backward have zero rows."""
  dims = dict(T=37, H=16, I=8, E=5, k=2, Is=12)
  case = make_case(**dims)
  config = mok_jax.Config(block_m=4, recompute=recompute)

  def loss(x, weights, w_gate, w_up, w_down, shared):
    y = mok_jax.moe(x, case.experts, weights, w_gate, w_up, w_down, shared=shared,
                    config=config, backend="ffi")
    return jnp.sum(y * case.dy)

  grad = jax.grad(loss, argnums=tuple(range(6)))
  jaxpr = jax.make_jaxpr(grad)(case.x, case.weights, case.w_gate, case.w_up, case.w_down,
                               case.shared).jaxpr
  calls = {eqn.params["target_name"]: eqn for eqn in ffi_calls(jaxpr)}
  assert calls.keys() == {"mok_moe_fwd", "mok_moe_bwd"}
  R = ops.routed_rows(37 * 2, 5, 4)
  rows = (0, 0) if recompute else (R, 37)
  for eqn in calls.values():
    assert dict(eqn.params["attributes"])["recompute"] == recompute
  gu, gu_shared = calls["mok_moe_bwd"].invars[13], calls["mok_moe_bwd"].invars[14]
  assert gu.aval.shape == (rows[0], 16) and gu_shared.aval.shape == (rows[1], 24)
  _, res = ops.moe_fwd(case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up,
                       case.w_down, case.shared, out_dtype=F32, block_m=4, recompute=recompute)
  assert res.gu.shape == (rows[0], 16) and res.gu_shared.shape == (rows[1], 24)


def primal_and_vjp_y(case, config, dtype):
  """y of the layer called alone under jit (the custom VJP's primal) and y of jax.vjp (its fwd
  rule, which keeps the residuals of config.recompute)."""

  def layer(x, weights, w_gate, w_up, w_down, shared):
    return mok_jax.moe(x, case.experts, weights, w_gate, w_up, w_down, shared=shared,
                       config=config, backend="ffi")

  y_primal = jax.jit(layer)(*case.params())
  y_vjp, _ = jax.jit(lambda *p: jax.vjp(layer, *p))(*case.params())
  assert y_primal.dtype == y_vjp.dtype == dtype
  return y_primal, y_vjp, layer


@pytest.mark.parametrize("recompute", MODES, ids=["save", "recompute"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_inference_y_is_the_vjp_y(name, dtype, recompute):
  """Not differentiated, the layer's forward keeps no gu whatever Config.recompute says; y has
  the bits of the y that jax.vjp returns (the forward that keeps the residuals of the mode)."""
  case = make_case(**CASES[name], dtype=dtype, seed=11)
  config = mok_jax.Config(block_m=4, recompute=recompute)
  y_primal, y_vjp, layer = primal_and_vjp_y(case, config, dtype)
  assert bits(y_primal) == bits(y_vjp), f"{np.sum(y_primal != y_vjp)} elements differ"
  # The primal's one call is a recompute-mode forward: its gu and gu_shared have zero rows.
  (eqn,) = ffi_calls(jax.make_jaxpr(layer)(*case.params()).jaxpr)
  assert eqn.params["target_name"] == "mok_moe_fwd"
  assert bool(dict(eqn.params["attributes"])["recompute"])
  n = len(ops.Residuals._fields)
  res = ops.Residuals(*eqn.params["result_avals"][1:1 + n])
  assert res.gu.shape[0] == 0 and res.gu_shared.shape[0] == 0


def test_backward_of_the_other_mode():
  """Residuals of a forward that saved gu, given to a backward that recomputes: a ValueError
  that names the residual and the mode, at trace time."""
  case = make_case(**CASES["shared"])
  args = (case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down)
  _, res = ops.moe_fwd(*args, case.shared, out_dtype=F32, block_m=4)
  with pytest.raises(ValueError, match=r"residual gu must be \(0, 16\) float32, got "
                                       r"\(\d+, 16\) float32 \(block_m=4, recompute=True"):
    ops.moe_bwd(case.dy, *args, case.shared, res, block_m=4, recompute=True)


def test_xla_backend_ignores_the_mode():
  case = make_case(**CASES["shared"])
  assert_same_bits(*both_modes(case, 4, backend="xla"), "xla")


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_config_recompute_must_be_bool(value):
  with pytest.raises(ValueError, match=r"Config.recompute must be a bool"):
    mok_jax.Config(recompute=value)
