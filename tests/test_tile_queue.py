"""The tile queue that the CUDA launches keep in scratch (cuda/layout_contract.h): a header of
counters, then one count per row tile of the routed rows and of the shared expert's T rows. The
kernels index it by row tile without a bounds check, so the size must hold for every routing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mok_jax import ops

_mok_cpu = ops._mok_cpu

HEADER = 8  # kQueueHeaderInts


def routed_bound(T, k, E):
  """The routed part of tile_queue_ints: RoutedRowTilesBound(T k, E)."""
  return _mok_cpu.tile_queue_ints(T, k, E) - HEADER - -(-T // 128)


def row_tiles(counts, block_m):
  """Row tiles of 128 rows over experts whose rows are padded to block_m (ScanGroupTiles; the
  forward's tails, kTail, only take tiles away)."""
  padded = [-(-c // block_m) * block_m for c in counts]
  return sum(-(-p // 128) for p in padded)


def adversarial_counts(routes, E, rng):
  """Per-expert row counts summing to `routes` that make many row tiles: one row each (a half
  tile per expert), 129 rows (a full and a half tile), all on one expert, uniform at random."""
  yield [routes] + [0] * (E - 1)
  for per in (1, 65, 129, 193):
    counts = [0] * E
    left = routes
    for e in range(E):
      counts[e] = min(per, left)
      left -= counts[e]
    counts[-1] += left
    yield counts
  yield list(np.bincount(rng.integers(0, E, routes), minlength=E))


@pytest.mark.parametrize("T,k,E", [(1, 1, 1), (7, 2, 5), (64, 8, 128), (300, 4, 512),
                                    (1000, 1, 3), (4096, 8, 256)])
@pytest.mark.parametrize("block_m", [64, 128])
def test_every_routing_fits(T, k, E, block_m):
  rng = np.random.default_rng(T * 131 + E)
  bound = routed_bound(T, k, E)
  for counts in adversarial_counts(T * k, E, rng):
    assert sum(counts) == T * k
    assert row_tiles(counts, block_m) <= bound, counts


@pytest.mark.parametrize("T,k,E", list(itertools.product((1, 33, 1000), (1, 3, 8), (1, 17, 512))))
def test_python_formula_is_the_contract(T, k, E):
  """ops.footprint's Q and the forward's declared layout scratch are TileQueueInts."""
  q = HEADER + -(-(T * k + 127 * E) // 64) + -(-T // 128)
  assert _mok_cpu.tile_queue_ints(T, k, E) == q
  dims = ops.MoeDims(T, 64, 64, E, k, 0)
  layout = ops.fwd_results(dims, np.float32, np.float32, 128)[-1]
  chunks = -(-T * k // 1024)
  assert layout.shape == (chunks * E + q,)
