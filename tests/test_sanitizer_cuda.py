"""compute-sanitizer over the CUDA forward and backward on small cases (tools/sanitize.sh): no
out-of-bounds or misaligned access (memcheck), no read of device memory that nothing wrote
(initcheck), no shared-memory race (racecheck), in the kernels or in what XLA runs around
them. Where initcheck cannot see the bytes of TMA stores, the script lists its reports at the
plain loads of TMA-stored rows apart (tools/README.md) and fails on any other."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "sanitize.sh"

# What the line of each TMA_READERS entry of sanitize.sh loads: rows that TMA stores wrote.
TMA_LOADS = {"combine.cuh:50": "Load8(in ", "combine.cuh:55": "Load8(extra ",
             "epilogue.cuh:241": "p.aux"}


def test_tma_readers_are_the_loads_of_tma_stored_rows():
  """sanitize.sh sets apart initcheck's reports at these lines only: each must still be the
  load it names (an edit that moves the line must move the entry too)."""
  readers = re.search(r"^TMA_READERS=\((.*)\)$", SCRIPT.read_text(), re.M).group(1)
  sites = re.findall(r'"([^"]+)"', readers)
  assert sorted(sites) == sorted(TMA_LOADS)
  for site in sites:
    name, line = site.split(":")
    text = (ROOT / "cuda" / "sm90" / name).read_text().splitlines()[int(line) - 1]
    assert TMA_LOADS[site] in text, (site, text)


@pytest.mark.gpu
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
