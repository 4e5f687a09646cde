"""Benchmark inputs, bit-identical in every framework for a seed. Routing: Gumbel logits (with
skew s a Zipf prior log p_e, p_e ~ 1 / rank_e^s, so that the Gumbel top-k trick samples experts
by p) through mok_jax.route on the CPU. Tensors: murmur3's finaliser of each element's index and
a salt, mapped to a uniform distribution, exact in 32-bit integers and f32 up to one product, so
that JAX and PyTorch (torch_peer.uniform) make the same values and checksums compare.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
FMIX = (0x85EBCA6B, 0xC2B2AE35)
W_GATE, W_UP, W_DOWN, WS_GATE, WS_UP, WS_DOWN = range(1, 7)  # tensor ids in the salt


def x_id(i: int) -> int:
  return 100 + 2 * i


def dy_id(i: int) -> int:
  return 101 + 2 * i


def salt(seed: int, tensor_id: int) -> int:
  h = (seed * 0x27D4EB2F + tensor_id * 0x165667B1) & MASK32
  h ^= h >> 16
  h = (h * FMIX[0]) & MASK32
  h ^= h >> 13
  h = (h * FMIX[1]) & MASK32
  return h ^ (h >> 16)


def half_width(std: float) -> np.float32:
  """Uniform on [-a, a) has standard deviation a / sqrt(3)."""
  return np.float32(std * math.sqrt(3.0))


def specs(shape) -> list[tuple[int, tuple, float]]:
  """(tensor id, dims, std) of w_gate, w_up, w_down and the shared expert's: stds that keep the
  activations O(1), so that no path meets inf or NaN."""
  H, I, E, Is = shape.H, shape.I, shape.E, shape.Is
  out = [(W_GATE, (E, H, I), H ** -0.5), (W_UP, (E, H, I), H ** -0.5),
         (W_DOWN, (E, I, H), I ** -0.5)]
  if Is:
    out += [(WS_GATE, (H, Is), H ** -0.5), (WS_UP, (H, Is), H ** -0.5),
            (WS_DOWN, (Is, H), Is ** -0.5)]
  return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _uniform(dims, dtype, salt_, width):
  u32 = jnp.uint32
  index = jnp.zeros(dims, u32)
  for axis, size in enumerate(dims):
    index = index * u32(size) + jax.lax.broadcasted_iota(u32, dims, axis)
  h = index * u32(GOLDEN) + salt_
  h = h ^ (h >> 16)
  h = h * u32(FMIX[0])
  h = h ^ (h >> 13)
  h = h * u32(FMIX[1])
  h = h ^ (h >> 16)
  unit = (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -23) - jnp.float32(1.0)
  return (unit * width).astype(dtype)


def uniform(dims: tuple, salt_: int, width: float, dtype):
  """Uniform on [-width, width) from the hash of the row-major index (mod 2^32) and salt_."""
  return _uniform(tuple(dims), dtype, jnp.uint32(salt_), jnp.float32(width))


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
  counts = np.bincount(np.asarray(experts).reshape(-1), minlength=E)[:E]
  mean = counts.mean()
  return {"max_over_mean": round(float(counts.max() / mean), 4) if mean else 0.0,
          "max_routes": int(counts.max()), "min_routes": int(counts.min()),
          "empty_experts": int((counts == 0).sum())}


def jax_inputs(shape, dtype, seed: int, skew: float, n_sets: int):
  """((w_gate, w_up, w_down, shared or None), [(x, experts, weights, dy)] * n_sets)."""
  def make(dims, tensor_id, std=1.0):
    return uniform(dims, salt(seed, tensor_id), float(half_width(std)), dtype)

  w = [make(dims, tid, std) for tid, dims, std in specs(shape)]
  params = (*w[:3], tuple(w[3:]) or None)
  sets = []
  for i in range(n_sets):
    experts, weights = routing(shape.T, shape.E, shape.k, seed + 1 + i, skew)
    sets.append((make((shape.T, shape.H), x_id(i)), jnp.asarray(experts), jnp.asarray(weights),
                 make((shape.T, shape.H), dy_id(i))))
  jax.block_until_ready((params, sets))
  return params, sets
