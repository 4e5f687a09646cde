"""`mok_jax.moe` over a mesh: tokens split over some axes, experts optionally over one more.

`placement` reads it off the inputs' explicit shardings (`jax.typeof(a).sharding`, meshes with
`AxisType.Explicit` axes); the Flax and Equinox layers name it in their options. `sharded_moe`
then runs the layer in `jax.shard_map`: every token shard computes its own tokens, so data
parallelism needs no communication in the forward, and with an expert axis the layer's own
expert parallelism (mok_jax.expert_parallel) moves the routed tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec


class Placement(NamedTuple):
  mesh: object  # jax.sharding.Mesh or AbstractMesh
  token_axes: tuple[str, ...]  # the axes that split the tokens, expert_axis among them if set
  expert_axis: str | None  # the axis that splits the experts, or None: replicated experts


def axis_type(mesh, name) -> AxisType:
  return dict(zip(mesh.axis_names, mesh.axis_types))[name]


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(a) -> tuple[tuple[str, ...], ...]:
  """The axes of each dimension of a's explicit sharding (none under Auto axes or shard_map)."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return ((),) * jnp.ndim(a)
  spec = tuple(sharding.spec) + (None,) * (jnp.ndim(a) - len(sharding.spec))
  return tuple(_axes(s) for s in spec)


def rowwise(f, a):
  """f(a) for an f that works along a's last axis alone (jax.lax.top_k): in shard_map where
  a's leading axes are explicitly split and its last is not, since XLA gathers a to every
  device for some such ops (top_k on CPU); else f(a) as it is."""
  spec = _spec(a)
  if not any(spec[:-1]) or spec[-1]:
    return f(a)
  split = PartitionSpec(*(s or None for s in spec))
  return jax.shard_map(f, mesh=jax.typeof(a).sharding.mesh, in_specs=split,
                       out_specs=split)(a)


def token_rows(x):
  """x (..., C) as (T, C) rows, and the function that puts rows (T, C') back into x's leading
  axes and their sharding.

  Rows stay on the devices that hold them. Where x's leading axes are explicitly split other
  than on the first alone, a plain reshape would not keep them there (JAX refuses to merge a
  split axis behind another, and merging two split axes moves rows between devices): each
  split axis is cut into (shards, rows a shard), the shard counts go first, and the rows are
  the devices' blocks one after another.
  """
  spec, lead = _spec(x), x.shape[:-1]
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  n = [math.prod(mesh.shape[a] for a in s) if s else 1 for s in spec[:-1]]
  if not any(spec[1:-1]) or spec[-1] or any(L % m for L, m in zip(lead, n)):
    return x.reshape(-1, x.shape[-1]), lambda y: y.reshape(*lead, y.shape[-1])
  d = len(lead)
  split = [v for m, L in zip(n, lead) for v in (m, L // m)]
  outer = [s or None for s in spec[:-1]]
  placed = lambda *entries: NamedSharding(mesh, PartitionSpec(*entries))  # noqa: E731
  order = (*range(0, 2 * d, 2), *range(1, 2 * d, 2), 2 * d)
  rows = jnp.reshape(x, (*split, x.shape[-1]),
                     out_sharding=placed(*(v for s in outer for v in (s, None)), None))
  rows = jnp.reshape(jnp.transpose(rows, order), (-1, x.shape[-1]),
                     out_sharding=placed(sum(spec[:-1], ()), None))

  def back(y):
    y = jnp.reshape(y, (*split[0::2], *split[1::2], y.shape[-1]),
                    out_sharding=placed(*outer, *(None,) * (d + 1)))
    y = jnp.transpose(y, tuple(order.index(i) for i in range(2 * d + 1)))
    return jnp.reshape(y, (*lead, y.shape[-1]), out_sharding=placed(*outer, None))

  return rows, back


def placement(x, experts, weights, w_gate, w_up, w_down, shared) -> Placement | None:
  """Where `mok_jax.moe`'s inputs say the layer runs, or None when nothing is sharded.

  Tokens may be split over any axes (x's first dimension, or the routing's where x is not
  split); the expert stacks over one axis on their first dimension, which then splits the
  tokens too. Anything else (x's H, the weights' H or I, the shared expert) sharded is an
  error: the layer would have to gather it, which explicit sharding leaves to the caller.
  """
  arrays = {"x": x, "experts": experts, "weights": weights, "w_gate": w_gate, "w_up": w_up,
            "w_down": w_down}
  if shared is not None:
    arrays.update(ws_gate=shared[0], ws_up=shared[1], ws_down=shared[2])
  specs = {name: _spec(a) for name, a in arrays.items()}
  sharded = [name for name, spec in specs.items() if any(spec)]
  if not sharded:
    return None
  for name in sharded:
    spec, shown = specs[name], jax.typeof(arrays[name]).sharding.spec
    if name.startswith("ws_"):
      raise ValueError(f"moe: {name} is sharded as {shown}; the shared expert must be "
                       "replicated. Reshard it first (jax.sharding.reshard).")
    if any(spec[1:]):
      raise ValueError(f"moe: {name} is sharded as {shown}; only its first dimension may be "
                       "split over mesh axes (tokens for x, experts and weights; experts for "
                       "the expert stacks). Reshard it first (jax.sharding.reshard).")
  token_axes = next((specs[n][0] for n in ("x", "experts", "weights") if specs[n][0]), ())
  expert_axes = {specs[n][0] for n in ("w_gate", "w_up", "w_down")}
  if len(expert_axes) > 1:
    raise ValueError(f"moe: w_gate, w_up and w_down split their experts over different axes "
                     f"{sorted(expert_axes)}; split all three the same way")
  (expert,) = expert_axes
  if len(expert) > 1:
    raise ValueError(f"moe: the experts are split over several mesh axes {expert}; expert "
                     "parallelism takes one axis")
  expert_axis = expert[0] if expert else None
  if expert_axis is not None and expert_axis not in token_axes:
    token_axes = (*token_axes, expert_axis)
  mesh = jax.typeof(arrays[sharded[0]]).sharding.mesh
  return Placement(mesh, token_axes, expert_axis)


def sharded_moe(layer, x, experts, weights, w_gate, w_up, w_down, shared, where: Placement):
  """`layer` (the layer on one shard's checked inputs, its options bound, taking `axis_name`)
  in `shard_map` over `where`.

  T need not divide by the number of token shards: the tail is padded with tokens routed to
  id -1 (which contribute nothing) and cut off again. y comes back sharded as x was.
  """
  mesh, axis = where.mesh, where.expert_axis
  tok, rep = PartitionSpec(where.token_axes), PartitionSpec()
  ex = rep if axis is None else PartitionSpec(axis)
  T = x.shape[0]
  pad = -T % math.prod(mesh.shape[a] for a in where.token_axes)
  x_spec = jax.typeof(x).sharding.spec
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=-1)
    weights = jnp.pad(weights, ((0, pad), (0, 0)))
  args = [x, experts, weights, w_gate, w_up, w_down]
  specs = [tok, tok, tok, ex, ex, ex]
  if shared is not None:
    args += list(shared)
    specs += [rep, rep, rep]
  # shard_map reshards Auto-axis inputs itself; Explicit-axis inputs must arrive as in_specs.
  explicit = any(axis_type(mesh, a) == AxisType.Explicit for a in where.token_axes)
  if explicit:
    args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

  def local(x, experts, weights, w_gate, w_up, w_down, *shared):
    return layer(x, experts, weights, w_gate, w_up, w_down, shared=shared or None,
                 axis_name=axis)

  y = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=tok)(*args)
  if explicit:
    y = jax.sharding.reshard(y, NamedSharding(mesh, x_spec))
  return y[:T] if pad else y
