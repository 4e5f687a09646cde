"""compute-sanitizer over the CUDA forward and backward on small cases (tools/sanitize.sh): no
out-of-bounds or misaligned access (memcheck), no read of device memory that nothing wrote
(initcheck), no shared-memory race (racecheck), in the kernels or in what XLA runs around
them. Where initcheck cannot see the bytes of TMA stores, the script lists its reports at the
plain loads of TMA-stored rows apart (tools/README.md) and fails on any other."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sanitize.sh"


@pytest.mark.parametrize("tool", ["memcheck", "initcheck", "racecheck"])
def test_sanitizer_clean(tool, tmp_path):
  if shutil.which("compute-sanitizer") is None:
    pytest.skip("compute-sanitizer is not on PATH")
  env = dict(os.environ, SANITIZE_LOGS=str(tmp_path))
  done = subprocess.run(["bash", str(SCRIPT), tool], env=env, capture_output=True, text=True,
                        timeout=900)
  log = (tmp_path / f"{tool}.log").read_text() if (tmp_path / f"{tool}.log").exists() else ""
  assert done.returncode == 0, done.stdout + log[-6000:]
  assert "SUMMARY: " in log, "the tool stopped before its summary"
