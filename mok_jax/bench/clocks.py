"""The GPU's SM clock and power draw while a timing runs, sampled with nvidia-smi.

An H200 held busy reaches its 700 W power limit and lowers its SM clock, from 1980 MHz to
1290-1620 MHz under mok_jax's back-to-back calls (2026-11-30): the same kernels time differently
one synchronised call at a time, back to back, and on another machine of the pool. A record
that carries the clock of its own timing says which of these it measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import statistics
import subprocess

PERIOD_MS = 100
QUERY = "clocks.sm,power.draw"


def gpu_index(visible: str | None = None) -> str:
  """nvidia-smi's name for the device the job runs on: the first of CUDA_VISIBLE_DEVICES (an
  index or a UUID), else 0."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
  first = (visible or "").split(",")[0].strip()
  return first or "0"


def parse(text: str) -> dict | None:
  """nvidia-smi's `--format=csv,noheader,nounits` lines of QUERY -> medians and ranges, or None
  without a sample (lines that are not two numbers, such as "[N/A]", are left out)."""
  mhz, watts = [], []
  for line in text.splitlines():
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 2:
      continue
    try:
      m, w = float(fields[0]), float(fields[1])
    except ValueError:
      continue
    mhz.append(m)
    watts.append(w)
  if not mhz:
    return None
  return {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz),
          "power_w": round(statistics.median(watts), 1), "power_w_max": max(watts),
          "samples": len(mhz)}


@contextlib.contextmanager
def sampling(out: dict, key: str):
  """Samples the job's GPU every PERIOD_MS while the block runs; then out[key] = parse(...),
  with the GPU's joules over the whole block (`energy_j`, energy_mj) where NVML counts them.
  Without nvidia-smi (a CPU machine) or without a sample, out is left as it is: the timing
  never depends on the sampler."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    yield
    return
  try:
    proc = subprocess.Popen(
        [exe, "-i", gpu_index(), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
         "-lms", str(PERIOD_MS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  except OSError:
    yield
    return
  start_mj = energy_mj()
  try:
    yield
  finally:
    end_mj = energy_mj()
    proc.terminate()
    try:
      text, _ = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
      proc.kill()
      text, _ = proc.communicate()
    found = parse(text or "")
    if found:
      if start_mj is not None and end_mj is not None:
        found["energy_j"] = round((end_mj - start_mj) / 1e3, 3)
      out[key] = found


def energy_mj(visible: str | None = None) -> int | None:
  """The job's GPU's energy counter (NVML's nvmlDeviceGetTotalEnergyConsumption: millijoules
  since the driver loaded), or None without NVML or the counter (a CPU machine). Two readings
  around some calls give their joules, which a call's time follows once the GPU runs at its
  power cap (docs/performance.md, Runs and machines)."""
  try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
  except OSError:
    return None
  handle, mj = ctypes.c_void_p(), ctypes.c_ulonglong()
  which = gpu_index(visible)
  try:
    if nvml.nvmlInit_v2() != 0:
      return None
  except AttributeError:  # an NVML without these entry points
    return None
  try:
    if which.isdigit():
      found = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(which)), ctypes.byref(handle))
    else:
      found = nvml.nvmlDeviceGetHandleByUUID(which.encode(), ctypes.byref(handle))
    ok = found == 0 and nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) == 0
  except AttributeError:
    ok = False
  finally:
    nvml.nvmlShutdown()  # each successful init is matched, whatever the lookups did
  return mj.value if ok else None
