"""The forward of mok_jax.moe (target mok_moe_fwd) against the float64 oracle (tests/oracle.py).

Also the layout residuals of mok_moe_fwd, which the CUDA kernel must produce alike: per-expert
row offsets padded to block_m, positions in ascending (t, j) order within each expert.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
import oracle
from cases import BF16, CPU_BACKENDS, F32, RTOL, assert_close, bits, distinct_experts, make_case
from mok_jax import ops


def forward(case, backend, config=None):
  """y = moe(...) under jit, experts closed over as a constant (only the forward is traced)."""

  def f(x, weights, w_gate, w_up, w_down, shared):
    return mok_jax.moe(x, case.experts, weights, w_gate, w_up, w_down, shared=shared,
                       config=config, backend=backend)

  return jax.jit(f)(case.x, case.weights, case.w_gate, case.w_up, case.w_down, case.shared)


@pytest.mark.parametrize("Is", [None, 8], ids=["routed", "shared"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_matches_oracle(backend, dtype, Is):
  case = make_case(T=24, H=16, I=8, E=4, k=2, Is=Is, dtype=dtype)
  y = forward(case, backend)
  assert y.shape == case.x.shape and y.dtype == dtype
  want = oracle.moe(*case.args(), case.shared, round_to=dtype)
  assert_close(y, want, RTOL[dtype], f"{backend} y")


@pytest.mark.parametrize("block_m", [1, 4, 128])
def test_ffi_forward_block_m(block_m):
  # T * k = 39 routes over 5 experts: no expert's count is a multiple of 4, and all sit in
  # one 128-row tile each.
  case = make_case(T=13, H=12, I=6, E=5, k=3, Is=4, seed=block_m)
  y = forward(case, "ffi", mok_jax.Config(block_m=block_m))
  assert_close(y, oracle.moe(*case.args(), case.shared), RTOL[F32], f"block_m={block_m} y")


def test_auto_backend_is_xla_on_cpu():
  case = make_case(Is=8, seed=3)
  assert bits(forward(case, "auto")) == bits(forward(case, "xla"))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_ffi_partial_output_in_f32(dtype):
  """out_dtype=f32 (expert parallelism's partial sums) skips only the final rounding."""
  case = make_case(T=10, E=3, k=2, Is=4, dtype=dtype, seed=5)
  y, _ = jax.jit(lambda *a: ops.moe_fwd(*a, case.shared, out_dtype=jnp.float32, block_m=4))(
      case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down)
  assert y.dtype == jnp.float32
  want = oracle.moe(*case.args(), case.shared, round_to=dtype, round_y=False)
  assert_close(y, want, RTOL[dtype], "f32 partial y")
  y_rounded = forward(case, "ffi", mok_jax.Config(block_m=4))
  np.testing.assert_array_equal(np.asarray(y.astype(dtype)), np.asarray(y_rounded))


def expected_layout(experts, E, block_m):
  """pos, offsets, rows as mok_moe_fwd must lay them out, by counting in NumPy."""
  T, k = experts.shape
  counts = [int(np.sum(experts == e)) for e in range(E)]
  padded = [-(-c // block_m) * block_m for c in counts]
  offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
  pos = np.full((T, k), -1, np.int32)
  rows = np.full(ops.routed_rows(T * k, E, block_m), -1, np.int32)
  next_row = offsets[:-1].copy()
  for t in range(T):
    for j in range(k):
      e = experts[t, j]
      if 0 <= e < E:
        pos[t, j] = next_row[e]
        rows[next_row[e]] = t * k + j
        next_row[e] += 1
  return pos, offsets, rows


@pytest.mark.parametrize("block_m", [1, 4, 128])
def test_ffi_layout_residuals(block_m):
  T, H, I, E, k = 11, 8, 4, 5, 3
  rng = np.random.default_rng(block_m)
  experts = distinct_experts(rng, T, k, E)
  experts[:, 0] = 2  # a hot expert
  experts[experts == 4] = 0  # an empty expert
  experts[3, 1], experts[7, 2] = -1, E  # invalid routes: no row
  case = make_case(T=T, H=H, I=I, E=E, Is=2, experts=experts, seed=block_m)
  y, res = jax.jit(lambda *a: ops.moe_fwd(*a, case.shared, out_dtype=jnp.float32,
                                          block_m=block_m))(
      case.x, jnp.asarray(experts), case.weights, case.w_gate, case.w_up, case.w_down)
  pos, offsets, rows = expected_layout(experts, E, block_m)
  np.testing.assert_array_equal(np.asarray(res.pos), pos)
  np.testing.assert_array_equal(np.asarray(res.offsets), offsets)
  np.testing.assert_array_equal(np.asarray(res.rows), rows)
  assert np.all(offsets % block_m == 0)

  # gu: each route's pre-activations at its row.
  x = np.asarray(case.x, np.float64)
  t, j = np.nonzero(pos >= 0)
  e, p = experts[t, j], pos[t, j]
  w_gate, w_up = (np.asarray(w, np.float64) for w in case.args()[3:5])
  g = np.einsum("rh,rhi->ri", x[t], w_gate[e])
  u = np.einsum("rh,rhi->ri", x[t], w_up[e])
  assert_close(np.asarray(res.gu)[p], np.concatenate([g, u], axis=1), RTOL[F32], "gu")
  padding = np.asarray(res.rows) < 0
  # xs: each route's token row at its row, zeros for the padding (the backward's weight
  # gradients read it as the gather left it).
  np.testing.assert_array_equal(np.asarray(res.xs)[p], np.asarray(case.x)[t])
  assert not np.any(np.asarray(res.xs)[padding]), "padding rows of xs must hold zeros"
  ws_gate, ws_up, _ = (np.asarray(w, np.float64) for w in case.shared)
  assert_close(res.gu_shared, np.concatenate([x @ ws_gate, x @ ws_up], axis=1), RTOL[F32],
               "gu_shared")
  assert_close(y, oracle.moe(*case.args(), case.shared), RTOL[F32], "y")
