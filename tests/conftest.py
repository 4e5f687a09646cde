"""Test tiers: everything unmarked runs on CPU (CI); `gpu` / `multigpu` tests need CUDA.

The host platform is split into 8 CPU devices so that expert parallelism over 1, 2, 4 and 8
ranks runs on any machine. XLA reads the flag once, when JAX initialises its backends, so it
is set here, before any test module imports jax.
"""

from __future__ import annotations

import functools
import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

import pytest  # noqa: E402

# marker -> CUDA GPUs it needs
GPU_MARKERS = {"gpu": 1, "multigpu": 2}


@functools.cache
def cuda_gpus() -> tuple[int, str]:
  """(number of CUDA GPUs usable by mok_jax, why 0 when it is 0)."""
  try:
    from mok_jax import ops
  except ImportError as e:  # pragma: no cover - the package itself is broken
    return 0, f"mok_jax does not import: {e}"
  if ops._mok_cuda is None:
    return 0, "mok_jax was built without its CUDA module (mok_jax._mok_cuda)"
  import jax

  try:
    n = len(jax.devices("gpu"))
  except RuntimeError as e:
    return 0, f"no CUDA GPU visible to JAX ({e})"
  return n, f"{n} CUDA GPU(s)"


def pytest_collection_modifyitems(config, items):
  for item in items:
    need = max((n for m, n in GPU_MARKERS.items() if item.get_closest_marker(m)), default=0)
    if not need:
      continue
    have, why = cuda_gpus()
    if have < need:
      item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s): {why}"))
