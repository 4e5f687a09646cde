"""Benchmark inputs, bit-identical in every framework for a seed. Routing: Gumbel logits (with
skew s a Zipf prior log p_e, p_e ~ 1 / rank_e^s, so that the Gumbel top-k trick samples experts
by p) through mok_jax.route on the CPU. Tensors: murmur3's finaliser of each element's index and
a salt, mapped to a uniform distribution, exact in 32-bit integers and f32 up to one product, so
that JAX and PyTorch (torch_peer.uniform) make the same values and checksums compare.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1


def fmix(h, mul):
  """murmur3's finaliser of h, with mul(h, c) = h * c mod 2^32 in the caller's integer type."""
  h = mul(h ^ (h >> 16), 0x85EBCA6B)
  h = mul(h ^ (h >> 13), 0xC2B2AE35)
  return h ^ (h >> 16)


def salt(seed: int, tensor_id: int) -> int:
  return fmix((seed * 0x27D4EB2F + tensor_id * 0x165667B1) & MASK32, lambda h, c: h * c & MASK32)


def specs(shape, n_sets: int) -> list[tuple[int, tuple, float]]:
  """(tensor id, dims, half width) of w_gate, w_up, w_down, then x and dy of each input set.
  Uniform on [-a, a) has standard deviation a / sqrt(3): the weights' keep the activations O(1),
  so that no path meets inf or NaN; x's and dy's are 1."""
  T, H, I, E = shape.T, shape.H, shape.I, shape.E
  return ([(1, (E, H, I), (3 / H) ** 0.5), (2, (E, H, I), (3 / H) ** 0.5),
           (3, (E, I, H), (3 / I) ** 0.5)]
          + [(100 + j, (T, H), 3 ** 0.5) for j in range(2 * n_sets)])


@functools.partial(jax.jit, static_argnums=(0, 1))
def uniform(dims: tuple, dtype, salt_, width):
  """Uniform on [-width, width) from the hash of the row-major index (mod 2^32) and salt_."""
  u32 = jnp.uint32
  index = jnp.zeros(dims, u32)
  for axis, size in enumerate(dims):
    index = index * u32(size) + jax.lax.broadcasted_iota(u32, dims, axis)
  h = fmix(index * u32(GOLDEN) + salt_, lambda h, c: h * u32(c))
  unit = (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -23) - jnp.float32(1.0)
  return (unit * width).astype(dtype)


_route = jax.jit(mok_jax.route, static_argnums=1)


def routing(T: int, E: int, k: int, seed: int, skew: float) -> tuple[np.ndarray, np.ndarray]:
  """experts (T, k) int32 and weights (T, k) f32, routed on the host CPU."""
  logits = np.random.default_rng(seed).gumbel(size=(T, E))
  if skew > 0:
    ranks = np.random.default_rng(0x5EED).permutation(E) + 1
    logits = logits - skew * np.log(ranks)[None, :]
  try:
    cpu = jax.devices("cpu")[0]
  except RuntimeError:  # JAX_PLATFORMS without cpu
    cpu = None
  with jax.default_device(cpu):
    experts, weights = _route(logits.astype(np.float32), k)
    return np.asarray(experts), np.asarray(weights)


def load_stats(experts, E: int) -> dict:
  """What the table shows of the routes per expert."""
  counts = np.bincount(np.asarray(experts).reshape(-1), minlength=E)[:E]
  return {"max_over_mean": round(float(counts.max() / counts.mean()), 4) if counts.any() else 0.0,
          "empty_experts": int((counts == 0).sum())}


def jax_inputs(shape, dtype, seed: int, skew: float, n_sets: int):
  """((w_gate, w_up, w_down), [(x, experts, weights, dy)] * n_sets)."""
  w = [uniform(dims, dtype, jnp.uint32(salt(seed, tid)), jnp.float32(width))
       for tid, dims, width in specs(shape, n_sets)]
  sets = [(w[3 + 2 * i], *map(jnp.asarray, routing(shape.T, shape.E, shape.k, seed + 1 + i, skew)),
           w[4 + 2 * i]) for i in range(n_sets)]
  jax.block_until_ready((w[:3], sets))
  return tuple(w[:3]), sets
