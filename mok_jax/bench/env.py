"""What a result was measured on: machine, accelerator, package versions, date, commit.

Versions come from the installed distributions' metadata, so asking for them imports nothing
(importing torch or tokamax here would cost seconds and, for torch, a CUDA context).
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess

from mok_jax.bench.shapes import SKIP_ENV

PACKAGES = ("mok_jax", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "tokamax",
            "torch", "triton", "numpy")
# Variables that change what the benchmark measures; recorded with every run.
ENV_VARS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", SKIP_ENV)


def now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict:
  found = {}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


@functools.lru_cache(maxsize=None)
def git_commit() -> str | None:
  # MOK_BENCH_COMMIT names the commit when the tree was copied without its history (a remote
  # GPU machine may hold a stale .git).
  if os.environ.get("MOK_BENCH_COMMIT"):
    return os.environ["MOK_BENCH_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, text=True,
                         capture_output=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           text=True, capture_output=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode:
    return None
  return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> dict:
  return {
      "host": platform.node(),
      "os": platform.platform(),
      "cpu": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
  }


def describe() -> dict:
  """Everything but the accelerator, which the worker that uses it reports."""
  return {
      "machine": machine(),
      "versions": versions(),
      "commit": git_commit(),
      "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
  }


def jax_device() -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  return {"platform": jax.default_backend(), "name": device.device_kind,
          "count": jax.device_count()}
