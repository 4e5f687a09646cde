"""The symmetric workspace of an expert-parallel group: `mok_jax.Workspace`.

The CUDA kernels' own transport (Config.ep_transport "nvlink", docs/expert_parallel.md) moves
the routed rows of `mok_jax.expert_parallel` with plain stores into the memory of the rank that
needs them. That memory is the workspace: one segment a rank, the same size and byte layout on
every rank, each segment reachable from every other rank's kernels. It is allocated by the CUDA
module (ffi/workspace_cuda.cc) outside XLA's memory, once per (devices, bytes), cached, and
freed when the process exits; across processes, each process allocates its own ranks'
segments and maps the others' through handles exchanged over jax.distributed's key-value
store: CUDA IPC handles within one host, fabric handles across the hosts of an NVLink domain.

Its byte layout (`Workspace.layout`) is computed here and only here; the kernels get the
offsets (cuda/ep_transport.h, EpLayout), and the CUDA side checks them against its shapes.
"""

from __future__ import annotations

import atexit
import json
import operator
import os
import socket
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


# How long a process waits for another process's step of a workspace across processes (its
# handles, its mappings, its closing) before it fails naming who and what it waited for.
EXCHANGE_TIMEOUT_MS = 120_000
# How long the exit handler waits for the other processes to unmap this process's segments
# before it leaves them to the process's teardown (the driver frees them then).
EXIT_TIMEOUT_MS = 10_000
KEY_PREFIX = "mok_jax/workspace"  # of the keys in jax.distributed's key-value store
# For tests: "1" in this environment variable makes a workspace across processes export fabric
# handles even where its processes are on one host (unset or "0": CUDA IPC there).
FABRIC_ENV = "MOK_JAX_WORKSPACE_FABRIC"


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

  Ranks on distinct GPUs of one process need peer access between every pair
  (cudaDeviceCanAccessPeer). Ranks of several processes (jax.distributed initialised) are
  built together by those processes (`_Exchange`): each says which host it is on, allocates
  its ranks' segments and exports a handle of each, the handles go through jax.distributed's
  key-value store, and each process maps the others' segments. The handles are CUDA IPC
  handles where every process is on one host, and fabric handles of memory pools
  (cudaMemHandleTypeFabric) where the processes span hosts, which map across the hosts of an
  NVLink domain (NVL72: the driver must support fabric handles and the processes need IMEX
  channels; a GPU that cannot export them fails the workspace on every process, saying what
  the driver reported). FABRIC_ENV=1 asks for fabric handles on one host too (tests). Every
  process of the group must create the same workspaces in the same order (lowering the same
  program does). Freeing one is collective too: each process unmaps the others' segments,
  says so through the store, and frees its own only once every other process has unmapped
  them.
  """

  _cache: dict[tuple[tuple[tuple[int, int], ...], int], "Workspace"] = {}
  _lock = threading.Lock()
  _atexit_registered = False
  _generations: dict[tuple[tuple[tuple[int, int], ...], int], int] = {}

  def __init__(self, handle: int, ranks: tuple[tuple[int, int], ...], nbytes: int,
               exchange: "_Exchange | None" = None):
    """Use `Workspace.get` or `Workspace.for_layer`: a workspace is created by the CUDA
    module and shared through the cache."""
    self._handle = handle
    self.processes = tuple(p for p, _ in ranks)  # JAX process index of each rank
    self.devices = tuple(d for _, d in ranks)  # CUDA ordinal of each rank's GPU, in its process
    self.nbytes = nbytes  # bytes of each rank's segment
    self._exchange = exchange  # the key-value store's keys of a workspace across processes

  def __repr__(self):
    state = "freed" if self._handle is None else f"handle={self._handle}"
    where = (f"devices={list(self.devices)}" if len(set(self.processes)) == 1 else
             f"ranks={list(zip(self.processes, self.devices))}")
    return f"Workspace({where}, nbytes={self.nbytes}, {state})"

  @property
  def _key(self):
    return (tuple(zip(self.processes, self.devices)), self.nbytes)

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
    jax.Device objects, CUDA ordinals of this process's GPUs, or (process index, CUDA ordinal)
    pairs), created on first use.

    The same GPU named P times gives P segments of one allocation on it (several ranks on one
    GPU, for tests); otherwise a process's GPUs must be distinct and reach each other's memory.
    Devices of several processes need jax.distributed initialised, and every process that
    holds one of them calls `get` for the same devices and size (it blocks until they have).
    """
    ranks = _ranks(devices)
    nbytes = _positive_int("nbytes", nbytes, "Workspace.get")
    key = (ranks, nbytes)
    with cls._lock:
      if key in cls._cache:
        return cls._cache[key]
      module = _cuda_module()
      if len({p for p, _ in ranks}) == 1:
        ordinals = [d for _, d in ranks]
        handle, status, message = module.workspace_create(ordinals, nbytes)
        _raise_for(status, message, nbytes, f"GPUs {ordinals}")
        ws = cls(handle, ranks, nbytes)
      else:
        generation = cls._generations.get(key, 0)
        cls._generations[key] = generation + 1
        exchange = _Exchange(_kv_client(), ranks, nbytes, generation, _this_process())
        ws = cls(exchange.create(module), ranks, nbytes, exchange)
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

  def free(self, *, timeout_ms: int | None = None) -> None:
    """Frees the segments now (waiting for the work on their GPUs); a no-op when freed.

    Across processes every process of the workspace must call it: this process unmaps the
    others' segments, then waits (at most `timeout_ms`, default EXCHANGE_TIMEOUT_MS) until
    every other process has unmapped its own before freeing them. Past the wait it raises
    RuntimeError and leaves its segments allocated (the process's teardown frees them).
    """
    with Workspace._lock:
      if self._handle is None:
        return
      Workspace._cache.pop(self._key, None)
      handle, self._handle = self._handle, None
    if self._exchange is None:
      _cuda_module().workspace_free(handle)
    else:
      self._exchange.release(_cuda_module(), handle,
                             EXCHANGE_TIMEOUT_MS if timeout_ms is None else timeout_ms)


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


def _raise_for(status: str, message: str, nbytes: int, where: str) -> None:
  """The error of a CUDA module's status other than "ok"."""
  if status == "ok":
    return
  if status == "out_of_memory":
    raise MemoryError(f"mok_jax.Workspace: could not allocate {nbytes} bytes "
                      f"({nbytes / 2**30:.2f} GiB) a rank on {where}: {message}. "
                      f"{_MEM_FRACTION_HINT}")
  if status == "bad_argument":
    raise ValueError(f"mok_jax.Workspace: {message}")
  raise RuntimeError(f"mok_jax.Workspace on {where}: {message}")


def _this_process() -> int:
  """This process's index: jax.distributed's process id where it runs (the process_index of
  its devices), else jax.process_index()."""
  import jax
  from jax._src import distributed

  if distributed.global_state.client is not None:
    return int(distributed.global_state.process_id)
  return jax.process_index()


def _kv_client():
  """jax.distributed's key-value store (its client), or a RuntimeError saying to initialise
  it."""
  from jax._src import distributed

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("mok_jax.Workspace: the devices belong to several processes, whose "
                       "workspace segments are exchanged through jax.distributed's key-value "
                       "store: call jax.distributed.initialize() first")
  return client


def _ranks(devices: Sequence[Any]) -> tuple[tuple[int, int], ...]:
  """(process index, CUDA ordinal) of each of `devices` (jax.Device objects, ints: ordinals of
  this process's GPUs, or such pairs), checked: in each process, all distinct or (one process)
  all one GPU."""
  where = "Workspace.get"
  if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__") or not len(devices):
    raise ValueError(f"{where}: devices must be a non-empty sequence of jax.Device objects, "
                     f"CUDA ordinals or (process, ordinal) pairs (the EP group's, in rank "
                     f"order), got {devices!r}")
  here = None
  ranks = []

  def integer(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

  for d in devices:
    if integer(d) or (isinstance(d, tuple) and len(d) == 2 and all(map(integer, d))):
      process, ordinal = (None, d) if integer(d) else d
      if ordinal < 0 or (process is not None and process < 0):
        raise ValueError(f"{where}: a CUDA ordinal and a process index must be at least 0, got "
                         f"{d}")
      if process is None:
        here = _this_process() if here is None else here
        process = here
      ranks.append((int(process), int(ordinal)))
      continue
    if not all(hasattr(d, a) for a in ("platform", "process_index", "local_hardware_id")):
      raise ValueError(f"{where}: {d!r} is neither a jax.Device nor a CUDA ordinal")
    if d.platform != "gpu":
      raise ValueError(f"{where}: {d!r} is a {d.platform} device; the workspace lives on CUDA "
                       "GPUs")
    ranks.append((int(d.process_index), int(operator.index(d.local_hardware_id))))
  processes = sorted({p for p, _ in ranks})
  if len(processes) == 1:
    ordinals = [o for _, o in ranks]
    if len(set(ordinals)) not in (1, len(ordinals)):
      raise ValueError(f"{where}: the ranks must be on distinct GPUs (one a GPU) or all on one "
                       f"GPU (segments of one allocation), got GPUs {ordinals}")
    return tuple(ranks)
  for p in processes:
    ordinals = [o for q, o in ranks if q == p]
    if len(set(ordinals)) != len(ordinals):
      raise ValueError(f"{where}: across processes each GPU holds one rank, got GPUs "
                       f"{ordinals} of process {p}")
  return tuple(ranks)


def _host_id() -> str:
  """What names this host to the other processes: CUDA IPC handles open only on the host
  that exported them."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
  except OSError:
    boot = ""
  return f"{socket.gethostname()}/{boot}"


def _handle_kind(hosts: dict[int, str]) -> tuple[str, str]:
  """The kind of handles ("ipc" or "fabric") of a workspace across processes on `hosts`
  (process index: `_host_id`), and why: CUDA IPC where every process is on one host, fabric
  handles where they span hosts or where FABRIC_ENV is "1"."""
  flag = os.environ.get(FABRIC_ENV, "")
  if flag not in ("", "0", "1"):
    raise ValueError(f"mok_jax.Workspace: {FABRIC_ENV} must be '1' (fabric handles on one host "
                     f"too), '0' or unset, got {flag!r}")
  if len(set(hosts.values())) > 1:
    where = ", ".join(f"process {p} on {h}" for p, h in sorted(hosts.items()))
    return "fabric", (f"the processes span {len(set(hosts.values()))} hosts ({where}), where "
                      "CUDA IPC handles do not map")
  if flag == "1":
    return "fabric", f"{FABRIC_ENV}=1 asks for them on one host"
  return "ipc", "every process is on one host"


class _Exchange:
  """The steps of a workspace across processes through jax.distributed's key-value store
  (`client`: key_value_set_bytes, blocking_key_value_get_bytes). Its keys, unique to the
  ranks, the bytes and the generation (how many workspaces of those ranks and bytes this
  process has created before: every process creates and frees them in the same order), are
  KEY_PREFIX/<ranks>/<nbytes>/<generation>/<step>/<process>, where <ranks> is
  "<process>.<ordinal>" of each rank joined by "_" and the steps are

      host    {"host"}: this process's `_host_id`, which picks the handles (`_handle_kind`)
      export  {"kind", "status", "message", "handles": {rank: hex of its exported bytes}}
      opened  {"status", "message"}: this process has mapped every other process's segments
      closed  {}: this process has unmapped them (its owner may free them)

  The exported bytes of a segment start with their kind, b"I" (CUDA IPC) or b"F" (fabric):
  the importer follows them (ffi/workspace_cuda.h).

  A process publishes each of its steps before it waits for the other processes' same step,
  so the steps of processes that run the same program never wait on each other in a cycle.
  """

  def __init__(self, client, ranks, nbytes: int, generation: int, here: int):
    self.client, self.ranks, self.nbytes, self.here = client, ranks, nbytes, here
    self.processes = sorted({p for p, _ in ranks})
    if here not in self.processes:
      raise ValueError(f"Workspace.get: none of the ranks {list(ranks)} is of this process "
                       f"({here}): a process creates the workspaces that hold its GPUs")
    tag = "_".join(f"{p}.{d}" for p, d in ranks)
    self.prefix = f"{KEY_PREFIX}/{tag}/{nbytes}/{generation}"

  def key(self, step: str, process: int) -> str:
    return f"{self.prefix}/{step}/{process}"

  def _publish(self, step: str, record: dict) -> None:
    self.client.key_value_set_bytes(self.key(step, self.here), json.dumps(record).encode())

  def _gather(self, step: str, timeout_ms: int) -> dict[int, dict]:
    """Every other process's record of `step`, waiting at most `timeout_ms` for each."""
    records = {}
    for p in self.processes:
      if p == self.here:
        continue
      key = self.key(step, p)
      try:
        records[p] = json.loads(self.client.blocking_key_value_get_bytes(key, timeout_ms))
      except Exception as e:  # noqa: BLE001 - the store's deadline error is XlaRuntimeError
        raise RuntimeError(
            f"mok_jax.Workspace: process {self.here} waited {timeout_ms / 1000:g} s for "
            f"process {p}'s '{step}' of the workspace of ranks {list(self.ranks)} "
            f"(key {key!r}) and got {type(e).__name__}: {e}. Every process that holds a rank "
            "must create (and free) the same workspaces in the same order: run the same "
            "program on every process") from e
    return records

  def create(self, module) -> int:
    """Learns every process's host, allocates and exports this process's segments with the
    handles that the hosts call for, exchanges the handles, maps the other processes'
    segments: the handle of the ready workspace."""
    P = len(self.ranks)
    local = [d if p == self.here else -1 for p, d in self.ranks]
    where = f"GPUs {[d for d in local if d >= 0]} of process {self.here}"
    host = _host_id()
    self._publish("host", {"host": host})
    hosts = {p: r["host"] for p, r in self._gather("host", EXCHANGE_TIMEOUT_MS).items()}
    try:
      kind, why = _handle_kind({**hosts, self.here: host})
    except ValueError as e:  # the other processes wait for this export: they fail with it
      self._publish("export", {"kind": None, "status": "bad_argument", "message": str(e),
                               "handles": {}})
      raise
    handle, status, message, exported = module.workspace_export(local, self.nbytes, kind)
    if status != "ok" and kind == "fabric":
      message = f"{message} (fabric handles: {why})"
    self._publish("export", {
        "kind": kind, "status": status, "message": message,
        "handles": {str(s): bytes(exported[s]).hex() for s in range(P) if local[s] >= 0}})
    try:
      _raise_for(status, message, self.nbytes, where)
      peers = self._gather("export", EXCHANGE_TIMEOUT_MS)
      for p, record in peers.items():
        if record["status"] != "ok":
          error = MemoryError if record["status"] == "out_of_memory" else RuntimeError
          raise error(f"mok_jax.Workspace: process {p} could not create its segments "
                             f"of the workspace of ranks {list(self.ranks)} "
                             f"({record['status']}): {record['message']}")
    except BaseException:
      # Nobody has mapped this process's segments: they are mapped only once every process
      # has published a good export.
      if handle:
        module.workspace_free(handle)
      raise
    imported = [b"" if local[s] >= 0 else
                bytes.fromhex(peers[p]["handles"][str(s)]) for s, (p, _) in
                enumerate(self.ranks)]
    status, message = module.workspace_import(handle, imported)
    self._publish("opened", {"status": status, "message": message})
    failures = [] if status == "ok" else [(self.here, status, message)]
    try:
      opened = self._gather("opened", EXCHANGE_TIMEOUT_MS)
    except RuntimeError:
      self.release(module, handle, EXCHANGE_TIMEOUT_MS)
      raise
    failures += [(p, r["status"], r["message"]) for p, r in opened.items() if r["status"] != "ok"]
    if failures:
      # Some process may have mapped these segments: free them only once it has unmapped.
      self.release(module, handle, EXCHANGE_TIMEOUT_MS)
      p, status, message = failures[0]
      if p == self.here:
        _raise_for(status, message, self.nbytes, where)
      raise RuntimeError(f"mok_jax.Workspace: process {p} could not map the segments of the "
                         f"workspace of ranks {list(self.ranks)} ({status}): {message}")
    return handle

  def release(self, module, handle: int, timeout_ms: int) -> None:
    """Unmaps the other processes' segments, says so, and frees this process's segments once
    every other process has said so; past `timeout_ms` they stay allocated (RuntimeError)."""
    module.workspace_close(handle)
    self._publish("closed", {})
    try:
      self._gather("closed", timeout_ms)
    except RuntimeError as e:
      raise RuntimeError(f"{e}. This process's segments stay allocated until it exits") from e
    module.workspace_free(handle)


def _free_all() -> None:
  """The exit handler: frees every workspace, in the reverse order of their creation (every
  process frees its workspaces across processes in the same order). It runs before
  jax.distributed shuts down (atexit runs handlers last registered first, and JAX registers its
  own when it is imported)."""
  for ws in reversed(list(Workspace._cache.values())):
    try:
      ws.free(timeout_ms=EXIT_TIMEOUT_MS)
    except Exception:  # noqa: BLE001 - the CUDA context may be gone (a trapped kernel) at exit,
      pass  # or a peer process: its segments go with the process's teardown
