"""The routed layer: each route's token row goes to the rank that holds its expert, and each
route's output comes back to its one home slot (t, j).

`plan` lays a rank's routes out in (P, C) send slots, on every rank from its own routing and
with no host sync: its routes to rank d in ascending (t, j), in block d, C slots a block (C =
Config.ep_capacity, or T k: dropless). An all-to-all of those blocks (`exchange`, which moves
only the rows that hold routes) hands rank d every rank's rows for its experts, source rank by
source rank, so that rank d sees them in global token order, as one device does; rows that
stay home do not leave the device. Its
experts run on exactly those rows, each a token of one route of weight 1: the result is each
route's unweighted output, with the bits one device gives it. The reverse exchange brings
each output to its home slot, and the home rank sums its k slots in j order, then the shared
expert's output, with one device's arithmetic (mok_moe_combine on the FFI backends,
reference.combine on XLA): y has the same bits for every P. The backward mirrors it: dy to the
owners, each route's dx and dweights back to their slots, dx summed in j order; each expert's
weight gradients sum over its rows on its owner, in global token order, as one device sums them.
The shared expert runs at home on the rank's own tokens (data parallel: its weight gradients are
summed over ranks by shard_map, so they match one device to rounding, not in every bit).

With P = 1 (no axis_name) the exchanges are the identity: the XLA backend's layer is this one on
every mesh, and the FFI backends' EP = 1 has the bits of their fused single-device call.

Two transports move the rows (`transport`, Config.ep_transport): XLA's collectives (`exchange`),
or, for the CUDA kernels on GPUs of one process, the NVLink transport's custom calls
(mok_jax.ep_transport), which compute the same plan on the device, move the rows through a
symmetric workspace and sum at home with the same kernel: the same layout and the same bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mok_jax import ep_transport, ops, quantize, reference
from mok_jax.config import Config


class Plan(NamedTuple):
  """Where a rank's routes go (see the module's docstring); integers only, not differentiated."""

  route: jax.Array  # (P C,) int32: the route t k + j in each send slot; -1 for an empty slot
  slot: jax.Array  # (T, k) int32: the send slot of route (t, j); -1 for an id outside [0, E)
  need: jax.Array  # () int32: the most routes this rank sends to one rank
  sent: jax.Array  # (P,) int32: the rows this rank sends to each rank, at most C


def capacity(T: int, k: int, config: Config) -> int:
  """C, the send slots of one (source, destination) block: T k (every route of a rank to one
  rank: dropless) unless Config.ep_capacity bounds it."""
  return T * k if config.ep_capacity is None else min(config.ep_capacity, T * k)


def plan(experts, n_local: int, n_ranks: int, C: int) -> Plan:
  """The send layout of routes `experts` (T, k) global ids, expert e held by rank e // n_local:
  block d holds the routes to rank d in ascending (t, j), the first C of them."""
  T, k = experts.shape
  ids = experts.reshape(-1)
  valid = (ids >= 0) & (ids < n_local * n_ranks)  # compared before any cast: no id wraps
  dest = jnp.where(valid, ids // n_local, n_ranks).astype(jnp.int32)
  order = jnp.argsort(dest, stable=True).astype(jnp.int32)
  counts = jnp.bincount(dest, length=n_ranks + 1).astype(jnp.int32)
  first = jnp.cumsum(counts) - counts
  to = dest[order]
  at = jnp.arange(T * k, dtype=jnp.int32) - first[to]
  fits = (to < n_ranks) & (at < C)
  sorted_slot = jnp.where(fits, to * C + at, -1)
  slot = jnp.zeros((T * k,), jnp.int32).at[order].set(sorted_slot)
  # Slots that nothing fills keep -1; a route past C (an overflow, reported by check_capacity)
  # is dropped by the scatter instead of being written out of bounds.
  route = jnp.full((n_ranks * C,), -1, jnp.int32).at[
      jnp.where(fits, sorted_slot, n_ranks * C)].set(order, mode="drop")
  return Plan(route, slot.reshape(T, k), jnp.max(counts[:n_ranks], initial=0),
              jnp.minimum(counts[:n_ranks], C))


def _raise_overflow(need, C):
  if int(need) > C:
    raise ValueError(
        f"mok_jax.moe: a rank sends {int(need)} routed rows to one rank, more than "
        f"Config.ep_capacity = {C}; raise ep_capacity (or leave it None: dropless)")


def check_capacity(need, C: int, config: Config):
  """With Config.ep_capacity set, an error from the device when a rank needs more than C slots
  towards some rank (need: () int32, the most routes it sends one rank; a host callback each
  call: the price of a bound). Dropless needs none."""
  if config.ep_capacity is not None:
    jax.debug.callback(functools.partial(_raise_overflow, C=C), need)


# Platforms whose XLA has no ragged all-to-all (XLA:CPU): they move whole (C, ...) blocks.
DENSE_PLATFORMS = ("cpu",)


def exchange(a, axis_name, n_ranks: int, sizes=None):
  """(P C, ...) in blocks by destination rank -> (P C, ...) in blocks by source rank: block d of
  every rank goes to rank d, the identity on one rank. sizes: None, or (send, recv) (P,) int32,
  the rows of each block that hold data going out and coming in; then only those rows move
  (jax.lax.ragged_all_to_all) and the rest of each received block is zeros, except on
  DENSE_PLATFORMS, which move every block whole (an all_to_all: the same result where the
  blocks' rows past `send` are zeros). Its own inverse with sizes reversed."""
  if axis_name is None:
    return a

  def dense(a, *_):
    blocks = a.reshape(n_ranks, -1, *a.shape[1:])
    return jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True).reshape(a.shape)

  if sizes is None:
    return dense(a)

  def ragged(a, send, recv):
    C = a.shape[0] // n_ranks
    starts = jnp.arange(n_ranks, dtype=jnp.int32) * C
    # Each rank's rows land in block `its index` of every receiver's buffer.
    at = jnp.full((n_ranks,), jax.lax.axis_index(axis_name) * C, jnp.int32)
    return _ragged_all_to_all(a, jnp.zeros_like(a), starts, send, at, recv, axis_name=axis_name)

  per_platform = {p: dense for p in DENSE_PLATFORMS}
  return jax.lax.platform_dependent(a, *sizes, default=ragged, **per_platform)


# A module attribute, so that the tests can run the ragged path on CPU through an emulation.
_ragged_all_to_all = jax.lax.ragged_all_to_all


def _per_slot(a, route, k=1):
  """a[route // k] for each send slot (a's rows are tokens with k = the routes a token, or
  routes with k = 1), zeros in empty slots: (P C, ...)."""
  got = a[jnp.maximum(route, 0) // k]
  return jnp.where((route >= 0).reshape(-1, *(1,) * (a.ndim - 1)), got, jnp.zeros((), a.dtype))


class XlaPieces(NamedTuple):
  """The routed layer's parts on the XLA backend (reference.py)."""

  ragged_dot: object = None  # None: reference.expert_rows' own
  precision: str = "bf16"  # Config.precision

  def experts_fwd(self, x_rows, ids, weights, keep=True):
    del keep
    f = functools.partial(reference.expert_rows, ragged_dot=self.ragged_dot,
                          precision=self.precision)
    out, vjp = jax.vjp(lambda xr, w: f(xr, ids, *w), x_rows, weights)
    rows = out.astype(x_rows.dtype)
    return rows, (vjp, rows)

  def experts_bwd(self, res, dy_rows, w_rows):
    vjp, rows = res
    dy32 = dy_rows.astype(jnp.float32)
    dx_rows, d_experts = vjp(w_rows[:, None] * dy32)
    # d y / d w of a route: <dy, its output as combined>.
    dw_rows = jnp.sum(dy32 * rows.astype(jnp.float32), axis=-1)
    return dx_rows.astype(rows.dtype), dw_rows, d_experts

  def combine(self, rows, slot, weights, extra, out_dtype):
    return reference.combine(rows, slot, weights, extra, out_dtype)

  def shared_fwd(self, x, shared, keep=True):
    del keep
    out, vjp = jax.vjp(functools.partial(reference.shared_mlp, precision=self.precision), x,
                       shared)
    return out, vjp

  def shared_bwd(self, vjp, dy):
    dx, dshared = vjp(dy.astype(jnp.float32))
    return dx.astype(jnp.float32), dshared


class FfiPieces(NamedTuple):
  """The routed layer's parts on the FFI backends: the fused targets on routes of one row each
  (mok_moe_fwd with k = 1 and weight 1 gives each route's unweighted output, and mok_moe_bwd
  with the route's weight its dx and dweights) and mok_moe_combine at home. With an FP8
  Config.precision the FP8 targets (mok_moe_fwd_fp8, mok_moe_bwd_fp8) in their place, on each
  expert weight quantized once a call (ops.fp8_weight): every row is quantized on its own, so
  the bits are the fused call's."""

  config: Config
  ranks: int

  def _call(self, f, x, *args, **kw):
    out = f(x, *args, **kw)
    return reference.vary(out, reference.varying_axes(x))

  @property
  def fp8(self) -> bool:
    return self.config.precision != "bf16"

  def _fp8_fwd(self, x, experts, weights, blocks, shared_blocks, keep, ranks):
    """mok_moe_fwd_fp8: y, and the residuals of mok_moe_bwd_fp8 when keep."""
    y, buffers = self._call(ops.moe_fwd_fp8, x, experts, weights, *blocks, shared_blocks,
                            out_dtype=x.dtype, block_m=self.config.block_m, ranks=ranks,
                            keep_gu=keep)
    return y, ops.Fp8Residuals(*buffers[:len(ops.Fp8Residuals._fields)]) if keep else None

  def experts_fwd(self, x_rows, ids, weights, keep=True):
    # keep=False (not differentiated): the recompute mode, which keeps and writes no gu; y has
    # the same bits.
    N = x_rows.shape[0]
    ones = jnp.ones((N, 1), jnp.float32)
    if self.fp8:
      # Config.recompute: the backward runs the forward again for its residuals.
      blocks = tuple(map(ops.fp8_weight, weights))
      rows, res = self._fp8_fwd(x_rows, ids[:, None], ones, blocks, None,
                                keep and not self.config.recompute, self.ranks)
      return rows, (x_rows, ids, weights, (blocks, res))
    rows, res = self._call(ops.moe_fwd, x_rows, ids[:, None], ones, *weights, None,
                           out_dtype=x_rows.dtype, block_m=self.config.block_m,
                           recompute=self.config.recompute or not keep, ranks=self.ranks)
    return rows, (x_rows, ids, weights, res.saved())

  def experts_bwd(self, res, dy_rows, w_rows):
    x_rows, ids, weights, residuals = res
    if self.fp8:
      blocks, kept = residuals
      if kept is None:
        ones = jnp.ones((x_rows.shape[0], 1), jnp.float32)
        kept = self._fp8_fwd(x_rows, ids[:, None], ones, blocks, None, True, self.ranks)[1]
      g = self._call(ops.moe_bwd_fp8, dy_rows.astype(x_rows.dtype), x_rows, ids[:, None],
                     w_rows[:, None], *blocks, None, kept, block_m=self.config.block_m,
                     ranks=self.ranks)
      return g.x, g.weights[:, 0], tuple(
          map(quantize.master_cotangent, weights, (g.w_gate, g.w_up, g.w_down)))
    g = self._call(ops.moe_bwd, dy_rows, x_rows, ids[:, None], w_rows[:, None], *weights, None,
                   residuals, block_m=self.config.block_m, recompute=self.config.recompute,
                   ranks=self.ranks)
    return g.x, g.weights[:, 0], (g.w_gate, g.w_up, g.w_down)

  def combine(self, rows, slot, weights, extra, out_dtype):
    extra = None if extra is None else extra.astype(rows.dtype)
    return self._call(ops.moe_combine, rows, slot, weights, extra, out_dtype=out_dtype)

  def _no_routes(self, x, shared):
    T, H, Is = x.shape[0], x.shape[1], shared[0].shape[1]
    # The shared expert alone: mok_moe_fwd with no route (one expert that nobody picks, of the
    # shared expert's own width), whose y is the shared output with the bits the fused call
    # adds to each token.
    none = jnp.zeros((1, H, Is), x.dtype), jnp.zeros((1, H, Is), x.dtype)
    return (jnp.full((T, 1), -1, jnp.int32), jnp.zeros((T, 1), jnp.float32), *none,
            jnp.zeros((1, Is, H), x.dtype))

  def shared_fwd(self, x, shared, keep=True):
    routes = self._no_routes(x, shared)
    if self.fp8:
      experts, weights, *none = routes
      blocks = tuple(map(ops.fp8_weight, none)), tuple(map(ops.fp8_weight, shared))
      y, res = self._fp8_fwd(x, experts, weights, *blocks, keep and not self.config.recompute, 1)
      return y, (x, shared, (blocks, res))
    y, res = self._call(ops.moe_fwd, x, *routes, shared, out_dtype=x.dtype,
                        block_m=self.config.block_m, recompute=self.config.recompute or not keep,
                        ranks=1)
    return y, (x, shared, res.saved())

  def shared_bwd(self, saved, dy):
    x, shared, res = saved
    experts, weights, *none = self._no_routes(x, shared)
    if self.fp8:
      (blocks, shared_blocks), kept = res
      if kept is None:
        kept = self._fp8_fwd(x, experts, weights, blocks, shared_blocks, True, 1)[1]
      g = self._call(ops.moe_bwd_fp8, dy.astype(x.dtype), x, experts, weights, *blocks,
                     shared_blocks, kept, block_m=self.config.block_m, ranks=1)
      return g.x, tuple(map(quantize.master_cotangent, shared, g.shared))
    g = self._call(ops.moe_bwd, dy, x, experts, weights, *none, shared, res,
                   block_m=self.config.block_m, recompute=self.config.recompute, ranks=1)
    return g.x, g.shared


def transport(config: Config, pieces, dtype, H: int, n_local: int, n_ranks: int) -> str:
  """The transport that moves the routed rows: Config.ep_transport, with "auto" resolved to
  "nvlink" where the NVLink transport can run on the GPUs of one process (the CUDA kernels,
  GPUs that reach each other's memory) and to "collective" elsewhere (several processes
  included: ep_transport.auto_declines); "nvlink" where it cannot is an
  error saying why."""
  if config.ep_transport == "collective":
    return "collective"
  problem = nvlink_problem(pieces, dtype, H, n_local, n_ranks)
  if config.ep_transport == "auto":
    return "collective" if problem or ep_transport.auto_declines() else "nvlink"
  if problem:
    raise ValueError(f"moe: Config(ep_transport='nvlink') cannot run here: {problem}. Use "
                     "ep_transport='collective' (XLA's all-to-all), or 'auto', which picks it "
                     "where the NVLink transport cannot run")
  return "nvlink"


def nvlink_problem(pieces, dtype, H: int, n_local: int, n_ranks: int) -> str | None:
  """Why the NVLink transport (mok_jax.ep_transport) cannot move this layer's rows, or None."""
  if not isinstance(pieces, FfiPieces):
    return ("the XLA backend moves the routed rows with XLA's collectives; the NVLink "
            "transport runs with the CUDA kernels (backend 'cuda', or 'ffi' and 'auto' on a "
            "Hopper GPU)")
  platform = jax.default_backend()
  if platform != "gpu":
    return (f"JAX's default backend is {platform!r}, where the FFI targets are the C++ CPU "
            "reference; the NVLink transport runs on CUDA GPUs only")
  return ep_transport.unavailable_reason(dtype, H, n_local, n_ranks)


def routed_moe(x, experts, weights, w_gate, w_up, w_down, shared, *, pieces, axis_name,
               config: Config):
  """y of `mok_jax.moe`'s contract, routed as the module's docstring says.

  x (T, H); experts (T, k) global ids (int); weights (T, k) f32; w_gate, w_up (E_local, H, I),
  w_down (E_local, I, H) the experts of this rank; shared None or its three weights; pieces:
  XlaPieces or FfiPieces; axis_name: the shard_map axis of the experts, or None (one rank).
  The transport (`transport`): XLA's collectives (`exchange`), or the NVLink transport's custom
  calls (mok_jax.ep_transport) with the same layout and the same bits.
  """
  n_ranks = 1 if axis_name is None else int(jax.lax.axis_size(axis_name))
  T, k = experts.shape
  C = capacity(T, k, config)
  if axis_name is not None and transport(config, pieces, x.dtype, x.shape[1], w_gate.shape[0],
                                         n_ranks) == "nvlink":
    return _nvlink_moe(x, experts, weights, w_gate, w_up, w_down, shared, pieces=pieces,
                       axis_name=axis_name, n_ranks=n_ranks, C=C, config=config)
  p = plan(experts, w_gate.shape[0], n_ranks, C)
  check_capacity(p.need, C, config)
  # Each send slot's expert as its destination holds it: rank e // E_local's expert e % E_local.
  ids = _per_slot(experts.reshape(-1) % w_gate.shape[0], p.route).astype(jnp.int32)
  ids = jnp.where(p.route >= 0, ids, -1)
  # The rows each rank sends this one (a (P,) all_to_all).
  recv = exchange(p.sent, axis_name, n_ranks)
  args = (x, weights, (w_gate, w_up, w_down), shared)
  axes = frozenset().union(*map(reference.varying_axes, jax.tree.leaves((args, p, ids, recv))))
  args, routing = reference.vary((args, (p, ids, recv)), axes)
  return _routed_vjp(pieces, axis_name, n_ranks)(*args, *routing)


@functools.lru_cache(maxsize=None)
def _routed_vjp(pieces, axis_name, n_ranks):
  """The routed layer's custom VJP for these static parts (cached, so that jit sees one
  function for one layer)."""

  def exchanges(p, recv):
    """To the owners and back: only the rows that hold routes move (`exchange`)."""
    out = functools.partial(exchange, axis_name=axis_name, n_ranks=n_ranks, sizes=(p.sent, recv))
    back = functools.partial(exchange, axis_name=axis_name, n_ranks=n_ranks, sizes=(recv, p.sent))
    return out, back

  def forward(x, weights, experts_w, shared, p, ids, recv, keep=True):
    k = p.slot.shape[1]
    out, back = exchanges(p, recv)
    x_recv = out(_per_slot(x, p.route, k))
    ids_recv = out(ids + 1) - 1  # received blocks' empty rows are zeros: ids -1
    w_recv = out(_per_slot(weights.reshape(-1), p.route))
    rows_out, experts_res = pieces.experts_fwd(x_recv, ids_recv, experts_w, keep)
    rows_back = back(rows_out)
    extra, shared_res = (None, None) if shared is None else pieces.shared_fwd(x, shared, keep)
    y = pieces.combine(rows_back, p.slot, weights, extra, x.dtype)
    return y, (p, recv, w_recv, experts_res, shared_res)

  @jax.custom_vjp
  def layer(x, weights, experts_w, shared, p, ids, recv):
    # The primal, run when nothing is differentiated: no backward reads residuals.
    return forward(x, weights, experts_w, shared, p, ids, recv, keep=False)[0]

  def backward(saved, dy):
    p, recv, w_recv, experts_res, shared_res = saved
    k = p.slot.shape[1]
    out, back = exchanges(p, recv)
    dy_recv = out(_per_slot(dy, p.route, k))
    dx_recv, dw_recv, d_experts = pieces.experts_bwd(experts_res, dy_recv, w_recv)
    dx_back, dw_back = back(dx_recv), back(dw_recv)
    dx_extra, d_shared = (None, None) if shared_res is None else pieces.shared_bwd(shared_res,
                                                                                   dy)
    dx = pieces.combine(dx_back, p.slot, None, dx_extra, dy.dtype)  # dy, y and x: one dtype
    dweights = jnp.where(p.slot >= 0, dw_back[jnp.maximum(p.slot, 0)], 0.0)
    return dx, dweights.astype(jnp.float32), d_experts, d_shared, None, None, None

  layer.defvjp(forward, backward)
  return layer


# Module attributes, so that the tests can run the NVLink layer on CPU through an emulation of
# the two calls' contract.
_ep_dispatch = ep_transport.dispatch
_ep_combine = ep_transport.combine


def _nvlink_moe(x, experts, weights, w_gate, w_up, w_down, shared, *, pieces, axis_name,
                n_ranks, C, config):
  """routed_moe over the NVLink transport: mok_ep_dispatch and mok_ep_combine in place of the
  exchanges, the device computing the plan."""
  n_local = w_gate.shape[0]
  # int32 ids, -1 for any outside [0, E) (compared before the cast: no id wraps).
  ids = jnp.where((experts >= 0) & (experts < n_local * n_ranks), experts, -1).astype(jnp.int32)
  args = (x, weights, (w_gate, w_up, w_down), shared)
  axes = frozenset().union(*map(reference.varying_axes, jax.tree.leaves((args, ids))))
  args, ids = reference.vary((args, ids), axes)
  return _nvlink_vjp(pieces, axis_name, n_ranks, n_local, C, config)(*args, ids)


@functools.lru_cache(maxsize=None)
def _nvlink_vjp(pieces, axis_name, n_ranks, n_local, C, config):
  """The NVLink layer's custom VJP for these static parts. Its transpose runs the same two
  calls: dy goes to the owners as x did (with each route's weight, which the owner's backward
  takes), and each route's dx and dweights come back to their home slots, dx summed in j
  order."""

  # "auto": where the mesh's devices are unknown when the program is lowered, the same
  # contract through XLA's collectives (mok_jax.ep_transport); "nvlink": an error there.
  fallback = config.ep_transport == "auto"

  def send(rows, experts, weights):
    return _ep_dispatch(rows, experts, weights, axis_name=axis_name, n_local=n_local,
                        n_ranks=n_ranks, capacity=C, fallback=fallback)

  def back(rows, row_weights, sent, weights, extra, out_dtype):
    return _ep_combine(rows, row_weights, sent.received, sent.pos, weights, extra,
                       axis_name=axis_name, out_dtype=out_dtype, fallback=fallback)

  def forward(x, weights, experts_w, shared, experts, keep=True):
    sent = send(x, experts, weights)
    check_capacity(jnp.max(sent.need), C, config)
    got = sent.received
    rows_out, experts_res = pieces.experts_fwd(got.x, got.expert, experts_w, keep)
    extra, shared_res = (None, None) if shared is None else pieces.shared_fwd(x, shared, keep)
    y, _ = back(rows_out, None, sent, weights, extra, x.dtype)
    return y, (experts, weights, experts_res, shared_res)

  @jax.custom_vjp
  def layer(x, weights, experts_w, shared, experts):
    # The primal, run when nothing is differentiated: no backward reads residuals.
    return forward(x, weights, experts_w, shared, experts, keep=False)[0]

  def backward(saved, dy):
    experts, weights, experts_res, shared_res = saved
    sent = send(dy.astype(ep_transport.DTYPE), experts, weights)
    got = sent.received
    dx_recv, dw_recv, d_experts = pieces.experts_bwd(experts_res, got.x, got.weight)
    dx_extra, d_shared = (None, None) if shared_res is None else pieces.shared_bwd(shared_res,
                                                                                   dy)
    dx, dweights = back(dx_recv, dw_recv, sent, None, dx_extra, dy.dtype)
    return dx, dweights, d_experts, d_shared, None

  layer.defvjp(forward, backward)
  return layer
