"""The CUDA backward (mok_moe_bwd on platform CUDA): every gradient against the float64 oracle
and the XLA backend, with a cosine-similarity floor, for every block_m the kernel takes
(ops.CUDA_BLOCK_MS); bitwise repeatable, with and without CUDA graphs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mok_jax
from mok_jax import ops
import oracle
from cases import (BF16, BF16_GRAD_RTOL, COMMAND_BUFFER_FLAGS, CUDA_SHAPES, GRAD_NAMES,
                   NO_COMMAND_BUFFER_FLAGS, REPLAYS, assert_close, bits,
                   check_bwd_takes_residual_buffers, cuda_digests_with, cuda_routing,
                   loss_and_grads, make_case, oracle_grads_dict, per_block_m, tail_routing)

pytestmark = pytest.mark.gpu

# Every gradient of the bf16 kernel points where the float64 one does.
COSINE_FLOOR = 0.9999


def cosine(a, b):
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  na, nb = np.linalg.norm(a), np.linalg.norm(b)
  if na == 0 or nb == 0:
    return 1.0 if na == nb else 0.0
  return float(a @ b / (na * nb))


@functools.lru_cache(maxsize=1)  # per_block_m runs the block_ms of a case one after another
def expected(T, H, I, E, k, Is, seed, routing=None):
  """(case, the oracle's gradients, the XLA backend's): what the kernel must match for any
  block_m. routing: a name of cases.cuda_routing, the (T, k) int64 ids' bytes, or None for
  distinct random experts."""
  if isinstance(routing, bytes):  # ids as bytes (a hashable cache key)
    experts = np.frombuffer(routing, np.int64).reshape(T, k)
  else:
    experts = None if routing is None else cuda_routing(routing, T, E, k, seed=2)
  case = make_case(T, H, I, E, k, Is=Is, dtype=BF16, seed=seed, experts=experts)
  want = oracle_grads_dict(oracle.moe_grads(case.dy, *case.args(), case.shared, round_to=BF16))
  return case, want, loss_and_grads(case, "xla")[1]


def check_grads(expected_, block_m):
  """Checks the CUDA kernel's gradients; returns them."""
  case, want, xla = expected_
  _, got = loss_and_grads(case, "cuda", mok_jax.Config(block_m=block_m))
  for name in want:
    g = got[name].astype(np.float32)
    what = f"d{name}, block_m {block_m}"
    assert_close(g, want[name], BF16_GRAD_RTOL, f"{what} vs oracle")
    assert_close(g, xla[name].astype(np.float32), BF16_GRAD_RTOL, f"{what} vs xla")
    assert cosine(g, want[name]) >= COSINE_FLOOR, (what, cosine(g, want[name]))
  return got


@pytest.mark.parametrize("T,H,I,E,k,Is,block_m", per_block_m(CUDA_SHAPES))
def test_gradients_match_oracle(T, H, I, E, k, Is, block_m):
  check_grads(expected(T, H, I, E, k, Is, seed=T + 1), block_m)


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_zero_route_weights(block_m):
  """Routes of weight 0 (dropped or masked): their rows' dh, dgu and w h are zeros, and their
  weights' gradients are still <dy, the expert's output> (test_moe_bwd.py's case, at the kernel's
  sizes)."""
  case = make_case(700, 128, 192, 8, 3, dtype=BF16, seed=4)
  weights = np.asarray(case.weights).copy()
  weights[::3, 1] = 0.0
  case = case._replace(weights=jnp.asarray(weights))
  want = oracle_grads_dict(oracle.moe_grads(case.dy, *case.args(), case.shared, round_to=BF16))
  got = check_grads((case, want, loss_and_grads(case, "xla")[1]), block_m)
  assert np.all(np.asarray(got["weights"])[::3, 1] != 0)


@pytest.mark.parametrize("name,block_m", per_block_m(("one_expert", "empty_experts",
                                                      "out_of_range")))
def test_adversarial_routing(name, block_m):
  E = 8
  want = expected(700, 128, 192, E, 3, 0, seed=3, routing=name)
  got = check_grads(want, block_m)
  if name != "out_of_range":
    ids = want[0].experts
    unused = [e for e in range(E) if not (ids == e).any()]
    for e in unused:  # empty experts get exactly zero weight gradients
      assert not np.any(got["w_gate"][e]) and not np.any(got["w_down"][e])


def test_bwd_takes_the_residual_buffers():
  """XLA hands the backward gu's buffer for dgu and xs's for its xs (ops.bwd_aliases): no copy
  on the GPU either."""
  check_bwd_takes_residual_buffers("cuda")


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_gradients_with_spread_tails(block_m):
  """Every gradient, saved and recomputed gu alike (the recompute runs the forward's gate|up
  with its tails), on experts whose last rows ride in their full row tiles (cases.TAIL_COUNTS)."""
  ids = tail_routing(k=3)
  T = len(ids)
  want = expected(T, 256, 192, 16, 3, 64, seed=9, routing=ids.tobytes())
  saved = check_grads(want, block_m)
  _, recomputed = loss_and_grads(want[0], "cuda", mok_jax.Config(block_m=block_m,
                                                                 recompute=True))
  differ = sorted(name for name in saved if bits(saved[name]) != bits(recomputed[name]))
  assert not differ, f"recompute: different bits in {differ}"


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_bitwise_deterministic(block_m):
  case = make_case(4096, 512, 256, 64, 8, Is=128, dtype=BF16, seed=5)
  config = mok_jax.Config(block_m=block_m)
  _, first = loss_and_grads(case, "cuda", config)
  for _ in range(2):
    _, again = loss_and_grads(case, "cuda", config)
    for name in first:
      assert bits(first[name]) == bits(again[name]), name


@pytest.mark.parametrize("routing", ["random", "skewed", "one_expert"])
def test_same_bits_for_every_block_m(routing):
  """block_m only moves where each expert's rows start: every row meets the same k-order and
  the padding adds zeros, so y and every gradient are the same bits for 64 (half tiles, several
  tiles per persistent CTA here) as for 128."""
  T, E, k = 4096, 128, 8
  rng = np.random.default_rng(11)
  experts = None
  if routing == "skewed":
    experts = np.minimum(rng.zipf(1.5, (T, k)) - 1, E - 1)
  elif routing == "one_expert":
    experts = np.full((T, k), 7)
  case = make_case(T, 512, 384, E, k, Is=128, dtype=BF16, seed=12, experts=experts)
  results = [loss_and_grads(case, "cuda", mok_jax.Config(block_m=b)) for b in ops.CUDA_BLOCK_MS]
  (y0, g0), (y1, g1) = results
  assert bits(y0) == bits(y1)
  differ = sorted(name for name in g0 if bits(g0[name]) != bits(g1[name]))
  assert not differ, f"different bits for block_m {ops.CUDA_BLOCK_MS} in {differ}"


@pytest.mark.parametrize("block_m", ops.CUDA_BLOCK_MS)
def test_same_bits_with_command_buffers(block_m):
  """The loss, y and every gradient of jitted value_and_grad calls: the same bits on every
  replay of the captured graph as without command buffers."""
  plain = cuda_digests_with(NO_COMMAND_BUFFER_FLAGS)[str(block_m)]["grad"]
  graphs = cuda_digests_with(COMMAND_BUFFER_FLAGS)[str(block_m)]["grad"]
  assert set(plain[0]) == {"loss", "y", *GRAD_NAMES}, plain[0].keys()
  assert plain == [plain[0]] * REPLAYS, plain
  for i, replay in enumerate(graphs):
    differ = sorted(name for name in plain[0] if replay[name] != plain[0][name])
    assert not differ, f"call {i} with command buffers: different bits in {differ}"


# The launch choices of cuda/sm90/heuristics.cuh as Python sees them, for E experts, `expected`
# rows (ExpectedRoutedRows) and `routes` routes expected on this GPU: (clusters of two with
# tails over full row tiles, runs of weight-gradient tiles).
def launch_choices(expected, routes, E):
  return expected <= 512 * E, routes <= 160 * E


# Routings that take every launch choice both ways between ranks = 1 and 64: uniform, tails of
# 1-127 rows in every position, all routes in one expert (reductions far past the weight
# gradients' stages in runs), most experts empty.
LAUNCH_ROUTINGS = ("uniform", "tails", "one_expert", "empty_experts")


@functools.lru_cache(maxsize=1)
def launch_case(routing):
  if routing == "uniform":
    return make_case(4096, 512, 384, 64, 8, Is=128, dtype=BF16, seed=13)
  if routing == "tails":
    ids = tail_routing()
    return make_case(len(ids), 384, 320, int(ids.max()) + 1, ids.shape[1], Is=128, dtype=BF16,
                     seed=7, experts=ids)
  return make_case(2048, 384, 320, 16, 4, Is=128, dtype=BF16, seed=9,
                   experts=cuda_routing(routing, 2048, 16, 4, seed=9))


@pytest.mark.parametrize("routing,block_m", per_block_m(LAUNCH_ROUTINGS))
def test_same_bits_whatever_the_launch_choices(routing, block_m):
  """`ranks` (expert parallelism's hint: the share of the rows that hold routes) moves every
  launch choice and never a bit: ranks = 1 runs these cases one CTA a tile, with tails of at
  most 16 rows and the weight-gradient tiles one at a time; ranks = 64 in clusters of two, with
  tails over up to eight full row tiles and runs of eight weight-gradient tiles."""
  case = launch_case(routing)
  (T, k), E = case.experts.shape, case.w_gate.shape[0]
  routes, R = T * k, ops.routed_rows(T * k, E, block_m)
  choices = [launch_choices(R - routes + -(-routes // r), -(-routes // r), E) for r in (1, 64)]
  assert choices == [(False, False), (True, True)], choices  # the case takes both sides
  args = (case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down)

  @functools.partial(jax.jit, static_argnums=0)
  def layer(ranks, dy, *a):
    y, res = ops.moe_fwd(*a, case.shared, out_dtype=BF16, block_m=block_m, ranks=ranks)
    return y, ops.moe_bwd(dy, *a, case.shared, res, block_m=block_m, ranks=ranks)

  dy = case.dy.astype(BF16)
  want = jax.tree.leaves(layer(1, dy, *args))
  got = jax.tree.leaves(layer(64, dy, *args))
  assert len(got) == len(want) == 9  # y; dx, dweights, dw_gate, dw_up, dw_down, the shared 3
  differ = [i for i, (g, w) in enumerate(zip(got, want)) if bits(g) != bits(w)]
  assert not differ, f"{routing}, block_m {block_m}: different bits in outputs {differ}"


def test_f32_partial_output_under_shard_map():
  """Expert parallelism over a 1-GPU axis: the kernel returns an f32 partial y and gets f32 dy."""
  case = make_case(512, 128, 128, 8, 2, dtype=BF16, seed=6)
  mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
  experts = jnp.asarray(case.experts)

  def loss(backend, x, w, wg, wu, wd):
    f = jax.shard_map(
        functools.partial(mok_jax.moe, axis_name="ep", backend=backend), mesh=mesh,
        in_specs=(P("ep"), P("ep"), P("ep"), P("ep"), P("ep"), P("ep")), out_specs=P("ep"))
    y = f(x, experts, w, wg, wu, wd)
    return jnp.sum(y.astype(jnp.float32) * case.dy)

  args = (case.x, case.weights, case.w_gate, case.w_up, case.w_down)
  got = jax.jit(jax.grad(functools.partial(loss, "cuda"), argnums=range(5)))(*args)
  want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=range(5)))(*args)
  for name, g, w in zip(("x", "weights", "w_gate", "w_up", "w_down"), got, want):
    assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32), BF16_GRAD_RTOL, name)


def test_backward_target_is_registered():
  assert ops.has_cuda_target("mok_moe_bwd")
