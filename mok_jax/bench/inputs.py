"""Benchmark inputs: router logits, routing through `mok_jax.route`, and the layer's tensors.

Every worker builds bit-identical inputs for a given seed, whatever its framework:

- Routing is computed on the host CPU: NumPy logits, then mok_jax.route (softmax, top-k,
  renormalise) on JAX's CPU device.
- Tensors come from a counter-based hash (murmur3's 32-bit finaliser of each element's linear
  index and a per-tensor salt) mapped to a uniform distribution of the wanted standard
  deviation. The arithmetic is exact in 32-bit integers and f32 up to one final product, so JAX
  (`uniform`, fused under jit, nothing materialised) and PyTorch (torch_peer.py) produce the
  same values and the report can compare output checksums across frameworks.

Load: the logits are Gumbel noise, so top-k picks experts uniformly at random. With skew s > 0
they get a prior log p_e, p_e ~ 1 / rank_e^s (Zipf, ranks a fixed permutation of 1..E): the
Gumbel top-k trick then samples k distinct experts per token with probability proportional to p.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
FMIX = (0x85EBCA6B, 0xC2B2AE35)

# Tensor ids in the salt: each tensor of a run gets its own stream.
W_GATE, W_UP, W_DOWN, WS_GATE, WS_UP, WS_DOWN = range(1, 7)


def x_id(i: int) -> int:
  return 100 + 2 * i


def dy_id(i: int) -> int:
  return 101 + 2 * i


def _fmix32_int(h: int) -> int:
  h ^= h >> 16
  h = (h * FMIX[0]) & MASK32
  h ^= h >> 13
  h = (h * FMIX[1]) & MASK32
  return h ^ (h >> 16)


def salt(seed: int, tensor_id: int) -> int:
  return _fmix32_int((seed * 0x27D4EB2F + tensor_id * 0x165667B1) & MASK32)


def half_width(std: float) -> np.float32:
  """A uniform distribution on [-a, a) has standard deviation a / sqrt(3)."""
  return np.float32(std * math.sqrt(3.0))


def uniform(dims: tuple, salt_: int, width: float, dtype):
  """(dims) array of `dtype`: hash of the row-major linear index (mod 2^32) and salt_, uniform
  on [-width, width)."""
  return _uniform(tuple(dims), dtype, jnp.uint32(salt_), jnp.float32(width))


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


def router_logits(T: int, E: int, seed: int, skew: float) -> np.ndarray:
  rng = np.random.default_rng(seed)
  logits = rng.gumbel(size=(T, E))
  if skew > 0:
    ranks = np.random.default_rng(0x5EED).permutation(E) + 1
    logits = logits - skew * np.log(ranks)[None, :]
  return logits.astype(np.float32)


@functools.lru_cache(maxsize=None)
def _route_fn(k: int):
  import mok_jax  # pylint: disable=import-outside-toplevel

  return jax.jit(lambda logits: mok_jax.route(logits, k))


def routing(T: int, E: int, k: int, seed: int, skew: float) -> tuple[np.ndarray, np.ndarray]:
  """experts (T, k) int32 and weights (T, k) f32 from mok_jax.route on the host CPU."""
  logits = router_logits(T, E, seed, skew)
  try:
    cpu = jax.devices("cpu")[0]
  except RuntimeError:  # JAX_PLATFORMS without cpu: route on the default device
    cpu = None
  with jax.default_device(cpu):
    experts, weights = _route_fn(k)(logits)
    return np.asarray(experts), np.asarray(weights)


def load_stats(experts: np.ndarray, E: int) -> dict:
  """How evenly routes fall on experts: max/mean routes per expert, and empty experts."""
  counts = np.bincount(np.asarray(experts).reshape(-1), minlength=E)[:E]
  mean = counts.mean()
  return {"max_over_mean": round(float(counts.max() / mean), 4) if mean else 0.0,
          "max_routes": int(counts.max()), "min_routes": int(counts.min()),
          "empty_experts": int((counts == 0).sum())}


def stds(shape) -> dict:
  """Standard deviations that keep activations O(1), so no path meets inf or NaN."""
  return {W_GATE: shape.H ** -0.5, W_UP: shape.H ** -0.5, W_DOWN: shape.I ** -0.5,
          WS_GATE: shape.H ** -0.5, WS_UP: shape.H ** -0.5,
          WS_DOWN: max(shape.Is, 1) ** -0.5}


def jax_inputs(shape, dtype, seed: int, skew: float, n_sets: int):
  """(params, sets): params = (w_gate, w_up, w_down, shared or None) on the default device;
  sets = n_sets tuples (x, experts, weights, dy), each with its own tokens and routing."""
  T, H, I, E, k, Is = shape.T, shape.H, shape.I, shape.E, shape.k, shape.Is
  std = stds(shape)

  def make(dims, tensor_id, sd=1.0):
    return uniform(tuple(dims), salt(seed, tensor_id), float(half_width(sd)), dtype)

  w_gate = make((E, H, I), W_GATE, std[W_GATE])
  w_up = make((E, H, I), W_UP, std[W_UP])
  w_down = make((E, I, H), W_DOWN, std[W_DOWN])
  shared = None
  if Is:
    shared = (make((H, Is), WS_GATE, std[WS_GATE]), make((H, Is), WS_UP, std[WS_UP]),
              make((Is, H), WS_DOWN, std[WS_DOWN]))
  sets = []
  for i in range(n_sets):
    experts, weights = routing(T, E, k, seed + 1 + i, skew)
    sets.append((make((T, H), x_id(i)), jnp.asarray(experts), jnp.asarray(weights),
                 make((T, H), dy_id(i))))
  jax.block_until_ready((w_gate, w_up, w_down, shared, sets))
  return (w_gate, w_up, w_down, shared), sets
