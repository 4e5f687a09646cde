"""mok_jax.Workspace on any machine: the byte layout and its size formula (real values), the
argument checks and their messages, the errors of a build without the CUDA module, and the
layout's agreement with the kernels' header (cuda/ep_transport.h). The allocations themselves
are tested on a GPU (tests/test_ep_transport_cuda.py)."""

from __future__ import annotations

import pathlib
import re
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
    ("negative_ordinal", [0, -1], 1024, ValueError, r"a CUDA ordinal must be at least 0, got -1"),
    ("not_a_device", [0, object()], 1024, ValueError, r"is neither a jax.Device nor a CUDA"),
    ("mixed", [0, 0, 1], 1024, ValueError,
     r"distinct GPUs \(one a GPU\) or all on one GPU .*got GPUs \[0, 0, 1\]"),
    ("nbytes0", [0, 0], 0, ValueError, r"Workspace.get: nbytes must be an integer of at least 1"),
    ("other_process", [_fake_device(0), _fake_device(process_index=1, local_hardware_id=1)],
     1024, NotImplementedError,
     r"belongs to process 1.*CUDA IPC.*fabric handles \(CU_MEM_HANDLE_TYPE_FABRIC\).*"
     r"jax.distributed's key-value store"),
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
