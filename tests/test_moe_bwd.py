"""Gradients of mok_jax.moe (the custom VJP over mok_moe_fwd / mok_moe_bwd, and JAX autodiff of
the XLA backend) against the oracle's hand-written float64 backward (tests/oracle.py), and
against finite differences with jax.test_util.check_grads."""

import functools

import jax
import numpy as np
import pytest
from jax.test_util import check_grads

import mok_jax
import oracle
from cases import (BF16, CPU_BACKENDS, F32, GRAD_RTOL, RTOL, assert_close, assert_grads_close,
                   check_bwd_takes_residual_buffers, loss_and_grads, make_case,
                   oracle_grads_dict)

# check_grads compares with central differences in f32 along a random direction; with this step
# the truncation and rounding errors stay near 1.3e-3 of the projection (seen over seeds).
CHECK_GRADS_TOL = 5e-3
CHECK_GRADS_EPS = 1e-2


def check_against_oracle(case, backend, config=None, dtype=F32):
  y, grads = loss_and_grads(case, backend, config)
  assert_close(y, oracle.moe(*case.args(), case.shared, round_to=dtype), RTOL[dtype],
               f"{backend} y")
  want = oracle_grads_dict(oracle.moe_grads(case.dy, *case.args(), case.shared,
                                            round_to=dtype))
  assert_grads_close(grads, want, GRAD_RTOL[dtype], backend)
  return grads


@pytest.mark.parametrize("Is", [None, 8], ids=["routed", "shared"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grads_match_oracle(backend, dtype, Is):
  case = make_case(T=24, H=16, I=8, E=4, k=2, Is=Is, dtype=dtype, seed=1)
  grads = check_against_oracle(case, backend, dtype=dtype)
  assert grads["weights"].dtype == np.float32
  for name in grads.keys() - {"weights"}:
    assert grads[name].dtype == dtype, name


@pytest.mark.parametrize("block_m", [1, 4, 128])
def test_ffi_grads_block_m(block_m):
  case = make_case(T=13, H=12, I=6, E=5, k=3, Is=4, seed=10 + block_m)
  check_against_oracle(case, "ffi", mok_jax.Config(block_m=block_m))


@pytest.mark.parametrize("Is", [None, 3], ids=["routed", "shared"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_check_grads(backend, Is):
  case = make_case(T=5, H=4, I=3, E=3, k=2, Is=Is, seed=2)

  def f(x, weights, w_gate, w_up, w_down, shared):
    return mok_jax.moe(x, case.experts, weights, w_gate, w_up, w_down, shared=shared,
                       config=mok_jax.Config(block_m=2), backend=backend)

  args = (case.x, case.weights, case.w_gate, case.w_up, case.w_down, case.shared)
  # Every backend differentiates by a custom VJP (the XLA backend's NaN-local grouped matmul
  # too): reverse mode only.
  check_grads(jax.jit(f), args, order=1, modes=("rev",), atol=CHECK_GRADS_TOL,
              rtol=CHECK_GRADS_TOL, eps=CHECK_GRADS_EPS)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_route_weights(backend):
  """A route of weight 0 (dropped or masked) adds nothing to y, and its weight's gradient is
  still <dy, its expert's output>: the backward sums <dy @ w_down^T, h> before it scales by the
  weight, and never divides by it."""
  case = make_case(T=24, H=16, I=8, E=4, k=2, seed=5)
  weights = np.asarray(case.weights).copy()
  weights[::3, 0] = 0.0
  grads = check_against_oracle(case._replace(weights=jax.numpy.asarray(weights)), backend)
  assert np.all(np.asarray(grads["weights"])[::3, 0] != 0)


def test_bwd_takes_the_residual_buffers():
  check_bwd_takes_residual_buffers("ffi")


def test_ffi_has_no_forward_mode():
  """The FFI backend is a custom_vjp: forward mode fails loudly rather than silently."""
  case = make_case(T=3, H=4, I=2, E=2, k=1)
  f = functools.partial(mok_jax.moe, backend="ffi")
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: f(x, case.experts, *case.args()[2:]), (case.x,), (case.x,))
