"""The NVLink transport of expert parallelism (`Config(ep_transport="nvlink")`): two custom calls
that move the routed rows of mok_jax.expert_parallel through a `mok_jax.Workspace`, inside the
CUDA kernels, in place of XLA's collectives (ffi/ep_transport_cuda.cc, cuda/ep_transport.h).

  mok_ep_dispatch  x, experts, weights -> `Received` and the home side's `pos` and `need`: the
                   routes laid out as `expert_parallel.plan` lays them out (computed on the
                   device), each route's row pushed into its owner's receive region, then what
                   this rank received copied out of its own
  mok_ep_combine   each received row's output (and, in the backward, an f32 value a row) pushed
                   back into its home slot t k + j, then the home sum of the k slots of each
                   token in j order, with mok_moe_combine's arithmetic

Each call is a collective of the EP group on its own (it waits until every peer has read what
this rank wrote into it the call before), so XLA may order independent calls as it likes, as
long as every rank runs the same program. Nothing on the host waits for the device and the
rounds are counted on the device: both carry kCmdBufferCompatible.

They are JAX primitives rather than `jax.ffi.ffi_call`s because the workspace a call uses
depends on the devices of its EP group, which a traced function does not know: their lowering
reads the devices off the mesh of the enclosing shard_map, gets the workspace of each EP group
(`Workspace.get`, created on first use and cached) and passes the handles as the attribute
`workspaces`; the handler takes the one that holds its GPU, whose place there is its rank.
Where the mesh has no devices when the program is lowered (shard_map over an AbstractMesh, as
explicitly sharded inputs give outside `jax.set_mesh`), a call of `fallback=True` (what
Config(ep_transport="auto") asks for) lowers to the same contract computed with XLA's
collectives (`expert_parallel.exchange`), the same bits; an explicit "nvlink" is an error
there, saying so. So is a workspace that does not fit in the GPU's memory (a warning under
"auto", a MemoryError naming the bytes and XLA_PYTHON_CLIENT_MEM_FRACTION under "nvlink").
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax._src import distributed
from jax.interpreters import mlir

from mok_jax import ops, reference
from mok_jax.workspace import Workspace, WorkspaceLayout

# The targets' buffers in argument order (the bindings in ffi/ep_transport_cuda.cc are checked
# against them, tests/test_buffer_table.py). P ranks, C send slots a (source, destination)
# block, E_local experts a rank, T tokens, k routes a token.
DISPATCH_OPERANDS = ("x", "experts", "weights")
DISPATCH_RESULTS = ("x_recv", "expert_recv", "weight_recv", "route_recv", "counts_recv", "pos",
                    "need", "route", "slot", "sent", "counts_to")
DISPATCH_SCRATCH = 4  # the last four results
COMBINE_OPERANDS = ("rows", "row_weights", "route_recv", "counts_recv", "pos", "weights",
                    "extra")
COMBINE_RESULTS = ("out", "out_weights")

TARGETS = ("mok_ep_dispatch", "mok_ep_combine")
DTYPE = jnp.dtype(jnp.bfloat16)  # the rows the kernels move
ROW_BYTES = 16  # rows move in 16-byte stores: H b must be a multiple of it
NO_WORKSPACE = 0  # the handle of a program lowered without its GPUs: the handler names why


class Received(NamedTuple):
  """What a rank received in a dispatch, in blocks by source rank: block s holds rank s's rows
  for this rank's experts in s's send order ((t, j) ascending), the layout that
  `expert_parallel.exchange` gives the collective transport. Rows past a block's count are not
  written (their expert is -1: nothing reads them)."""

  x: jax.Array  # (P C, H) bf16
  expert: jax.Array  # (P C,) int32: the local expert of each row, -1 past the counts
  weight: jax.Array  # (P C,) f32: its route's weight, 0 past the counts
  route: jax.Array  # (P C,) int32: its home route t k + j, -1 past the counts
  counts: jax.Array  # (P, 1 + E_local) int32: [s, 0] rows from rank s, [s, 1 + e] of them
  # for local expert e


class Dispatched(NamedTuple):
  received: Received
  pos: jax.Array  # (T, k) int32: t k + j where route (t, j) has a send slot, else -1
  need: jax.Array  # (P,) int32: this rank's routes to each rank, all of them (> C: overflow)


def layout_of(T: int, H: int, k: int, n_local: int, n_ranks: int, C: int) -> WorkspaceLayout:
  """The workspace layout of one layer's calls (bf16 rows)."""
  return Workspace.layout(T, H, k, n_local * n_ranks, n_ranks, C, DTYPE)


def unavailable_reason(dtype, H: int, n_local: int, n_ranks: int) -> str | None:
  """Why this process cannot run the NVLink transport on its GPUs for a layer of these sizes,
  or None. The caller has checked that the CUDA kernels run the layer (a Hopper GPU)."""
  if not all(ops.has_cuda_target(t) for t in TARGETS):
    return "mok_jax was installed without its CUDA module (no CUDA compiler found at build time)"
  if jax.process_count() > 1 and distributed.global_state.client is None:
    return (f"the JAX job has {jax.process_count()} processes but no jax.distributed client, "
            "through whose key-value store the workspace's CUDA IPC handles are exchanged")
  if jnp.dtype(dtype) != DTYPE:
    return f"the transport moves {DTYPE} rows, got {jnp.dtype(dtype)}"
  if H * DTYPE.itemsize % ROW_BYTES:
    return f"a row of H = {H} is not a multiple of {ROW_BYTES} bytes"
  limits = ops._mok_cuda.ep_transport_constants()  # cuda/ep_transport.h
  if n_ranks > limits["max_ranks"]:
    return f"the transport takes at most {limits['max_ranks']} ranks, got {n_ranks}"
  if n_local > limits["max_local_experts"]:
    return (f"the transport takes at most {limits['max_local_experts']} experts a rank, got "
            f"{n_local}")
  if n_ranks > 1:
    return _peer_problem()
  return None


def auto_declines() -> str | None:
  """Why Config.ep_transport "auto" picks the collective transport even where
  `unavailable_reason` is None, or None.

  Across processes: whether every rank is reachable (the processes on one host, their GPUs
  peers) is known only once the workspace's handles are exchanged, which happens when the
  program is lowered, after the transport has been picked (and across hosts only where the
  driver exports fabric handles). So "auto" keeps XLA's collectives there and "nvlink" opts
  in."""
  if jax.process_count() > 1:
    return (f"the JAX job has {jax.process_count()} processes: 'auto' keeps XLA's collectives "
            "across processes; ep_transport='nvlink' maps the workspace through CUDA IPC "
            "between the processes of one host, and through fabric handles across the hosts "
            "of an NVLink domain")
  return None


@functools.cache
def _peer_problem() -> str | None:
  """Why some two of this process's GPUs cannot map each other's memory, or None (the devices
  of a mesh are not known while a layer is traced: every pair of them is asked)."""
  gpus = [d.local_hardware_id for d in jax.local_devices() if d.platform == "gpu"]
  for a in gpus:
    for b in gpus:
      if a != b and not ops._mok_cuda.can_access_peer(a, b):
        return (f"GPU {a} cannot access the memory of GPU {b} (cudaDeviceCanAccessPeer = 0): "
                "the transport needs peer access (NVLink or PCIe P2P) between the GPUs")
  return None


def dispatch(x, experts, weights, *, axis_name, n_local: int, n_ranks: int, capacity: int,
             fallback: bool = False) -> Dispatched:
  """Target mok_ep_dispatch, under shard_map over `axis_name` (n_ranks ranks).

  Inputs:
    x (T, H) bf16 rows to send (x, or dy in the backward); experts (T, k) int32 global ids,
    expert e held by rank e // n_local (outside [0, n_local n_ranks): no route); weights (T, k)
    f32 sent with each row (None: 1). fallback: where no workspace can be found when the
    program is lowered, XLA's collectives instead of an error (module docstring).
  Outputs:
    `Dispatched`, of capacity C = `capacity` send slots a (source, destination) block; every
    output varies over the axes x varies over.
  """
  T, H = x.shape
  k = experts.shape[1]
  if x.dtype != DTYPE or experts.dtype != jnp.int32 or experts.shape[0] != T:
    raise ValueError(f"ep_dispatch: x must be (T, H) {DTYPE} and experts (T, k) int32, got "
                     f"{x.shape} {x.dtype} and {experts.shape} {experts.dtype}")
  weights = jnp.zeros((0, k), jnp.float32) if weights is None else weights
  lay = layout_of(T, H, k, n_local, n_ranks, capacity)
  out = _dispatch_p.bind(x, experts, weights.astype(jnp.float32), axis_name=axis_name,
                         layout=lay, fallback=bool(fallback))
  out = reference.vary(out[:len(DISPATCH_RESULTS) - DISPATCH_SCRATCH],
                       reference.varying_axes(x))
  *received, pos, need = out
  return Dispatched(Received(*received), pos, need)


def combine(rows, row_weights, received: Received, pos, weights, extra, *, axis_name,
            out_dtype, fallback: bool = False):
  """Target mok_ep_combine, under shard_map over `axis_name`, after the dispatch whose
  `received` and `pos` it takes.

  Inputs:
    rows (P C, H) bf16: the output of each received row; row_weights None or (P C,) f32 sent
    back with each row; pos (T, k); weights None (every weight 1) or (T, k) f32 for the home
    sum; extra None or (T, H) bf16 added after the routes. fallback: as for `dispatch`.
  Outputs:
    out (T, H) of out_dtype (bf16 or f32): sum_j weights[t, j] row of (t, j) in j order, in f32,
    plus extra[t], rounded once; out_weights (T, k) f32, each route's row_weights value (0
    without a slot), or None without row_weights.
  """
  T, k = pos.shape
  H = rows.shape[1]
  n_ranks, n_local = received.counts.shape[0], received.counts.shape[1] - 1
  if rows.dtype != DTYPE or rows.shape[0] != received.x.shape[0]:
    raise ValueError(f"ep_combine: rows must be {received.x.shape} {DTYPE}, got {rows.shape} "
                     f"{rows.dtype}")
  if jnp.dtype(out_dtype) not in (DTYPE, jnp.dtype(jnp.float32)):
    raise ValueError(f"ep_combine: out_dtype must be {DTYPE} or float32, got {out_dtype}")
  C = rows.shape[0] // n_ranks
  lay = layout_of(T, H, k, n_local, n_ranks, C)
  none = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
  out, out_weights = _combine_p.bind(
      rows, none(0) if row_weights is None else row_weights.astype(jnp.float32), received.route,
      received.counts, pos, none(0, k) if weights is None else weights.astype(jnp.float32),
      jnp.zeros((0, H), DTYPE) if extra is None else extra.astype(DTYPE), axis_name=axis_name,
      layout=lay, out_dtype=jnp.dtype(out_dtype), fallback=bool(fallback))
  out, out_weights = reference.vary((out, out_weights), reference.varying_axes(rows))
  return out, (None if row_weights is None else out_weights)


# --- the primitives -------------------------------------------------------------------------


def _dispatch_avals(x, experts, weights, *, axis_name, layout, fallback):
  del weights, axis_name, fallback
  T, k, P, C = x.shape[0], experts.shape[1], layout.P, layout.C
  n_local = layout.E // P
  sa, i32 = jax.core.ShapedArray, jnp.int32
  return [sa((P * C, layout.H), DTYPE), sa((P * C,), i32), sa((P * C,), jnp.float32),
          sa((P * C,), i32), sa((P, 1 + n_local), i32), sa((T, k), i32), sa((P,), i32),
          sa((P * C,), i32), sa((T, k), i32), sa((P,), i32), sa((P, n_local), i32)]


def _combine_avals(rows, row_weights, route_recv, counts_recv, pos, weights, extra, *, axis_name,
                   layout, out_dtype, fallback):
  del route_recv, counts_recv, weights, extra, axis_name, layout, fallback
  T, k = pos.shape
  sa = jax.core.ShapedArray
  return [sa((T, rows.shape[1]), out_dtype),
          sa((T if row_weights.shape[0] else 0, k), jnp.float32)]


def ep_groups(mesh, axis_name) -> tuple[tuple, ...] | None:
  """The EP groups of `mesh` along `axis_name`: the devices that differ only in their index on
  that axis, in axis order (rank r of a group is the device at index r, as
  jax.lax.axis_index numbers it); None for a mesh without devices (an AbstractMesh)."""
  if not isinstance(mesh, jax.sharding.Mesh) or axis_name not in mesh.axis_names:
    return None
  devices = np.asarray(mesh.devices)
  axis = tuple(mesh.axis_names).index(axis_name)
  groups = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
  return tuple(tuple(g) for g in groups)


def _workspace_handles(mesh, axis_name, layout: WorkspaceLayout) -> np.ndarray | None:
  """The workspace of each EP group of `mesh` (`ep_groups`) that holds a GPU of this process,
  created on first use (with the other processes of the group, for a group across
  processes); None for a mesh without devices; [NO_WORKSPACE] for a mesh without GPUs of
  this process (a program lowered for another machine: jax.export), which the handler
  reports if it runs."""
  groups = ep_groups(mesh, axis_name)
  if groups is None:
    return None
  if not _gpus_of_this_process(groups):
    return np.array([NO_WORKSPACE], np.int64)
  here = jax.process_index()
  return np.array([_workspace_for(g, layout.bytes) for g in groups
                   if any(d.process_index == here for d in g)], np.int64)


def _gpus_of_this_process(groups) -> bool:
  """Whether the groups are GPUs and some hold a GPU of this process (a process creates the
  workspaces of the groups that hold its GPUs, with the other processes of each group)."""
  here = jax.process_index()
  devices = [d for g in groups for d in g]
  return (all(d.platform == "gpu" for d in devices)
          and any(d.process_index == here for d in devices))


def _workspace_for(devices, nbytes) -> int:
  """The handle of the workspace of `devices` (in rank order) and `nbytes` a rank."""
  return Workspace.get(list(devices), nbytes).handle


def _lowering(target, by_collectives, custom_call=True):
  """The lowering of a call: the custom call with the workspaces of its mesh, or (no
  custom_call: XLA:CPU, which has none; or a fallback where the mesh has no devices) its
  results computed with XLA's collectives."""
  rule = jax.ffi.ffi_lowering(target)

  def lower(ctx, *operands, axis_name, layout, fallback, **params):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    try:
      handles = _workspace_handles(mesh, axis_name, layout) if custom_call else None
    except MemoryError as e:
      if not fallback:
        raise
      warnings.warn(f"mok_jax: Config(ep_transport='auto') moves the routed rows with XLA's "
                    f"collectives: {e}", stacklevel=2)
      handles = None
    fallback = fallback or not custom_call
    if handles is not None and (handles[0] != NO_WORKSPACE or not fallback):
      return rule(ctx, *operands, workspaces=handles,
                  layout=np.array(tuple(layout.offsets().values()), np.int64))
    if not fallback:
      raise ValueError(
          f"moe: Config(ep_transport='nvlink') needs the devices of the mesh over axis "
          f"{axis_name!r} when the program is lowered, to find the workspace of each EP group, "
          "and the shard_map's mesh has none (an AbstractMesh: explicitly sharded inputs "
          "outside jax.set_mesh, or jax.export). Lower under jax.set_mesh(mesh), give "
          "jax.shard_map a jax.sharding.Mesh, or use ep_transport='auto' (which then moves "
          "the rows with XLA's collectives) or 'collective'")
    impl = functools.partial(by_collectives, axis_name=axis_name, layout=layout, **params)
    return mlir.lower_fun(impl, multiple_results=True)(ctx, *operands)

  return lower


def _dispatch_by_collectives(x, experts, weights, *, axis_name, layout):
  """mok_ep_dispatch's results computed with XLA's collectives: expert_parallel.plan and
  exchange, the layout and values of the custom call (received rows past the counts: zeros)."""
  from mok_jax import expert_parallel  # imported late: it imports this module

  P, C, n_local = layout.P, layout.C, layout.E // layout.P
  T, k = experts.shape
  p = expert_parallel.plan(experts, n_local, P, C)
  recv = expert_parallel.exchange(p.sent, axis_name, P)
  move = functools.partial(expert_parallel.exchange, axis_name=axis_name, n_ranks=P,
                           sizes=(p.sent, recv))
  has, at = p.route >= 0, jnp.maximum(p.route, 0)
  ids = experts.reshape(-1)
  w = jnp.ones((T * k,), jnp.float32) if weights.shape[0] == 0 else weights.reshape(-1)
  local = jnp.where(has, ids[at] % n_local, -1)
  x_recv = move(jnp.where(has[:, None], x[at // k], jnp.zeros((), x.dtype)))
  hist = jnp.zeros((P, n_local), jnp.int32).at[
      jnp.where(has, jnp.arange(P * C) // C, P), jnp.maximum(local, 0)].add(1, mode="drop")
  counts = expert_parallel.exchange(jnp.concatenate([p.sent[:, None], hist], axis=1),
                                    axis_name, P)
  valid = (ids >= 0) & (ids < n_local * P)
  need = jnp.bincount(jnp.where(valid, ids // n_local, P), length=P + 1)[:P].astype(jnp.int32)
  pos = jnp.where(p.slot >= 0, jnp.arange(T * k, dtype=jnp.int32).reshape(T, k), -1)
  return [x_recv, move(local + 1) - 1, move(jnp.where(has, w[at], 0.0)), move(p.route + 1) - 1,
          counts, pos, need, p.route, p.slot, p.sent, hist]


def _combine_by_collectives(rows, row_weights, route_recv, counts_recv, pos, weights, extra, *,
                            axis_name, layout, out_dtype):
  """mok_ep_combine's results computed with XLA's collectives: each received row's output
  back to the send slot it came from (`exchange`), into its home slot t k + j, and
  mok_moe_combine's sum, the custom call's arithmetic."""
  from mok_jax import expert_parallel  # imported late: it imports this module

  P, (T, k), n = layout.P, pos.shape, rows.shape[0]
  got = counts_recv[:, 0]
  sent = expert_parallel.exchange(got, axis_name, P)
  back = functools.partial(expert_parallel.exchange, axis_name=axis_name, n_ranks=P,
                           sizes=(got, sent))
  route = back(route_recv + 1) - 1  # the home route of each send slot here, -1 when empty
  row = jnp.full((T * k,), n, jnp.int32).at[jnp.where(route >= 0, route, T * k)].set(
      jnp.arange(n, dtype=jnp.int32), mode="drop")  # the send slot of each route, n: none
  has, row = row < n, jnp.minimum(row, n - 1)
  slots = jnp.where(has[:, None], back(rows)[row], jnp.zeros((), rows.dtype))
  out = ops.moe_combine(slots, pos, None if weights.shape[0] == 0 else weights,
                        None if extra.shape[0] == 0 else extra, out_dtype=out_dtype)
  if row_weights.shape[0] == 0:
    return [out, jnp.zeros((0, k), jnp.float32)]
  returned = jnp.where(has, back(row_weights)[row], 0.0).reshape(T, k)
  return [out, jnp.where(pos >= 0, returned, 0.0)]


def _primitive(target, avals, by_collectives):
  p = jax.extend.core.Primitive(target)
  p.multiple_results = True
  p.def_abstract_eval(avals)
  # Outside jit (shard_map's eager mode binds inside a jit of its own) a call is compiled.
  p.def_impl(lambda *args, **params: jax.jit(functools.partial(p.bind, **params))(*args))
  mlir.register_lowering(p, _lowering(target, by_collectives), platform="cuda")
  # The layer asks for the NVLink transport on GPUs only (expert_parallel.transport); on
  # XLA:CPU the calls would be their collective form.
  mlir.register_lowering(p, _lowering(target, by_collectives, custom_call=False), platform="cpu")
  return p


_dispatch_p = _primitive("mok_ep_dispatch", _dispatch_avals, _dispatch_by_collectives)
_combine_p = _primitive("mok_ep_combine", _combine_avals, _combine_by_collectives)
