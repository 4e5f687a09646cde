"""The CUDA forward (mok_moe_fwd on platform CUDA) against the float64 oracle and the XLA backend.

bf16 tolerances are those of tests/cases.py. Layout residuals (pos, offsets, rows) are integer
and must equal, element for element, the layout written out in NumPy below. Every block_m the
kernel takes (ops.CUDA_BLOCK_MS) is tested: with 64, an expert's last 128-row tile may be half
full and the next expert starts right after it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import ops
import oracle
from cases import (BF16, BF16_GRAD_RTOL, BF16_RTOL, COMMAND_BUFFER_FLAGS, CUDA_ROUTINGS,
                   CUDA_SHAPES, NO_COMMAND_BUFFER_FLAGS, REPLAYS, assert_close, bits,
                   cuda_digests_with, cuda_routing, loss_and_grads, make_case, per_block_m,
                   tail_routing)

pytestmark = pytest.mark.gpu

BLOCK_M = 128


def numpy_layout(experts, E, block_m=BLOCK_M):
  """pos, offsets and rows as docs/design.md (section 2) defines them: each expert's routes in
  ascending (t, j) order, each expert's first row a multiple of block_m; invalid ids get pos
  -1."""
  experts = np.asarray(experts)
  T, k = experts.shape
  flat = experts.reshape(-1)
  valid = (flat >= 0) & (flat < E)
  counts = np.bincount(flat[valid], minlength=E)
  padded = -(-counts // block_m) * block_m
  offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
  pos = np.full(T * k, -1, np.int32)
  rows = np.full(ops.routed_rows(T * k, E, block_m), -1, np.int32)
  for e in range(E):
    (q,) = np.nonzero(flat == e)
    pos[q] = offsets[e] + np.arange(len(q))
    rows[pos[q]] = q
  return pos.reshape(T, k), offsets, rows


def forward(case, backend="cuda", config=None):
  f = jax.jit(lambda *a: mok_jax.moe(*a, shared=case.shared, config=config, backend=backend))
  return np.asarray(f(*case.args()).astype(jnp.float32))


@functools.lru_cache(maxsize=1)  # per_block_m runs the block_ms of a case one after another
def expected(T, H, I, E, k, Is, seed, routing=None):
  """(case, the oracle's y, the XLA backend's y): what the kernel must match for any block_m.
  routing: a name of cases.cuda_routing, or None for distinct random experts."""
  experts = None if routing is None else cuda_routing(routing, T, E, k)
  case = make_case(T, H, I, E, k, Is=Is, dtype=BF16, seed=seed, experts=experts)
  return case, oracle.moe(*case.args(), case.shared, round_to=BF16), forward(case, "xla")


def check_against_oracle(expected_, block_m):
  case, want, xla = expected_
  y = forward(case, config=mok_jax.Config(block_m=block_m))
  assert_close(y, want, BF16_RTOL, f"y vs oracle, block_m {block_m}")
  assert_close(y, xla, BF16_RTOL, f"y vs xla backend, block_m {block_m}")


SHAPES = CUDA_SHAPES + ((4096, 1024, 512, 128, 8, 0),)


@pytest.mark.parametrize("T,H,I,E,k,Is,block_m", per_block_m(SHAPES))
def test_forward_matches_oracle(T, H, I, E, k, Is, block_m):
  check_against_oracle(expected(T, H, I, E, k, Is, seed=T), block_m)


@pytest.mark.parametrize("name,block_m", per_block_m(CUDA_ROUTINGS))
def test_adversarial_routing(name, block_m):
  check_against_oracle(expected(700, 128, 192, 8, 3, 0, seed=3, routing=name), block_m)


@functools.lru_cache(maxsize=1)
def expected_tails():
  ids = tail_routing()
  case = make_case(len(ids), 256, 320, 16, ids.shape[1], dtype=BF16, seed=8, experts=ids)
  return case, oracle.moe(*case.args(), round_to=BF16), forward(case, "xla")


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_tails_spread_over_row_tiles(block_m):
  """Experts whose rows past their last multiple of 128 ride in their last full row tiles, 16 a
  tile (cases.TAIL_COUNTS: 1-127 such rows over 1-8 full tiles), beside experts whose cannot,
  with narrow column tiles among them."""
  check_against_oracle(expected_tails(), block_m)


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_layout_residuals_are_exact(block_m):
  ids = cuda_routing("out_of_range", T=3000, E=40, k=5)
  case = make_case(3000, 64, 64, 40, 5, dtype=BF16, seed=4, experts=ids.astype(np.int32))
  local = jnp.asarray(np.where((ids >= 0) & (ids < 40), ids, -1), jnp.int32)
  _, res = jax.jit(lambda *a: ops.moe_fwd(*a, out_dtype=BF16, block_m=block_m))(
      case.x, local, case.weights, case.w_gate, case.w_up, case.w_down)
  pos, offsets, rows = numpy_layout(ids, 40, block_m)
  if block_m < 128:  # the case this block_m exists for: an expert ending in a half tile
    assert np.any(np.diff(offsets) % 128), np.diff(offsets)
  np.testing.assert_array_equal(np.asarray(res.pos), pos)
  np.testing.assert_array_equal(np.asarray(res.offsets), offsets)
  # Every row: the routed ones, each expert's padding and the rows past offsets[E] (-1).
  np.testing.assert_array_equal(np.asarray(res.rows), rows)


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_bitwise_deterministic(block_m):
  case = make_case(4096, 512, 256, 64, 8, Is=128, dtype=BF16, seed=5)
  f = jax.jit(lambda *a: ops.moe_fwd(*a, case.shared, out_dtype=BF16, block_m=block_m))
  local = jnp.asarray(case.experts, jnp.int32)
  args = (case.x, local, case.weights, case.w_gate, case.w_up, case.w_down)
  first = jax.tree.map(np.asarray, f(*args))
  for _ in range(3):
    again = jax.tree.map(np.asarray, f(*args))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      assert bits(a) == bits(b)


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_same_bits_with_command_buffers(block_m):
  plain = cuda_digests_with(NO_COMMAND_BUFFER_FLAGS)[str(block_m)]["fwd"]
  graphs = cuda_digests_with(COMMAND_BUFFER_FLAGS)[str(block_m)]["fwd"]
  assert plain == [plain[0]] * REPLAYS, plain
  assert graphs == plain


def test_scan_over_layers():
  L, T, H, I, E, k = 3, 512, 256, 128, 16, 4
  rng = np.random.default_rng(8)
  bf = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, jnp.bfloat16)
  x = bf(T, H)
  wr = bf(L, H, E, scale=H**-0.5)
  wg, wu, wd = bf(L, E, H, I, scale=H**-0.5), bf(L, E, H, I, scale=H**-0.5), bf(L, E, I, H, scale=I**-0.5)

  def model(x, params, backend):
    def layer(x, p):
      r, g, u, d = p
      experts, weights = mok_jax.route((x @ r).astype(jnp.float32), k)
      return x + mok_jax.moe(x, experts, weights, g, u, d, backend=backend), None
    return jax.lax.scan(layer, x, params)[0]

  run = jax.jit(model, static_argnums=2)
  y_cuda = np.asarray(run(x, (wr, wg, wu, wd), "cuda").astype(jnp.float32))
  y_xla = np.asarray(run(x, (wr, wg, wu, wd), "xla").astype(jnp.float32))
  assert_close(y_cuda, y_xla, 3 * BF16_RTOL, "scan")


def test_gradients_through_cuda_forward():
  case = make_case(600, 128, 192, 8, 2, Is=64, dtype=BF16, seed=9)
  _, got = loss_and_grads(case, "cuda")
  _, want = loss_and_grads(case, "xla")
  for name in want:
    assert_close(got[name], want[name], BF16_GRAD_RTOL, f"d{name}")


def test_auto_picks_cuda_for_bf16():
  assert ops.cuda_device_problem(jax.local_devices()) is None  # a Hopper
  dims = ops.MoeDims(T=8, H=64, I=64, E=4, k=2, Is=0)
  assert ops.cuda_unsupported_reason("gpu", BF16, dims, mok_jax.Config()) is None
  assert "divisible by 64" in ops.cuda_unsupported_reason(
      "gpu", BF16, dims._replace(H=96), mok_jax.Config())
