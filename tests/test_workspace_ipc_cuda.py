"""A workspace across two processes on one GPU (marked `gpu`): each process allocates its
rank's segment and exports a handle of it, the handles go through jax.distributed's key-value
store, each maps the other's segment; each writes a pattern into the other's segment through
its mapping and reads back, from its own segment, the pattern the other wrote; then both free
in order. Once with CUDA IPC handles (one host's choice) and once with fabric handles
(MOK_JAX_WORKSPACE_FABRIC=1, skipped where the GPU or its driver cannot export them). JAX runs
on its CPU backend in the two processes (the KV store does not need the GPU, and XLA's GPU
client would take 75% of the GPU twice): the mapping is checked through the CUDA module's own
functions (workspace_write, workspace_read). In this process: exported bytes that are not a
handle are refused naming the rank."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from mok_jax import ops
from mok_jax.workspace import FABRIC_ENV

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent("""
    import json, sys
    import jax
    p, port, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=p, initialization_timeout=60)
    from jax._src import distributed
    from mok_jax import ops, Workspace
    m, kv = ops._mok_cuda, distributed.global_state.client
    ws = Workspace.get([(0, 0), (1, 0)], 1 << 20)
    h = ws.handle
    # Each process exported its segment as `kind`: the first byte of its exported bytes.
    for q in (0, 1):
      key = f"mok_jax/workspace/0.0_1.0/{1 << 20}/0/export/{q}"
      record = json.loads(kv.blocking_key_value_get_bytes(key, 60_000))
      blob = bytes.fromhex(record["handles"][str(q)])
      assert record["kind"] == kind and blob[:1] == {"ipc": b"I", "fabric": b"F"}[kind], record
      assert len(blob) == {"ipc": 65, "fabric": 129}[kind], len(blob)
    info = ws.info()
    assert info["devices"] == ([0, -1] if p == 0 else [-1, 0]), info
    assert info["tables"][1 - p] == [] and len(info["tables"][p]) == 2, info
    pattern = lambda q: bytes((q * 37 + i) % 251 for i in range(4096))
    # Both segments start zeroed (the other's, read through this process's mapping).
    assert m.workspace_read(h, p, p, 0, 8192) == bytes(8192)
    assert m.workspace_read(h, p, 1 - p, 0, 8192) == bytes(8192)
    m.workspace_write(h, p, 1 - p, 4096, pattern(p))
    kv.key_value_set(f"test/written/{p}", "1")
    kv.blocking_key_value_get(f"test/written/{1 - p}", 60_000)
    assert m.workspace_read(h, p, p, 4096, 4096) == pattern(1 - p)
    assert m.workspace_read(h, p, 1 - p, 4096, 4096) == pattern(p)
    assert m.workspace_read(h, p, p, 0, 4096) == bytes(4096)
    ws.free()
    print(f"process {p}: ok", flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes_on_gpu_0(kind: str) -> None:
  """CHILD in two processes on GPU 0, with `kind` of handles ("ipc", or "fabric" through
  FABRIC_ENV); both must finish their checks."""
  port = _free_port()
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", JAX_PLATFORMS="cpu")
  env.pop(FABRIC_ENV, None)
  if kind == "fabric":
    env[FABRIC_ENV] = "1"
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(p), str(port), kind], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for p in (0, 1)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=120)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for p, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0 and f"process {p}: ok" in out, out


def test_two_processes_map_each_others_segments_on_one_gpu():
  _two_processes_on_gpu_0("ipc")


def test_two_processes_map_each_others_segments_through_fabric_handles():
  supported, reason = ops._mok_cuda.workspace_fabric_supported(0)
  if not supported:
    pytest.skip(f"GPU 0 cannot export memory pools as fabric handles: {reason}")
  assert reason == ""
  _two_processes_on_gpu_0("fabric")


# (id, rank 1's exported bytes, regex of the message): checked before anything is mapped.
MALFORMED = [
    ("empty", b"", r"rank 1's exported handle is empty"),
    ("unknown_kind", b"X" * 65,
     r"rank 1's exported handle starts with the byte 0x58, which names no kind of handle "
     r"\('I': CUDA IPC, 'F': fabric\)"),
    ("short_ipc", b"I" * 10, r"rank 1's exported handle has 10 bytes; a CUDA IPC handle .* is 65"),
    ("fabric_of_ipc_size", b"F" * 65,
     r"rank 1's exported handle has 65 bytes; a fabric handle .* is 129"),
]


@pytest.mark.parametrize("blob,match", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_handles_are_refused_naming_the_rank(blob, match):
  m = ops._mok_cuda
  handle, status, message, exported = m.workspace_export([0, -1], 4096, "ipc")
  assert (status, message) == ("ok", "") and handle > 0
  assert exported[0][:1] == b"I" and len(exported[0]) == 65 and exported[1] == b""
  try:
    status, message = m.workspace_import(handle, [b"", blob])
    assert status == "bad_argument" and re.search(match, message), message
    with pytest.raises(ValueError, match=r"no workspace has handle"):
      m.workspace_info(handle)  # not ready
  finally:
    assert m.workspace_free(handle)


def test_an_unknown_kind_of_export_is_refused():
  with pytest.raises(ValueError, match=r"kind must be 'ipc' or 'fabric', got 'nvlink'"):
    ops._mok_cuda.workspace_export([0, -1], 4096, "nvlink")
