"""The GPU's SM clock, power and energy while a timing runs (nvidia-smi, NVML). An H200 held
busy reaches its 700 W limit and lowers its SM clock from 1980 to 1290-1620 MHz, so a record
carries the clock of its own timing. Run as a script, this file is the energy poller (it imports
nothing of mok_jax, so it starts in tens of milliseconds).
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
  """nvidia-smi's csv lines of QUERY -> medians and ranges of the samples from `since` to
  `until` (time.time(); either open); lines such as "[N/A]" are left out."""
  mhz, watts = [], []
  for line in text.splitlines():
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
      continue
    try:
      at = datetime.datetime.strptime(fields[0], TIMESTAMP).timestamp()
      m, w = float(fields[1]), float(fields[2])
    except ValueError:
      continue
    if (since is None or at >= since) and (until is None or at <= until):
      mhz.append(m)
      watts.append(w)
  if not mhz:
    return None
  return {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz),
          "power_w": round(statistics.median(watts), 1), "power_w_max": max(watts),
          "samples": len(mhz)}


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
  """Samples the GPU while the block runs; out[key] = parse(...) of the samples from the last
  call of the yielded `mark` (timing's on_timed: the timed calls', not the warm-up's, in which
  dsv3's first b2b calls left the GPU near idle for seconds) to the end, or of the whole block
  (`whole_block`) when none came after it; with `energy_j` over `block_s` where NVML counts it.
  Without nvidia-smi or a sample, out stays as it is: the timing never depends on this."""
  exe = shutil.which("nvidia-smi")
  smi = exe and _start([exe, "-i", gpu_index(), f"--query-gpu={QUERY}",
                        "--format=csv,noheader,nounits", "-lms", str(PERIOD_MS)])
  if not smi:
    yield lambda: None
    return
  poller = _start(poller_args(gpu_index()))
  start = {}

  def mark():
    start.update(at=time.monotonic(), wall=time.time())

  mark()
  try:
    yield mark
  finally:
    end, end_wall = time.monotonic(), time.time()
    energy = energy_between(parse_steps(_finish(poller)), start["at"], end)
    text = _finish(smi)
    found = parse(text, since=start["wall"], until=end_wall)
    if found is None and (found := parse(text)):
      found["whole_block"] = True
    if found:
      if energy is not None:
        found.update(energy_j=round(energy, 3), block_s=round(end - start["at"], 4))
      out[key] = found


def energy_reader(visible: str | None = None):
  """(read, close) of NVML's nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded)
  for the job's GPU, on one open handle; None without NVML or the counter."""
  try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    if nvml.nvmlInit_v2() != 0:
      return None
  except (OSError, AttributeError):
    return None
  handle, mj, which = ctypes.c_void_p(), ctypes.c_ulonglong(), gpu_index(visible)
  try:
    if which.isdigit():
      found = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(which)), ctypes.byref(handle))
    else:
      found = nvml.nvmlDeviceGetHandleByUUID(which.encode(), ctypes.byref(handle))
    ok = found == 0 and nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) == 0
  except AttributeError:
    ok = False
  if not ok:
    nvml.nvmlShutdown()  # each successful init is matched
    return None

  def read() -> int | None:
    ok = nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) == 0
    return mj.value if ok else None

  return read, nvml.nvmlShutdown


def energy_changes(read):
  """(time.monotonic(), mJ) of the first reading and of every change, until a read fails."""
  last = None
  while (mj := read()) is not None:
    if mj != last:
      yield time.monotonic(), mj
      last = mj
    time.sleep(POLL_MS / 1e3)


def poll_energy(visible: str) -> None:
  """Prints "monotonic-seconds mJ" lines until terminated or the counter fails."""
  reader = energy_reader(visible)
  if reader is None:
    return
  read, close = reader
  try:
    for at, mj in energy_changes(read):
      print(f"{at:.6f} {mj}", flush=True)
  finally:
    close()


if __name__ == "__main__":
  poll_energy(sys.argv[1])
