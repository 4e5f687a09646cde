"""The GPU's SM clock, power and energy while measure.py times a mode. A GPU held busy at its
power cap lowers its SM clock (an H200 from 1980 to 1290-1620 MHz), and a call's time then
follows its energy, so an A/B compares builds at like clocks and by the joules a call:
nvidia-smi samples the clock and draw; this file, run as a script (it imports nothing of
mok_jax, so it starts quickly), polls NVML's energy counter.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import time

PERIOD_MS = 100
QUERY = "timestamp,clocks.sm,power.draw"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, in local time
POLL_MS = 1.0  # the poller's reads of NVML's energy counter


def gpu_index(visible: str | None = None) -> str:
  """nvidia-smi's name for the job's device: the first of CUDA_VISIBLE_DEVICES, else 0."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
  return (visible or "").split(",")[0].strip() or "0"


def parse(text: str, since: float | None = None, until: float | None = None) -> dict | None:
  """nvidia-smi's csv lines of QUERY from `since` to `until` (time.time(); either open) -> the
  median clock and draw; lines such as "[N/A]" are left out."""
  mhz, watts = [], []
  for line in text.splitlines():
    fields = [f.strip() for f in line.split(",")]
    try:
      at = datetime.datetime.strptime(fields[0], TIMESTAMP).timestamp()
      m, w = map(float, fields[1:])
    except ValueError:  # not three fields, or "[N/A]"
      continue
    if (since is None or at >= since) and (until is None or at <= until):
      mhz.append(m)
      watts.append(w)
  return {"sm_mhz": statistics.median(mhz), "power_w": round(statistics.median(watts), 1),
          "samples": len(mhz)} if mhz else None


def energy_between(steps: list[tuple[float, int]], t0: float, t1: float) -> float | None:
  """Joules from t0 to t1 (time.monotonic) from the counter's steps [(seen at, mJ)]. NVML's
  counter moves every 100 ms, so the joules between the first and last steps inside are exact;
  the ends are taken at the draw between those two steps, since the draw of a single step would
  be off by as much as the poller was late to see it. None with fewer than three steps inside."""
  inside = [(t, mj) for t, mj in steps if t0 <= t <= t1]
  if len(inside) < 3:
    return None
  (ta, ea), (ty, ey) = inside[0], inside[-1]
  return (ey - ea) / 1e3 * (t1 - t0) / (ty - ta)


def parse_steps(text: str) -> list[tuple[float, int]]:
  """The poller's lines -> its steps; its first reading is none (the counter moved before)."""
  readings = []
  for line in text.splitlines():
    try:
      at, mj = line.split()[:2]
      readings.append((float(at), int(mj)))
    except ValueError:
      continue
  return readings[1:]


def poller_args(visible: str) -> list[str]:
  return [sys.executable, "-I", os.path.abspath(__file__), visible]


def _start(args: list[str]):
  try:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  except OSError:
    return None


def _finish(proc) -> str:
  if proc is None:
    return ""
  proc.terminate()
  try:
    return proc.communicate(timeout=5)[0] or ""
  except subprocess.TimeoutExpired:
    proc.kill()
    return proc.communicate()[0] or ""


@contextlib.contextmanager
def sampling(out: dict, key: str):
  """Samples the GPU while the block runs: out[key] = parse(...) of the samples from the last
  call of the yielded `mark` (mok_jax.bench.timing's on_timed: the timed calls, not the
  warm-up) to the end, with `energy_j` over `block_s` where NVML counts it. Without nvidia-smi
  or a sample, out stays as it is: the timing never depends on this."""
  exe, visible = shutil.which("nvidia-smi"), gpu_index()
  smi = exe and _start([exe, "-i", visible, f"--query-gpu={QUERY}",
                        "--format=csv,noheader,nounits", "-lms", str(PERIOD_MS)])
  if not smi:
    yield lambda: None
    return
  poller, start = _start(poller_args(visible)), {}

  def mark():
    start.update(at=time.monotonic(), wall=time.time())

  mark()
  try:
    yield mark
  finally:
    end, end_wall = time.monotonic(), time.time()
    energy = energy_between(parse_steps(_finish(poller)), start["at"], end)
    if found := parse(_finish(smi), since=start["wall"], until=end_wall):
      if energy is not None:
        found.update(energy_j=round(energy, 3), block_s=round(end - start["at"], 4))
      out[key] = found


def energy_changes(read):
  """(time.monotonic(), mJ) of the first reading and of every change, until a read fails."""
  last = None
  while (mj := read()) is not None:
    if mj != last:
      yield time.monotonic(), mj
      last = mj
    time.sleep(POLL_MS / 1e3)


def poll_energy(visible: str) -> None:
  """Prints "monotonic-seconds mJ" lines of NVML's energy counter (mJ since the driver loaded)
  for GPU `visible` (an index or a UUID) until terminated; nothing without NVML or the counter."""
  try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
  except OSError:
    return
  if nvml.nvmlInit_v2() != 0:
    return
  handle, mj = ctypes.c_void_p(), ctypes.c_ulonglong()
  try:
    found = (nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(visible)), ctypes.byref(handle))
             if visible.isdigit() else
             nvml.nvmlDeviceGetHandleByUUID(visible.encode(), ctypes.byref(handle)))
    ok = lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) == 0
    for at, value in energy_changes(lambda: mj.value if found == 0 and ok() else None):
      print(f"{at:.6f} {value}", flush=True)
  finally:
    nvml.nvmlShutdown()


if __name__ == "__main__":
  poll_energy(sys.argv[1])
