"""A workspace across two processes on one GPU (marked `gpu`): each process allocates its
rank's segment and exports a CUDA IPC handle, the handles go through jax.distributed's
key-value store, each maps the other's segment; each writes a pattern into the other's
segment through its mapping and reads back, from its own segment, the pattern the other
wrote; then both free in order. JAX runs on its CPU backend in the two processes (the KV store
does not need the GPU, and XLA's GPU client would take 75% of the GPU twice): the mapping is
checked through the CUDA module's own functions (workspace_write, workspace_read)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent("""
    import sys
    import jax
    p, port = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=p, initialization_timeout=60)
    from jax._src import distributed
    from mok_jax import ops, Workspace
    m, kv = ops._mok_cuda, distributed.global_state.client
    ws = Workspace.get([(0, 0), (1, 0)], 1 << 20)
    h = ws.handle
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


def test_two_processes_map_each_others_segments_on_one_gpu():
  port = _free_port()
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(p), str(port)], env=env,
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
