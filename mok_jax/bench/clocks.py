"""The GPU's SM clock and power draw while a timing runs, sampled with nvidia-smi.

An H200 held busy reaches its 700 W power limit and lowers its SM clock, from 1980 MHz to
1290-1620 MHz under mok_jax's back-to-back calls: the same kernels time differently
one synchronised call at a time, back to back, and on another machine of the pool. A record
that carries the clock of its own timing says which of these it measured.
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


def gpu_index(visible: str | None = None) -> str:
  """nvidia-smi's name for the device the job runs on: the first of CUDA_VISIBLE_DEVICES (an
  index or a UUID), else 0."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
  first = (visible or "").split(",")[0].strip()
  return first or "0"


def parse(text: str, since: float | None = None, until: float | None = None) -> dict | None:
  """nvidia-smi's `--format=csv,noheader,nounits` lines of QUERY -> medians and ranges of the
  samples taken from `since` to `until` (time.time(); either open), or None without such a
  sample (lines that are not a timestamp and two numbers, such as "[N/A]", are left out)."""
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
    if (since is not None and at < since) or (until is not None and at > until):
      continue
    mhz.append(m)
    watts.append(w)
  if not mhz:
    return None
  return {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz),
          "power_w": round(statistics.median(watts), 1), "power_w_max": max(watts),
          "samples": len(mhz)}


def _no_mark():
  pass


# The energy poller: this file run as a script in a process of its own (it imports nothing of
# mok_jax, so it starts in tens of milliseconds), printing "monotonic-seconds mJ" for its first
# reading and at every change of NVML's energy counter, which it reads every POLL_MS.
POLL_MS = 1.0


def energy_between(steps: list[tuple[float, int]], t0: float, t1: float) -> float | None:
  """Joules the GPU used from time t0 to t1 (time.monotonic), from the energy counter's steps
  [(time the poller saw it move, mJ)]: NVML's counter moves every 100 ms on an H200 (by the
  draw of the 100 ms before), so the joules between the
  first and the last step inside [t0, t1] are exact, and the parts of the block before the
  first and after the last are taken at the draw between those two steps (a timed block is
  busy throughout; the draw of a single step would be wrong by as much as the poller was late
  to see either of its ends). None with fewer than three steps inside (a block shorter than
  about 0.3 s): no figure rather than one off by a step."""
  inside = [(t, mj) for t, mj in steps if t0 <= t <= t1]
  if len(inside) < 3:
    return None
  (ta, ea), (ty, ey) = inside[0], inside[-1]
  return (ey - ea) / 1e3 * (t1 - t0) / (ty - ta)


def parse_steps(text: str) -> list[tuple[float, int]]:
  """The poller's lines -> its steps, without its first reading (not a step: the counter moved
  at some unknown time before it)."""
  readings = []
  for line in text.splitlines():
    fields = line.split()
    try:
      readings.append((float(fields[0]), int(fields[1])))
    except (ValueError, IndexError):
      continue
  return readings[1:]


def poller_args(visible: str) -> list[str]:
  """The energy poller's command line: this file in an isolated interpreter (-I: no PYTHONPATH,
  no script directory on sys.path)."""
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
    text, _ = proc.communicate(timeout=5)
  except subprocess.TimeoutExpired:
    proc.kill()
    text, _ = proc.communicate()
  return text or ""


@contextlib.contextmanager
def sampling(out: dict, key: str):
  """Samples the job's GPU every PERIOD_MS while the block runs; then out[key] = parse(...) of
  the samples from the block's start, or from the last call of the `mark` it yields (timing's
  on_timed, so that clock, draw and joules are the timed calls' and not the warm-up's, in which
  dsv3's first back-to-back calls left the GPU near idle for seconds), to its end; of the
  whole block if none came after the mark (timed calls shorter than a sample), with
  `whole_block`. With it the GPU's joules (`energy_j`, energy_between) over `block_s` seconds
  from the mark where NVML counts them. Without nvidia-smi (a CPU machine) or without a sample,
  out is left as it is: the timing never depends on the sampler."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    yield _no_mark
    return
  smi = _start([exe, "-i", gpu_index(), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                "-lms", str(PERIOD_MS)])
  if smi is None:
    yield _no_mark
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
    if found is None:
      found = parse(text)
      if found:
        found["whole_block"] = True
    if found:
      if energy is not None:
        found["energy_j"] = round(energy, 3)
        found["block_s"] = round(end - start["at"], 4)
      out[key] = found


def energy_reader(visible: str | None = None):
  """(read, close) for the job's GPU's energy counter (NVML's
  nvmlDeviceGetTotalEnergyConsumption: millijoules since the driver loaded) on one open handle,
  or None without NVML or the counter (a CPU machine)."""
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
  if not ok:
    nvml.nvmlShutdown()  # each successful init is matched, whatever the lookups did
    return None

  def read() -> int | None:
    if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) != 0:
      return None
    return mj.value

  return read, nvml.nvmlShutdown


def energy_changes(read):
  """(time.monotonic(), mJ) of the first reading of `read` (energy_reader's) and of every change
  after it, read every POLL_MS, until a reading fails."""
  last = None
  while (mj := read()) is not None:
    if mj != last:
      yield time.monotonic(), mj
      last = mj
    time.sleep(POLL_MS / 1e3)


def poll_energy(visible: str) -> None:
  """The energy poller (see POLL_MS): runs until terminated or the counter fails."""
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
