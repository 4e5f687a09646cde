"""The symmetric workspace of an expert-parallel group: `mok_jax.Workspace`.

The CUDA kernels' own transport (Config.ep_transport "nvlink", docs/expert_parallel.md) moves
the routed rows of `mok_jax.expert_parallel` with plain stores into the memory of the rank that
needs them. That memory is the workspace: one segment a rank, the same size and byte layout on
every rank, each segment reachable from every other rank's kernels. It is allocated by the CUDA
module (ffi/workspace_cuda.cc) outside XLA's memory, once per (devices, bytes), cached, and
freed when the process exits.

Its byte layout (`Workspace.layout`) is computed here and only here; the kernels get the
offsets (cuda/ep_transport.h, EpLayout), and the CUDA side checks them against its shapes.
"""

from __future__ import annotations

import atexit
import operator
import threading
from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

ALIGN = 256  # every region starts at a multiple of this many bytes
# cuda/ep_transport.h, EpStage: a flag of each a peer. dispatch: a peer's rows are here;
# combine: an owner's outputs are in this rank's slots; dispatch_read, combine_read: a peer has
# read what this rank wrote into it, which this rank may then write again.
STAGES = ("dispatch", "combine", "dispatch_read", "combine_read")
SYNC_BYTES = 128  # the sync region: each call's epoch and each stage's completion counter (EpSync)
# In EpLayout's order (the `layout` attribute of the custom calls is offsets(), in this order).
REGIONS = ("recv_rows", "combine_slots", "recv_route", "recv_expert", "recv_weight",
           "combine_weight", "counts", "flags", "sync")

_MEM_FRACTION_HINT = (
    "JAX preallocates 75% of each GPU's memory when it starts (XLA_PYTHON_CLIENT_MEM_FRACTION, "
    "default 0.75): leave room for the workspace by setting XLA_PYTHON_CLIENT_MEM_FRACTION lower "
    "(for example 0.6) or XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX initialises its GPUs, "
    "or bound the receive rows with Config.ep_capacity")


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _positive_int(name: str, v, where: str) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
    raise ValueError(f"{where}: {name} must be an integer of at least 1, got {v!r}")
  return int(v)


class WorkspaceLayout(NamedTuple):
  """Byte offsets of one rank's regions in its segment (the same on every rank) and the
  dimensions they were computed for; `bytes` is the segment's size. See Workspace.layout."""

  T: int
  H: int
  k: int
  E: int
  P: int
  C: int
  itemsize: int
  recv_rows: int
  combine_slots: int
  recv_route: int
  recv_expert: int
  recv_weight: int
  combine_weight: int
  counts: int
  flags: int
  sync: int
  bytes: int

  def offsets(self) -> dict[str, int]:
    """The regions' offsets and the segment's bytes, by the field names of EpLayout, in its
    order."""
    return {name: getattr(self, name) for name in (*REGIONS, "bytes")}

  def sizes(self) -> dict[str, int]:
    """Bytes of each region (before the padding that aligns the next)."""
    rows, b = self.P * self.C, self.itemsize
    return {
        "recv_rows": rows * self.H * b,
        "combine_slots": self.T * self.k * self.H * b,
        "recv_route": 4 * rows,
        "recv_expert": 4 * rows,
        "recv_weight": 4 * rows,
        "combine_weight": 4 * self.T * self.k,
        "counts": 4 * self.P * (1 + self.E // self.P),
        "flags": 4 * len(STAGES) * self.P,
        "sync": SYNC_BYTES,
    }


class Workspace:
  """The symmetric workspace of one EP group: P segments of `nbytes`, one on each rank's GPU
  (or P segments of one allocation when all ranks are one GPU: the loopback tests), each rank's
  segment mapped into every other rank's address space.

  Layout of a segment (`layout`, `bytes_for`), for P ranks of T tokens each, k routes a token,
  E experts in all (E / P a rank), C send slots a (source, destination) block (`capacity`, at
  most T k; None: T k, dropless) and rows of H elements of b bytes (x's dtype):

      region         shape               dtype    role
      recv_rows      (P C, H)            x        block s: the rows rank s sent here, in (t, j)
      combine_slots  (T k, H)            x        slot t k + j: route (t, j)'s output, from its
                                                  owner
      recv_route     (P C,)              int32    home route t k + j of each received row
      recv_expert    (P C,)              int32    local expert of each received row
      recv_weight    (P C,)              f32      route weight of each received row
      combine_weight (T k,)              f32      slot t k + j: the f32 value sent back with
                                                  route (t, j)'s output (the backward's
                                                  dweights)
      counts         (P, 1 + E / P)      int32    [s, 0]: rows from rank s; [s, 1 + e]: of them
                                                  for local expert e
      flags          (4, P)              int32    [stage, s]: the round rank s last signalled
                                                  (STAGES)
      sync           128 bytes           int32    this rank's epoch of each call (dispatch,
                                                  combine) and completion counters

  in this order, each starting at a multiple of ALIGN = 256 bytes, the whole rounded up to
  ALIGN. Without the padding:

      bytes_for = (P C + T k) H b + 12 P C + 4 T k + 4 P (5 + E / P) + 128

  The receive rows dominate: dropless (C = T k) they are P T k H b bytes a rank, as the
  collective transport's receive buffer is; Config.ep_capacity bounds them.

  The workspace lives outside XLA's memory. JAX preallocates 75% of each GPU by default, so
  the rest must hold it: see XLA_PYTHON_CLIENT_MEM_FRACTION (an allocation failure says so).
  Every segment is zeroed once when created; afterwards only the transport kernels write it,
  and they keep their epochs there, so CUDA-graph replays and back-to-back calls on one
  workspace stay correct. Lifetime: `get` caches one workspace per (devices in rank order,
  nbytes) for the life of the process, and all are freed at exit; `free` releases one sooner
  (only once no computation that uses it can still run).

  One process driving its GPUs is supported: ranks on distinct GPUs need peer access between
  every pair (cudaDeviceCanAccessPeer). Ranks in several processes (CUDA IPC handles on one
  host, fabric handles on an NVL72) raise NotImplementedError.
  """

  _cache: dict[tuple[tuple[int, ...], int], "Workspace"] = {}
  _lock = threading.Lock()
  _atexit_registered = False

  def __init__(self, handle: int, devices: tuple[int, ...], nbytes: int):
    """Use `Workspace.get` or `Workspace.for_layer`: a workspace is created by the CUDA
    module and shared through the cache."""
    self._handle = handle
    self.devices = devices  # CUDA ordinal of each rank's GPU, in rank order
    self.nbytes = nbytes  # bytes of each rank's segment

  def __repr__(self):
    state = "freed" if self._handle is None else f"handle={self._handle}"
    return f"Workspace(devices={list(self.devices)}, nbytes={self.nbytes}, {state})"

  @property
  def ranks(self) -> int:
    return len(self.devices)

  @property
  def handle(self) -> int:
    """The integer that names this workspace to the CUDA module (an FFI attribute)."""
    if self._handle is None:
      raise RuntimeError(f"{self!r} has been freed")
    return self._handle

  @staticmethod
  def layout(T: int, H: int, k: int, E: int, P: int, capacity: int | None = None,
             dtype: Any = jnp.bfloat16) -> WorkspaceLayout:
    """The byte layout of a rank's segment for these dimensions (see the class docstring).

    T tokens a rank, H the model width, k routes a token, E experts in all (a multiple of P),
    P ranks, capacity: None (C = T k) or the most rows one rank sends another (C =
    min(capacity, T k), as Config.ep_capacity), dtype: x's.
    """
    return _layout("Workspace.layout", T, H, k, E, P, capacity, dtype)

  @staticmethod
  def bytes_for(T: int, H: int, k: int, E: int, P: int, capacity: int | None = None,
                dtype: Any = jnp.bfloat16) -> int:
    """Bytes of each rank's segment: `layout(...).bytes` (the class docstring has the
    formula)."""
    return _layout("Workspace.bytes_for", T, H, k, E, P, capacity, dtype).bytes

  @classmethod
  def get(cls, devices: Sequence[Any], nbytes: int) -> "Workspace":
    """The workspace of `nbytes` a rank over `devices` (the EP group's devices in rank order:
    jax.Device objects of this process's GPUs, or CUDA ordinals), created on first use.

    The same GPU named P times gives P segments of one allocation on it (several ranks on one
    GPU, for tests); otherwise the GPUs must be distinct and reach each other's memory.
    """
    ordinals = _ordinals(devices)
    nbytes = _positive_int("nbytes", nbytes, "Workspace.get")
    key = (ordinals, nbytes)
    with cls._lock:
      if key in cls._cache:
        return cls._cache[key]
      module = _cuda_module()
      handle, status, message = module.workspace_create(list(ordinals), nbytes)
      if status == "out_of_memory":
        raise MemoryError(f"mok_jax.Workspace: could not allocate {nbytes} bytes "
                          f"({nbytes / 2**30:.2f} GiB) a rank on GPUs {list(ordinals)}: "
                          f"{message}. {_MEM_FRACTION_HINT}")
      if status == "bad_argument":
        raise ValueError(f"mok_jax.Workspace: {message}")
      if status != "ok":
        raise RuntimeError(f"mok_jax.Workspace on GPUs {list(ordinals)}: {message}")
      ws = cls(handle, ordinals, nbytes)
      cls._cache[key] = ws
      if not cls._atexit_registered:
        atexit.register(_free_all)
        cls._atexit_registered = True
      return ws

  @classmethod
  def for_layer(cls, devices: Sequence[Any], T: int, H: int, k: int, E: int,
                capacity: int | None = None, dtype: Any = jnp.bfloat16) -> "Workspace":
    """`get(devices, bytes_for(T, H, k, E, len(devices), capacity, dtype))`."""
    return cls.get(devices, cls.bytes_for(T, H, k, E, len(devices), capacity, dtype))

  def info(self) -> dict:
    """What the CUDA module holds for it: bytes, the distance between segments on one GPU
    (stride), and each rank's device, segment base and device table of peers (addresses)."""
    return _cuda_module().workspace_info(self.handle)

  def free(self) -> None:
    """Frees the segments now (waiting for the work on their GPUs); a no-op when freed."""
    with Workspace._lock:
      if self._handle is None:
        return
      Workspace._cache.pop((self.devices, self.nbytes), None)
      handle, self._handle = self._handle, None
    _cuda_module().workspace_free(handle)


def _layout(where, T, H, k, E, P, capacity, dtype) -> WorkspaceLayout:
  T, H, k, E, P = (_positive_int(n, v, where) for n, v in
                   (("T", T), ("H", H), ("k", k), ("E", E), ("P", P)))
  if E % P:
    raise ValueError(f"{where}: E = {E} experts do not split over P = {P} ranks "
                     "(E must be a multiple of P)")
  # C as mok_jax.expert_parallel.capacity computes it from Config.ep_capacity.
  C = T * k if capacity is None else min(_positive_int("capacity", capacity, where), T * k)
  try:
    itemsize = np.dtype(dtype).itemsize
  except TypeError as e:
    raise ValueError(f"{where}: dtype {dtype!r} is not a dtype") from e
  if H * itemsize % 16:
    raise ValueError(f"{where}: a row of H = {H} elements of {itemsize} bytes is "
                     f"{H * itemsize} bytes, not a multiple of 16 (the transport moves rows in "
                     "16-byte stores)")
  dims = dict(T=T, H=H, k=k, E=E, P=P, C=C, itemsize=itemsize)
  sizes = WorkspaceLayout(**dims, **{r: 0 for r in REGIONS}, bytes=0).sizes()
  at, offsets = 0, {}
  for region in REGIONS:
    offsets[region] = at
    at = _round_up(at + sizes[region], ALIGN)
  return WorkspaceLayout(**dims, **offsets, bytes=at)


def _cuda_module():
  from mok_jax import ops  # imported late: ops imports JAX and registers the FFI targets

  if ops._mok_cuda is None:
    raise RuntimeError("mok_jax.Workspace needs the CUDA module mok_jax._mok_cuda, which this "
                       "build of mok_jax lacks (built without a CUDA compiler, or with "
                       "MOK_CUDA=OFF); the symmetric workspace exists only on CUDA GPUs")
  return ops._mok_cuda


def _ordinals(devices: Sequence[Any]) -> tuple[int, ...]:
  """CUDA ordinals of `devices` (jax.Device objects or ints), checked: this process's GPUs,
  all distinct or all one GPU."""
  where = "Workspace.get"
  if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__") or not len(devices):
    raise ValueError(f"{where}: devices must be a non-empty sequence of jax.Device objects or "
                     f"CUDA ordinals (the EP group's, in rank order), got {devices!r}")
  import jax

  process = None
  ordinals = []
  for d in devices:
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
      if d < 0:
        raise ValueError(f"{where}: a CUDA ordinal must be at least 0, got {d}")
      ordinals.append(int(d))
      continue
    if not all(hasattr(d, a) for a in ("platform", "process_index", "local_hardware_id")):
      raise ValueError(f"{where}: {d!r} is neither a jax.Device nor a CUDA ordinal")
    if process is None:
      process = jax.process_index()
    if d.process_index != process:
      raise NotImplementedError(
          f"{where}: {d!r} belongs to process {d.process_index}, not this one ({process}): a "
          "workspace across processes needs CUDA IPC memory handles (cudaIpcGetMemHandle, or "
          "cuMem POSIX file descriptors) between processes of one host, or fabric handles "
          "(CU_MEM_HANDLE_TYPE_FABRIC) across an NVLink domain, exchanged through "
          "jax.distributed's key-value store; mok_jax does not implement them yet. Within one "
          "process, pass this process's GPUs")
    if d.platform != "gpu":
      raise ValueError(f"{where}: {d!r} is a {d.platform} device; the workspace lives on CUDA "
                       "GPUs")
    ordinals.append(int(operator.index(d.local_hardware_id)))
  if len(set(ordinals)) not in (1, len(ordinals)):
    raise ValueError(f"{where}: the ranks must be on distinct GPUs (one a GPU) or all on one "
                     f"GPU (segments of one allocation), got GPUs {ordinals}")
  return tuple(ordinals)


def _free_all() -> None:
  for ws in list(Workspace._cache.values()):
    try:
      ws.free()
    except Exception:  # noqa: BLE001 - the CUDA context may be gone (a trapped kernel) at exit
      pass
