"""The NVLink transport's kernels on hardware (cuda/sm90/ep_transport.cuh), through the CUDA
module's self-test (ffi/ep_transport_selftest.h): P ranks of one GPU, each on its own stream,
over one workspace cut into P segments, R rounds of LaunchEpDispatch -> a stand-in expert ->
LaunchEpCombine, the launchers of the custom calls mok_ep_dispatch and mok_ep_combine. Checked
against NumPy: the device plan against mok_jax.expert_parallel.plan, every received row
bit-equal to the row routed there with its route, expert, weight and counts, the combined y
bit-equal to an f32 sum of the slots in j order rounded to bf16 and each route's returned f32
value, the same y for P = 1, 2, 4, over rounds, CUDA-graph replays and dispatches of two rounds
enqueued before their combines; a rank that never runs makes the others time out with rank
and stage, not hang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mok_jax import expert_parallel, ops
from mok_jax.workspace import Workspace

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
N, H, K, E = 256, 256, 4, 16  # tokens over all ranks, width, routes a token, experts in all
ROUNDS = 3
WAIT_BOUND_NS = 2_000_000_000  # the timeout test's bound: short, so that the file stays fast


# --- the reference: the routed-row layout and the transport, in NumPy --------------------------

def reference_plan(experts, E_local, P, C):
  """mok_jax.expert_parallel.plan by its definition: block d of the send slots holds the routes
  to rank d in ascending t k + j, the first C of them."""
  ids = experts.reshape(-1)
  valid = (ids >= 0) & (ids < E_local * P)
  dest = np.where(valid, ids // np.maximum(E_local, 1), P)
  route = np.full(P * C, -1, np.int32)
  slot = np.full(ids.size, -1, np.int32)
  need = np.zeros(P, np.int32)
  for d in range(P):
    mine = np.flatnonzero(dest == d)
    need[d] = mine.size
    kept = mine[:C]
    route[d * C:d * C + kept.size] = kept
    slot[kept] = d * C + np.arange(kept.size)
  return route, slot.reshape(experts.shape), np.minimum(need, C), need


def expert_out(x_rows, global_ids, scales):
  """The stand-in expert: a row times its expert's scale, f32 product rounded to bf16."""
  return (x_rows.astype(np.float32) * scales[global_ids][:, None]).astype(BF16)


def reference_y(x, experts, weights, slot, scales):
  """y[t] = bf16(sum_j w[t, j] out(t, j) in j order, f32), routes without a slot skipped.
  The weights are powers of two, so each product is exact and the f32 sum has one rounding a
  step, as the kernel's fmaf has."""
  T, k = experts.shape
  acc = np.zeros((T, x.shape[1]), np.float32)
  for j in range(k):
    has = slot[:, j] >= 0
    out = expert_out(x, np.where(has, experts[:, j], 0), scales).astype(np.float32)
    w = np.ones(T, np.float32) if weights is None else weights[:, j]
    acc = np.where(has[:, None], acc + w[:, None] * out, acc).astype(np.float32)
  return acc.astype(BF16)


def split(a, P):
  """(N, ...) global tokens -> (P, N / P, ...): rank s holds tokens [s N / P, (s + 1) N / P)."""
  return a.reshape(P, a.shape[0] // P, *a.shape[1:])


def global_problem(seed, rounds=ROUNDS, invalid=True):
  """Each round's tokens, routes (distinct experts a token, a few ids outside [0, E)) and
  power-of-two weights over all N tokens; one scale a global expert."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rounds, N, H)).astype(BF16)
  experts = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(N)]) for _ in range(rounds)])
  experts = experts.astype(np.int32)
  if invalid:
    experts[:, 3, 1], experts[:, N - 1, 0], experts[:, 7, 2] = -1, E, E + 100
  weights = (2.0 ** rng.integers(-2, 2, (rounds, N, K))).astype(np.float32)
  scales = rng.uniform(0.5, 2.0, E).astype(np.float32)
  return x, experts, weights, scales


def run(P, x, experts, weights, scales, capacity=None, graph=False, in_flight=1, silent_rank=-1):
  """The self-test on P ranks of GPU 0 (inputs (R, N, ...) over all tokens)."""
  T = N // P
  lay = Workspace.layout(T, H, K, E, P, capacity)
  ws = Workspace.get([0] * P, lay.bytes)
  per_rank = lambda a: np.ascontiguousarray(np.stack([split(r, P) for r in a]))
  return lay, ws, ops._mok_cuda.ep_transport_selftest(
      ws.handle, lay.offsets(), lay.C, per_rank(x).view(np.uint16), per_rank(experts),
      None if weights is None else per_rank(weights), scales, graph=graph, in_flight=in_flight,
      silent_rank=silent_rank)


def check_round(got, r, P, lay, x, experts, weights, scales):
  """Round r of a self-test against the reference, rank by rank."""
  T, C, E_local = lay.T, lay.C, E // P
  xs, es = split(x[r], P), split(experts[r], P)
  ws_ = None if weights is None else split(weights[r], P)
  plans = [reference_plan(es[s], E_local, P, C) for s in range(P)]
  for s in range(P):
    route, slot, sent, need = plans[s]
    np.testing.assert_array_equal(got["route"][r, s], route, f"round {r} rank {s}: route")
    np.testing.assert_array_equal(got["slot"][r, s], slot, f"round {r} rank {s}: slot")
    np.testing.assert_array_equal(got["sent"][r, s], sent, f"round {r} rank {s}: sent")
    np.testing.assert_array_equal(got["need"][r, s], need, f"round {r} rank {s}: need")
  for d in range(P):  # the receiving rank
    for s in range(P):  # block s: what rank s sent
      route, _, sent, _ = plans[s]
      n = sent[d]
      rows = route[d * C:d * C + n]
      block, rest = slice(s * C, s * C + n), slice(s * C + n, (s + 1) * C)
      counts = got["counts"][r, d, s]
      assert counts[0] == n, f"round {r}: rank {d} counts {counts[0]} rows from {s}, not {n}"
      local = es[s].reshape(-1)[rows] % E_local
      np.testing.assert_array_equal(counts[1:], np.bincount(local, minlength=E_local),
                                    f"round {r}: rank {d}'s counts by expert from {s}")
      np.testing.assert_array_equal(got["route_recv"][r, d, block], rows)
      np.testing.assert_array_equal(got["expert_recv"][r, d, block], local)
      w = np.ones(rows.size, np.float32) if ws_ is None else ws_[s].reshape(-1)[rows]
      np.testing.assert_array_equal(got["weight_recv"][r, d, block], w)
      # Past the count: no route, no expert, weight 0 (the rows there are not written).
      assert (got["route_recv"][r, d, rest] == -1).all()
      assert (got["expert_recv"][r, d, rest] == -1).all()
      assert (got["weight_recv"][r, d, rest] == 0).all()
      want = xs[s][rows // K].view(np.uint16)
      np.testing.assert_array_equal(got["x_recv"][r, d, block], want,
                                    f"round {r}: rank {d}'s rows from rank {s} (bits)")
  for s in range(P):
    w = None if ws_ is None else ws_[s]
    want = reference_y(xs[s], es[s], w, plans[s][1], scales)
    np.testing.assert_array_equal(got["y"][r, s], want.view(np.uint16),
                                  f"round {r} rank {s}: combined y (bits)")
    # The value each route's owner sent back: its weight times its expert's scale (f32).
    slot = plans[s][1]
    ids = np.where(slot >= 0, es[s], 0)
    back = (np.ones(slot.shape, np.float32) if w is None else w) * scales[ids]
    np.testing.assert_array_equal(got["out_weights"][r, s], np.where(slot >= 0, back, 0),
                                  f"round {r} rank {s}: returned row weights")


# --- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("P", [1, 2, 4])
def test_rounds_match_numpy(P):
  x, experts, weights, scales = global_problem(P)
  lay, _, got = run(P, x, experts, weights, scales)
  for r in range(ROUNDS):
    check_round(got, r, P, lay, x, experts, weights, scales)


def test_same_bits_for_every_P():
  x, experts, weights, scales = global_problem(7)
  ys = {P: run(P, x, experts, weights, scales)[2]["y"] for P in (1, 2, 4)}
  for P in (2, 4):  # (R, P, T, H) -> (R, N, H): every rank's tokens in order
    np.testing.assert_array_equal(ys[P].reshape(ROUNDS, N, H), ys[1].reshape(ROUNDS, N, H),
                                  f"P = {P} against P = 1")


def test_plan_matches_expert_parallel_plan():
  P = 4
  x, experts, weights, scales = global_problem(11, rounds=1)
  lay, _, got = run(P, x, experts, weights, scales)
  for s, es in enumerate(split(experts[0], P)):
    p = expert_parallel.plan(jnp.asarray(es), E // P, P, lay.C)
    np.testing.assert_array_equal(got["route"][0, s], np.asarray(p.route))
    np.testing.assert_array_equal(got["slot"][0, s], np.asarray(p.slot))
    np.testing.assert_array_equal(got["sent"][0, s], np.asarray(p.sent))
    assert got["need"][0, s].max() == int(p.need)


@pytest.mark.parametrize("P", [2, 4])
def test_graph_replays_and_back_to_back_calls(P):
  """One call of ROUNDS rounds, then the same rounds captured once per rank into a graph and
  replayed on the same workspace: each round correct, the epochs advanced by the kernels."""
  x, experts, weights, scales = global_problem(20 + P)
  lay, _, plain = run(P, x, experts, weights, scales)
  _, _, graphed = run(P, x, experts, weights, scales, graph=True)
  for r in range(ROUNDS):
    check_round(graphed, r, P, lay, x, experts, weights, scales)
  # Received rows past a block's count are not written: compare what every round writes.
  for name in ("y", "out_weights", "counts", "route", "slot", "sent", "need", "route_recv",
               "expert_recv", "weight_recv"):
    np.testing.assert_array_equal(graphed[name], plain[name], name)
  assert (plain["epochs"] == plain["epochs"][0, 0]).all()  # every rank, both calls
  np.testing.assert_array_equal(graphed["epochs"], plain["epochs"] + ROUNDS)


@pytest.mark.parametrize("P", [2, 4])
def test_two_dispatches_before_their_combines(P):
  """Each rank enqueues the dispatches of two rounds, then both combines (as XLA may order two
  independent layers): each call is a collective of its own, so every round is right."""
  x, experts, weights, scales = global_problem(40 + P, rounds=4)
  lay, _, got = run(P, x, experts, weights, scales, in_flight=2)
  for r in range(4):
    check_round(got, r, P, lay, x, experts, weights, scales)


def test_bounded_capacity_reports_the_overflow():
  """C below what some rank sends: the overflowing routes get no slot (need > C says so) and
  the rest arrive and combine as the reference has them."""
  P, capacity = 4, 40  # about N / P * K / P = 64 routes a (source, destination) pair
  x, experts, weights, scales = global_problem(5, rounds=1)
  lay, _, got = run(P, x, experts, weights, scales, capacity=capacity)
  assert lay.C == capacity and (got["need"][0] > capacity).any()
  check_round(got, 0, P, lay, x, experts, weights, scales)


def test_unweighted_combine():
  P = 2
  x, experts, _, scales = global_problem(9, rounds=1)
  lay, _, got = run(P, x, experts, None, scales)
  check_round(got, 0, P, lay, x, experts, None, scales)


def test_workspace_segments():
  P = 4
  lay = Workspace.layout(N // P, H, K, E, P)
  ws = Workspace.get([0] * P, lay.bytes)
  assert Workspace.for_layer([0] * P, N // P, H, K, E) is ws
  info = ws.info()
  assert info["devices"] == [0] * P and info["bytes"] == lay.bytes
  assert info["stride"] >= lay.bytes
  assert np.diff(info["bases"]).tolist() == [info["stride"]] * (P - 1)


def test_a_silent_rank_times_out_with_rank_and_stage(tmp_path):
  """Rank 1 of 2 never runs: rank 0's dispatch waits for its flag, times out after the bound,
  prints rank, stage, peer and flags, and traps; the process fails instead of hanging."""
  script = textwrap.dedent(f"""
      import numpy as np
      from mok_jax import ops
      from mok_jax.workspace import Workspace
      P, T, H, K, E = 2, 32, 64, 2, 4
      lay = Workspace.layout(T, H, K, E, P)
      ws = Workspace.get([0] * P, lay.bytes)
      x = np.zeros((1, P, T, H), np.uint16)
      experts = np.tile(np.arange(K, dtype=np.int32), (1, P, T, 1))
      try:
        ops._mok_cuda.ep_transport_selftest(
            ws.handle, lay.offsets(), lay.C, x, experts, None, np.ones(E, np.float32),
            silent_rank=1, wait_bound_ns={WAIT_BOUND_NS})
      except RuntimeError as e:
        print("raised:", e, flush=True)
        raise SystemExit(3)
      print("returned", flush=True)
      """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, env=env, cwd=tmp_path)
  out = done.stdout + done.stderr
  assert done.returncode == 3, out
  assert "mok_jax ep_transport timeout: rank 0, stage dispatch, peer 1: flag 0, waited for 1" \
      in out, out
  assert "raised: ep_transport_selftest: rank 0" in out, out


@pytest.mark.multigpu
def test_ranks_on_distinct_gpus():
  """The same rounds with one rank a GPU, through peer access (needs P2P between them)."""
  import jax

  P = min(4, len(jax.devices("gpu")))
  P = 2 if P == 3 else P
  x, experts, weights, scales = global_problem(30)
  lay = Workspace.layout(N // P, H, K, E, P)
  ws = Workspace.get(jax.devices("gpu")[:P], lay.bytes)
  per_rank = lambda a: np.ascontiguousarray(np.stack([split(r, P) for r in a]))
  for graph in (False, True):
    got = ops._mok_cuda.ep_transport_selftest(
        ws.handle, lay.offsets(), lay.C, per_rank(x).view(np.uint16), per_rank(experts),
        per_rank(weights), scales, graph=graph, in_flight=1 if graph else 2)
    for r in range(ROUNDS):
      check_round(got, r, P, lay, x, experts, weights, scales)
