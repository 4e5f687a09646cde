"""mok_jax.Workspace on any machine: the byte layout and its size formula (real values), the
argument checks and their messages, the errors of a build without the CUDA module, and the
layout's agreement with the kernels' header (cuda/ep_transport.h). The allocations themselves
are tested on a GPU (tests/test_ep_transport_cuda.py)."""

from __future__ import annotations

import json
import pathlib
import re
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import ops, workspace
from mok_jax.workspace import ALIGN, REGIONS, STAGES, SYNC_BYTES, Workspace

ROOT = pathlib.Path(__file__).resolve().parents[1]
EP_TRANSPORT_H = (ROOT / "cuda" / "ep_transport.h").read_text()


def formula(T, H, k, E, P, C, b):
  """The docstring's formula without the alignment padding."""
  return (P * C + T * k) * H * b + 12 * P * C + 4 * T * k + 4 * P * (5 + E // P) + SYNC_BYTES


def test_exported():
  assert mok_jax.Workspace is Workspace
  assert "Workspace" in mok_jax.__all__


def test_small_layout_by_hand():
  # T=4, H=8, k=2, E=4, P=2, dropless: C = 8; rows of 16 bytes.
  lay = Workspace.layout(4, 8, 2, 4, 2)
  assert (lay.C, lay.itemsize) == (8, 2)
  # recv_rows 2*8*16 = 256 B; combine_slots 4*2*16 = 128; recv_route, recv_expert, recv_weight
  # 64 each; combine_weight 4*2*4 = 32; counts 2*3*4 = 24; flags 4*2*4 = 32; sync 128: each
  # padded to 256.
  assert lay.offsets() == dict(recv_rows=0, combine_slots=256, recv_route=512, recv_expert=768,
                               recv_weight=1024, combine_weight=1280, counts=1536, flags=1792,
                               sync=2048, bytes=2304)
  assert Workspace.bytes_for(4, 8, 2, 4, 2) == 2304


def test_dsv3_layout():
  # dsv3 over 8 ranks, dropless: T = 4096 a rank, H = 7168, k = 8, E = 256.
  assert Workspace.bytes_for(4096, 7168, 8, 256, 8) == 4_231_137_024
  lay = Workspace.layout(4096, 7168, 8, 256, 8)
  assert lay.C == 4096 * 8
  assert lay.combine_slots == 8 * 32768 * 7168 * 2  # right after the receive rows
  assert lay.sizes()["counts"] == 4 * 8 * 33


@pytest.mark.parametrize("T,H,k,E,P,capacity,dtype", [
    (1, 8, 1, 1, 1, None, jnp.bfloat16),
    (300, 320, 4, 16, 4, None, jnp.bfloat16),
    (300, 320, 4, 16, 4, 100, jnp.bfloat16),
    (300, 320, 4, 16, 4, 10_000, jnp.bfloat16),
    (64, 256, 8, 64, 8, 33, jnp.float32),
    (16384, 2048, 8, 128, 8, 4096, jnp.bfloat16),
])
def test_layout_regions(T, H, k, E, P, capacity, dtype):
  lay = Workspace.layout(T, H, k, E, P, capacity, dtype)
  C = T * k if capacity is None else min(capacity, T * k)
  b = np.dtype(dtype).itemsize
  assert (lay.C, lay.itemsize) == (C, b)
  offsets, sizes = lay.offsets(), lay.sizes()
  assert [offsets[r] for r in REGIONS] == sorted(offsets[r] for r in REGIONS)
  for region, nxt in zip(REGIONS, (*REGIONS[1:], "bytes")):
    assert offsets[region] % ALIGN == 0
    # Each region ends before the next begins, padded by less than ALIGN.
    assert 0 <= offsets[nxt] - (offsets[region] + sizes[region]) < ALIGN
  assert lay.bytes % ALIGN == 0
  assert 0 <= lay.bytes - formula(T, H, k, E, P, C, b) < ALIGN * len(REGIONS)
  assert Workspace.bytes_for(T, H, k, E, P, capacity, dtype) == lay.bytes


def test_capacity_bounds_the_receive_rows():
  dropless = Workspace.layout(1024, 1024, 8, 64, 8)
  bounded = Workspace.layout(1024, 1024, 8, 64, 8, capacity=512)
  assert dropless.sizes()["recv_rows"] == 8 * 8192 * 1024 * 2
  assert bounded.sizes()["recv_rows"] == 8 * 512 * 1024 * 2
  assert dropless.sizes()["combine_slots"] == bounded.sizes()["combine_slots"]


# (id, arguments of Workspace.layout, regex of the ValueError)
BAD_LAYOUTS = [
    ("T0", (0, 8, 2, 4, 2), r"Workspace.layout: T must be an integer of at least 1, got 0"),
    ("H_float", (4, 8.0, 2, 4, 2), r"H must be an integer of at least 1, got 8.0"),
    ("k_bool", (4, 8, True, 4, 2), r"k must be an integer of at least 1, got True"),
    ("E_negative", (4, 8, 2, -4, 2), r"E must be an integer of at least 1, got -4"),
    ("P0", (4, 8, 2, 4, 0), r"P must be an integer of at least 1, got 0"),
    ("E_not_multiple", (4, 8, 2, 10, 4),
     r"E = 10 experts do not split over P = 4 ranks \(E must be a multiple of P\)"),
    ("capacity0", (4, 8, 2, 4, 2, 0), r"capacity must be an integer of at least 1, got 0"),
    ("capacity_bool", (4, 8, 2, 4, 2, True), r"capacity must be an integer of at least 1"),
    ("row_not_16_bytes", (4, 4, 2, 4, 2),
     r"a row of H = 4 elements of 2 bytes is 8 bytes, not a multiple of 16"),
    ("f32_row", (4, 2, 2, 4, 2, None, jnp.float32), r"H = 2 elements of 4 bytes is 8 bytes"),
    ("not_a_dtype", (4, 8, 2, 4, 2, None, "no such dtype"), r"dtype 'no such dtype' is not a"),
]


@pytest.mark.parametrize("args,match", [b[1:] for b in BAD_LAYOUTS], ids=[b[0] for b in BAD_LAYOUTS])
def test_bad_layout_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    Workspace.layout(*args)
  with pytest.raises(ValueError, match=match.replace("Workspace.layout", "Workspace.bytes_for")):
    Workspace.bytes_for(*args)


def _fake_device(process_index=0, platform="gpu", local_hardware_id=0):
  return types.SimpleNamespace(process_index=process_index, platform=platform,
                               local_hardware_id=local_hardware_id)


# (id, devices, nbytes, exception, regex): checked before any CUDA call, on every build.
BAD_GETS = [
    ("no_devices", [], 1024, ValueError, r"devices must be a non-empty sequence"),
    ("a_string", "gpu", 1024, ValueError, r"devices must be a non-empty sequence"),
    ("negative_ordinal", [0, -1], 1024, ValueError, r"a CUDA ordinal and a process index must be at least 0, got -1"),
    ("not_a_device", [0, object()], 1024, ValueError, r"is neither a jax.Device nor a CUDA"),
    ("mixed", [0, 0, 1], 1024, ValueError,
     r"distinct GPUs \(one a GPU\) or all on one GPU .*got GPUs \[0, 0, 1\]"),
    ("nbytes0", [0, 0], 0, ValueError, r"Workspace.get: nbytes must be an integer of at least 1"),
    ("negative_process", [(0, 0), (-1, 0)], 1024, ValueError,
     r"a CUDA ordinal and a process index must be at least 0, got \(-1, 0\)"),
    ("two_ranks_one_gpu_across_processes", [(0, 0), (0, 0), (1, 0)], 1024, ValueError,
     r"across processes each GPU holds one rank, got GPUs \[0, 0\] of process 0"),
    ("tpu", [_fake_device(platform="tpu")], 1024, ValueError,
     r"is a tpu device; the workspace lives on CUDA GPUs"),
]


@pytest.mark.parametrize("devices,nbytes,exc,match", [b[1:] for b in BAD_GETS],
                         ids=[b[0] for b in BAD_GETS])
def test_bad_get_arguments(devices, nbytes, exc, match):
  with pytest.raises(exc, match=match):
    Workspace.get(devices, nbytes)


def test_cpu_devices_are_refused():
  with pytest.raises(ValueError, match=r"CpuDevice\(id=0\) is a cpu device"):
    Workspace.get(jax.devices("cpu")[:2], 1024)


def test_without_the_cuda_module_creation_says_so(monkeypatch):
  monkeypatch.setattr(ops, "_mok_cuda", None)
  with pytest.raises(RuntimeError, match=r"needs the CUDA module mok_jax._mok_cuda, which this "
                     r"build of mok_jax lacks"):
    Workspace.get([0, 0], Workspace.bytes_for(4, 8, 2, 4, 2))
  with pytest.raises(RuntimeError, match=r"needs the CUDA module"):
    Workspace.for_layer([0], 4, 8, 2, 4)
  assert not Workspace._cache


def test_allocation_failure_names_bytes_and_mem_fraction(monkeypatch):
  """The CUDA module's out-of-memory answer becomes a MemoryError naming the bytes and
  XLA_PYTHON_CLIENT_MEM_FRACTION (a stand-in module: no GPU needed)."""
  calls = []

  def workspace_create(devices, nbytes):
    calls.append((devices, nbytes))
    return 0, "out_of_memory", ("cudaMalloc of 4294967296 bytes on GPU 0 failed: out of memory "
                                "(1024 of 85899345920 bytes free)")

  monkeypatch.setattr(ops, "_mok_cuda", types.SimpleNamespace(workspace_create=workspace_create))
  with pytest.raises(MemoryError, match=r"could not allocate 4294967296 bytes \(4.00 GiB\) a rank "
                     r"on GPUs \[0, 0\].*out of memory.*XLA_PYTHON_CLIENT_MEM_FRACTION"):
    Workspace.get([0, 0], 2**32)
  assert calls == [([0, 0], 2**32)]
  assert not Workspace._cache


@pytest.mark.parametrize("status,exc", [("no_peer_access", RuntimeError),
                                        ("cuda_error", RuntimeError),
                                        ("bad_argument", ValueError)])
def test_other_creation_failures(monkeypatch, status, exc):
  message = "GPU 0 cannot access the memory of GPU 1 (cudaDeviceCanAccessPeer = 0)"
  monkeypatch.setattr(ops, "_mok_cuda", types.SimpleNamespace(
      workspace_create=lambda devices, nbytes: (0, status, message)))
  with pytest.raises(exc, match=re.escape(message)):
    Workspace.get([0, 1], 4096)
  assert not Workspace._cache


def test_cache_and_free_with_a_stand_in_module(monkeypatch):
  """One workspace per (ordinals, bytes); free releases the handle once and drops it from the
  cache (the stand-in records what the CUDA module would be asked)."""
  created, freed = [], []

  def workspace_create(devices, nbytes):
    created.append((tuple(devices), nbytes))
    return len(created), "ok", ""

  monkeypatch.setattr(ops, "_mok_cuda", types.SimpleNamespace(
      workspace_create=workspace_create, workspace_free=freed.append))
  monkeypatch.setattr(Workspace, "_cache", {})
  a = Workspace.get([0, 0], 4096)
  assert Workspace.get((0, 0), 4096) is a
  assert Workspace.get([_fake_device(), _fake_device()], 4096) is a  # jax devices by ordinal
  b = Workspace.for_layer([0, 0], 4, 8, 2, 4)
  assert b is not a and b.nbytes == Workspace.bytes_for(4, 8, 2, 4, 2)
  assert (a.ranks, a.devices, a.handle) == (2, (0, 0), 1)
  assert created == [((0, 0), 4096), ((0, 0), 2304)]
  a.free()
  a.free()
  assert freed == [1]
  with pytest.raises(RuntimeError, match=r"has been freed"):
    a.handle
  assert Workspace.get([0, 0], 4096) is not a
  workspace._free_all()
  assert sorted(freed) == [1, 2, 3] and not Workspace._cache


def _header_constant(name: str) -> str:
  m = re.search(rf"constexpr \w+ {name} = ([^;]+);", EP_TRANSPORT_H)
  assert m, f"cuda/ep_transport.h defines no {name}"
  return m.group(1).replace("'", "")


def test_layout_matches_the_kernels_header():
  """EpLayout names the regions in Python's order, EpStage the stages, kEpSyncBytes the sync
  region's size: the two languages describe one layout."""
  body = EP_TRANSPORT_H[EP_TRANSPORT_H.index("struct EpLayout {"):]
  body = body[:body.index("\n};")]
  assert tuple(re.findall(r"^\s*int64_t (\w+);", body, re.M)) == (*REGIONS, "bytes")
  stages = re.search(r"enum EpStage : int32_t \{([^}]*)\}", EP_TRANSPORT_H).group(1)
  camel = [s.title().replace("_", "") for s in STAGES]
  assert re.findall(r"kEp(\w+) = \d+", stages) == [*camel, "Stages"]
  assert int(_header_constant("kEpSyncBytes")) == SYNC_BYTES
  assert int(_header_constant("kEpLayoutFields")) == len(REGIONS) + 1


@pytest.mark.skipif(ops._mok_cuda is None, reason="built without the CUDA module")
def test_layout_matches_the_cuda_module():
  c = ops._mok_cuda.ep_transport_constants()
  assert c["stages"] == len(STAGES) and c["sync_bytes"] == SYNC_BYTES
  assert c["layout_fields"] == len(REGIONS) + 1
  assert c["wait_bound_ns"] == 10_000_000_000


# --- across processes: the exchange through a stand-in key-value store ----------------------


class FakeStore:
  """jax.distributed's key-value store as the workspace uses it: a key is set once, a blocking
  get waits for it (at most its timeout, then raises as the store's deadline does)."""

  def __init__(self):
    self.values, self.cond = {}, threading.Condition()

  def key_value_set_bytes(self, key, value, allow_overwrite=False):
    with self.cond:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = bytes(value)
      self.cond.notify_all()

  def blocking_key_value_get_bytes(self, key, timeout_in_ms):
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]


# What the CUDA module says of a GPU that cannot export fabric handles (ffi/workspace_cuda.cc).
NO_FABRIC = ("GPU 0's driver reports the memory-pool handle types 0x1 "
             "(cudaDevAttrMemoryPoolSupportedHandleTypes), without fabric handles "
             "(cudaMemHandleTypeFabric = 0x8). Fabric handles need GPUs of one NVLink domain ... "
             "Use ep_transport='collective', or EP groups within one host (CUDA IPC)")


def exported(kind, process, rank):
  """The stand-in's exported bytes of a segment: the kind byte and the handle's size of
  ffi/workspace_cuda.h, naming the process and rank."""
  if kind == "ipc":
    return b"I" + f"ipc p{process} r{rank}".encode().ljust(64, b".")
  return b"F" + f"fabric p{process} r{rank}".encode().ljust(128, b".")


class FakeCudaModule:
  """The CUDA module's workspace functions of one process, recording each call in `log`
  (shared by the processes of a test, in the order the calls happen). `fabric`: False for a
  GPU that cannot export fabric handles (status not_supported)."""

  def __init__(self, process, log, export_status="ok", import_status="ok", fabric=True):
    self.process, self.log = process, log
    self.export_status, self.import_status = export_status, import_status
    self.fabric = fabric
    self.imported = None

  def workspace_export(self, devices, nbytes, kind):
    assert kind in ("ipc", "fabric"), kind
    self.log.append(("export", self.process, tuple(devices), nbytes, kind))
    if self.export_status != "ok":
      return 0, self.export_status, f"export failed on process {self.process}", [b""] * len(devices)
    if kind == "fabric" and not self.fabric:
      return 0, "not_supported", NO_FABRIC, [b""] * len(devices)
    return 10 + self.process, "ok", "", [
        exported(kind, self.process, s) if d >= 0 else b"" for s, d in enumerate(devices)]

  def workspace_import(self, handle, handles):
    self.log.append(("import", self.process, handle))
    self.imported = list(handles)
    if self.import_status != "ok":
      return self.import_status, f"cudaIpcOpenMemHandle failed on process {self.process}"
    return "ok", ""

  def workspace_close(self, handle):
    self.log.append(("close", self.process, handle))
    return True

  def workspace_free(self, handle):
    self.log.append(("free", self.process, handle))
    return True


RANKS = ((0, 0), (1, 0))  # two processes, each on its GPU 0


def _run_processes(store, modules, ranks=RANKS, nbytes=4096, generation=0, hosts=None, steps=2):
  """Process p's _Exchange.create (then release, for steps=2) in a thread each, process p on
  host hosts[p] (default: all on this host); the handle or the exception of each process."""
  results = {}
  if hosts is not None:
    host_of = {f"process {p}": h for p, h in hosts.items()}
    host_id = lambda: host_of[threading.current_thread().name]  # noqa: E731
  else:
    host_id = workspace._host_id

  def run(p):
    ex = workspace._Exchange(store, ranks, nbytes, generation, p)
    try:
      handle = ex.create(modules[p])
      if steps == 2:
        ex.release(modules[p], handle, 5_000)
      results[p] = handle
    except Exception as e:  # noqa: BLE001 - the test looks at it
      results[p] = e

  threads = [threading.Thread(target=run, args=(p,), name=f"process {p}") for p in sorted(modules)]
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(workspace, "_host_id", host_id)
    for t in threads:
      t.start()
    for t in threads:
      t.join(30)
  assert not any(t.is_alive() for t in threads)
  return results


@pytest.fixture
def short_waits(monkeypatch):
  monkeypatch.setattr(workspace, "EXCHANGE_TIMEOUT_MS", 2_000)


def test_exchange_maps_each_others_handles_and_frees_after_every_close(short_waits):
  store, log = FakeStore(), []
  modules = {p: FakeCudaModule(p, log) for p in (0, 1)}
  results = _run_processes(store, modules)
  assert results == {0: 10, 1: 11}
  # Each process exported its own rank (-1 for the other's) as CUDA IPC handles (one host) and
  # imported the other's handle.
  assert sorted(e for e in log if e[0] == "export") == [
      ("export", 0, (0, -1), 4096, "ipc"), ("export", 1, (-1, 0), 4096, "ipc")]
  assert modules[0].imported == [b"", exported("ipc", 1, 1)]
  assert modules[1].imported == [exported("ipc", 0, 0), b""]
  # No process frees its segment before every process has closed its mappings.
  last_close = max(i for i, e in enumerate(log) if e[0] == "close")
  assert all(i > last_close for i, e in enumerate(log) if e[0] == "free")
  assert sorted(e[1] for e in log if e[0] == "free") == [0, 1]
  prefix = "mok_jax/workspace/0.0_1.0/4096/0"
  assert sorted(store.values) == sorted(f"{prefix}/{step}/{p}" for step in
                                        ("host", "export", "opened", "closed") for p in (0, 1))
  assert json.loads(store.values[f"{prefix}/host/1"]) == {"host": workspace._host_id()}
  record = json.loads(store.values[f"{prefix}/export/1"])
  assert record["status"] == "ok" and record["kind"] == "ipc"
  assert bytes.fromhex(record["handles"]["1"]) == exported("ipc", 1, 1)


def test_exchange_across_hosts_exports_fabric_handles(short_waits):
  store, log = FakeStore(), []
  modules = {p: FakeCudaModule(p, log) for p in (0, 1)}
  results = _run_processes(store, modules, hosts={0: "node-a/boot-a", 1: "node-b/boot-b"})
  assert results == {0: 10, 1: 11}
  assert sorted(e for e in log if e[0] == "export") == [
      ("export", 0, (0, -1), 4096, "fabric"), ("export", 1, (-1, 0), 4096, "fabric")]
  assert modules[0].imported == [b"", exported("fabric", 1, 1)]
  assert modules[1].imported == [exported("fabric", 0, 0), b""]
  prefix = "mok_jax/workspace/0.0_1.0/4096/0"
  assert json.loads(store.values[f"{prefix}/host/1"]) == {"host": "node-b/boot-b"}
  assert json.loads(store.values[f"{prefix}/export/0"])["kind"] == "fabric"
  # Freed in order, as with CUDA IPC handles.
  last_close = max(i for i, e in enumerate(log) if e[0] == "close")
  assert all(i > last_close for i, e in enumerate(log) if e[0] == "free")


def test_exchange_three_processes_two_hosts_all_take_fabric(short_waits):
  """One process on another host makes every process export fabric handles, those of one host
  too (one kind for the workspace)."""
  store, log = FakeStore(), []
  ranks = ((0, 0), (1, 0), (2, 0))
  modules = {p: FakeCudaModule(p, log) for p in (0, 1, 2)}
  results = _run_processes(store, modules, ranks=ranks,
                           hosts={0: "node-a/x", 1: "node-a/x", 2: "node-b/y"})
  assert results == {0: 10, 1: 11, 2: 12}
  assert sorted(e[4] for e in log if e[0] == "export") == ["fabric"] * 3
  assert modules[1].imported == [exported("fabric", 0, 0), b"", exported("fabric", 2, 2)]


@pytest.mark.parametrize("flag,kind", [("1", "fabric"), ("0", "ipc"), ("", "ipc")])
def test_exchange_fabric_env_on_one_host(short_waits, monkeypatch, flag, kind):
  monkeypatch.setenv(workspace.FABRIC_ENV, flag)
  store, log = FakeStore(), []
  modules = {p: FakeCudaModule(p, log) for p in (0, 1)}
  assert _run_processes(store, modules) == {0: 10, 1: 11}
  assert sorted(e[4] for e in log if e[0] == "export") == [kind, kind]
  assert modules[0].imported == [b"", exported(kind, 1, 1)]


def test_exchange_a_bad_fabric_env_fails_every_process(short_waits, monkeypatch):
  monkeypatch.setenv(workspace.FABRIC_ENV, "yes")
  store, log = FakeStore(), []
  modules = {p: FakeCudaModule(p, log) for p in (0, 1)}
  results = _run_processes(store, modules, steps=1)
  for p in (0, 1):
    assert isinstance(results[p], (ValueError, RuntimeError)), results[p]
    assert re.search(r"MOK_JAX_WORKSPACE_FABRIC must be '1' .*, '0' or unset, got 'yes'",
                     str(results[p]))
  assert not log  # nothing allocated


def test_exchange_across_hosts_a_gpu_without_fabric_fails_every_process(short_waits):
  """A process whose GPU cannot export fabric handles fails, and so does the other (what the
  driver reported, what to do, and why fabric handles were needed); nothing is imported."""
  store, log = FakeStore(), []
  modules = {0: FakeCudaModule(0, log), 1: FakeCudaModule(1, log, fabric=False)}
  results = _run_processes(store, modules, hosts={0: "node-a/boot-a", 1: "node-b/boot-b"},
                           steps=1)
  assert isinstance(results[1], RuntimeError) and isinstance(results[0], RuntimeError)
  why = (r"\(fabric handles: the processes span 2 hosts \(process 0 on node-a/boot-a, process 1 "
         r"on node-b/boot-b\), where CUDA IPC handles do not map\)")
  assert re.search(r"mok_jax.Workspace on GPUs \[0\] of process 1: GPU 0's driver reports the "
                   r"memory-pool handle types 0x1 .*ep_transport='collective', or EP groups "
                   r"within one host.*" + why, str(results[1]))
  assert re.search(r"process 1 could not create its segments of the workspace of ranks "
                   r"\[\(0, 0\), \(1, 0\)\] \(not_supported\): GPU 0's driver reports.*"
                   r"ep_transport='collective'.*" + why, str(results[0]))
  assert [e[0] for e in log if e[1] == 0] == ["export", "free"]
  assert [e[0] for e in log if e[1] == 1] == ["export"]  # it allocated nothing to free
  assert not [e for e in log if e[0] == "import"]


def test_exchange_generations_do_not_reuse_keys(short_waits):
  store, log = FakeStore(), []
  modules = {p: FakeCudaModule(p, log) for p in (0, 1)}
  assert _run_processes(store, modules, generation=0) == {0: 10, 1: 11}
  assert _run_processes(store, modules, generation=1) == {0: 10, 1: 11}
  assert len([k for k in store.values if "/1/export/" in k]) == 2


def test_exchange_a_peers_allocation_failure_fails_every_process(short_waits):
  store, log = FakeStore(), []
  modules = {0: FakeCudaModule(0, log), 1: FakeCudaModule(1, log, export_status="out_of_memory")}
  results = _run_processes(store, modules, steps=1)
  assert isinstance(results[1], MemoryError)
  assert re.search(r"could not allocate 4096 bytes .* GPUs \[0\] of process 1.*"
                   r"XLA_PYTHON_CLIENT_MEM_FRACTION", str(results[1]))
  assert isinstance(results[0], MemoryError)
  assert re.search(r"process 1 could not create its segments .*\(out_of_memory\): export failed",
                   str(results[0]))
  # Process 0 freed its segment without mapping anything; nobody imported.
  assert [e[0] for e in log if e[1] == 0] == ["export", "free"]
  assert not [e for e in log if e[0] == "import"]


def test_exchange_a_failed_mapping_releases_in_order(short_waits):
  store, log = FakeStore(), []
  modules = {0: FakeCudaModule(0, log), 1: FakeCudaModule(1, log, import_status="cuda_error")}
  results = _run_processes(store, modules, steps=1)
  assert isinstance(results[0], RuntimeError) and isinstance(results[1], RuntimeError)
  assert re.search(r"process 1 could not map the segments .*cudaIpcOpenMemHandle failed",
                   str(results[0]))
  assert re.search(r"cudaIpcOpenMemHandle failed on process 1", str(results[1]))
  last_close = max(i for i, e in enumerate(log) if e[0] == "close")
  assert sorted(e[1] for e in log if e[0] == "free") == [0, 1]
  assert all(i > last_close for i, e in enumerate(log) if e[0] == "free")


def test_exchange_with_a_peer_of_another_host_from_its_records(short_waits):
  """The other process's records as a process of another host writes them: this process
  exports fabric handles and imports the peer's."""
  store, log = FakeStore(), []
  prefix = "mok_jax/workspace/0.0_1.0/4096/0"
  peer = {"host": {"host": "elsewhere/boot"},
          "export": {"kind": "fabric", "status": "ok", "message": "",
                     "handles": {"1": exported("fabric", 1, 1).hex()}},
          "opened": {"status": "ok", "message": ""}}
  for step, record in peer.items():
    store.key_value_set_bytes(f"{prefix}/{step}/1", json.dumps(record).encode())
  module = FakeCudaModule(0, log)
  assert workspace._Exchange(store, RANKS, 4096, 0, 0).create(module) == 10
  assert log == [("export", 0, (0, -1), 4096, "fabric"), ("import", 0, 10)]
  assert module.imported == [b"", exported("fabric", 1, 1)]


def test_exchange_a_missing_process_times_out_naming_it(monkeypatch):
  monkeypatch.setattr(workspace, "EXCHANGE_TIMEOUT_MS", 100)
  store, log = FakeStore(), []
  ex = workspace._Exchange(store, RANKS, 4096, 0, 0)
  with pytest.raises(RuntimeError, match=r"process 0 waited 0.1 s for process 1's 'host' of "
                     r"the workspace of ranks \[\(0, 0\), \(1, 0\)\] \(key "
                     r"'mok_jax/workspace/0.0_1.0/4096/0/host/1'\).*same program"):
    ex.create(FakeCudaModule(0, log))
  assert not log  # nothing is allocated before every process's host is known


def test_exchange_a_peer_missing_after_its_host_times_out_and_frees(monkeypatch):
  monkeypatch.setattr(workspace, "EXCHANGE_TIMEOUT_MS", 100)
  store, log = FakeStore(), []
  store.key_value_set_bytes("mok_jax/workspace/0.0_1.0/4096/0/host/1",
                            json.dumps({"host": workspace._host_id()}).encode())
  ex = workspace._Exchange(store, RANKS, 4096, 0, 0)
  with pytest.raises(RuntimeError, match=r"waited 0.1 s for process 1's 'export'"):
    ex.create(FakeCudaModule(0, log))
  assert [e[0] for e in log] == ["export", "free"]


def test_exchange_needs_a_rank_of_this_process():
  with pytest.raises(ValueError, match=r"none of the ranks \[\(0, 0\), \(1, 0\)\] is of this "
                     r"process \(2\)"):
    workspace._Exchange(FakeStore(), RANKS, 4096, 0, 2)


def test_get_across_processes_needs_jax_distributed(monkeypatch):
  from jax._src import distributed

  monkeypatch.setattr(ops, "_mok_cuda", FakeCudaModule(0, []))
  monkeypatch.setattr(distributed.global_state, "client", None)
  with pytest.raises(RuntimeError, match=r"belong to several processes.*call "
                     r"jax.distributed.initialize\(\) first"):
    Workspace.get([_fake_device(0), _fake_device(process_index=1)], 1024)
  assert not Workspace._cache


def test_get_across_processes_caches_and_frees_collectively(monkeypatch, short_waits):
  """Workspace.get over devices of two processes, this one process 0: the other process's
  steps are in the store already (as it writes them); one workspace per (ranks, bytes); free
  waits for the other's 'closed', and a new workspace of the same ranks takes new keys."""
  store, log = FakeStore(), []
  module = FakeCudaModule(0, log)
  monkeypatch.setattr(ops, "_mok_cuda", module)
  monkeypatch.setattr(workspace, "_kv_client", lambda: store)
  monkeypatch.setattr(Workspace, "_cache", {})
  monkeypatch.setattr(Workspace, "_generations", {})
  monkeypatch.setattr(workspace, "_this_process", lambda: 0)

  def peer_steps(generation, steps):
    prefix = f"mok_jax/workspace/0.0_1.0/4096/{generation}"
    records = {"host": {"host": workspace._host_id()},
               "export": {"kind": "ipc", "status": "ok", "message": "",
                          "handles": {"1": exported("ipc", 1, 1).hex()}},
               "opened": {"status": "ok", "message": ""}, "closed": {}}
    for step in steps:
      store.key_value_set_bytes(f"{prefix}/{step}/1", json.dumps(records[step]).encode())

  peer_steps(0, ("host", "export", "opened"))
  devices = [_fake_device(0), _fake_device(process_index=1)]
  ws = Workspace.get(devices, 4096)
  assert Workspace.get([(0, 0), (1, 0)], 4096) is ws
  assert (ws.processes, ws.devices, ws.handle) == ((0, 1), (0, 0), 10)
  assert module.imported == [b"", exported("ipc", 1, 1)]
  assert "ranks=[(0, 0), (1, 0)]" in repr(ws)
  with pytest.raises(RuntimeError, match=r"waited 0.05 s for process 1's 'closed'.*stay "
                     r"allocated"):
    ws.free(timeout_ms=50)  # the other process has not unmapped: nothing is freed
  assert [e[0] for e in log] == ["export", "import", "close"]
  peer_steps(1, ("host", "export", "opened", "closed"))
  ws2 = Workspace.get(devices, 4096)
  assert ws2 is not ws
  ws2.free()
  assert [e[0] for e in log] == ["export", "import", "close", "export", "import", "close", "free"]
