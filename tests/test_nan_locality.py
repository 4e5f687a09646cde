"""A non-finite value stays where the math puts it, on every backend (README, Limits): NaN in one
expert's w_down makes NaN the outputs of the tokens routed to that expert and the gradients the
chain rule sends through it, and leaves every other output and gradient finite, with the bits
of the same call where that expert's w_down is zero."""

import jax.numpy as jnp
import numpy as np
import pytest

from cases import BF16, F32, loss_and_grads, make_case

TARGETS = [("xla", F32), ("xla", BF16), ("ffi", F32), ("ffi", BF16),
           pytest.param("cuda", BF16, marks=pytest.mark.gpu)]
BAD = 1  # the expert whose w_down holds a NaN


def case_for(backend, dtype, w_down_of_bad):
  # The CUDA kernel needs H, I, Is multiples of 64; the CPU targets run the small case.
  T, H, I, E, k, Is = (300, 128, 128, 8, 2, 64) if backend == "cuda" else (24, 16, 8, 4, 2, 8)
  c = make_case(T, H, I, E, k, Is=Is, dtype=dtype, seed=3)
  return c._replace(w_down=c.w_down.at[BAD].set(w_down_of_bad))


@pytest.mark.parametrize("backend,dtype", TARGETS, ids=str)
def test_nan_in_one_expert_stays_there(backend, dtype):
  poisoned = case_for(backend, dtype, jnp.nan)
  zeroed = case_for(backend, dtype, 0.0)
  y, g = loss_and_grads(poisoned, backend)
  y0, g0 = loss_and_grads(zeroed, backend)
  experts = np.asarray(poisoned.experts)
  hit = np.any(experts == BAD, axis=1)  # the tokens routed to the expert
  assert hit.any() and not hit.all()
  f32 = lambda a: np.asarray(a, np.float32)

  def same_outside(name, got, want, region):
    """NaN inside `region` (all of it), the zeroed call's bits outside it."""
    got, want = f32(got), f32(want)
    assert np.isnan(got[region]).all(), f"{name}: finite where the NaN must reach"
    np.testing.assert_array_equal(got[~region], want[~region], err_msg=name)

  same_outside("y", y, y0, np.broadcast_to(hit[:, None], y.shape))
  same_outside("dx", g["x"], g0["x"], np.broadcast_to(hit[:, None], y.shape))
  same_outside("dweights", g["weights"], g0["weights"], experts == BAD)
  # dh of the expert's rows is NaN (dy @ w_down^T): its gate and up gradients are, no one
  # else's; its w_down gradient ((w h)^T dy) does not read w_down.
  expert = np.zeros(poisoned.w_gate.shape, bool)
  expert[BAD] = True
  for name in ("w_gate", "w_up"):
    same_outside(f"d{name}", g[name], g0[name], expert)
  # Nor do the shared expert's gradients read the routed experts.
  for name in ("w_down", "ws_gate", "ws_up", "ws_down"):
    same_outside(f"d{name}", g[name], g0[name], np.zeros(np.shape(g[name]), bool))


@pytest.mark.parametrize("backend,dtype", TARGETS, ids=str)
def test_nan_token_stays_in_its_row(backend, dtype):
  c = case_for(backend, dtype, 0.5)
  c = c._replace(x=c.x.at[3].set(jnp.nan))
  y, _ = loss_and_grads(c, backend)
  y = np.asarray(y, np.float32)
  assert np.isnan(y[3]).all()
  assert np.isfinite(np.delete(y, 3, axis=0)).all()
