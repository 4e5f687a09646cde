"""How often NVML's energy counter (clocks.energy_reader's nvmlDeviceGetTotalEnergyConsumption)
moves, idle and under load: the counter polled as the bench's poller polls it (clocks.energy_changes) for SECONDS, the
times and sizes of its steps printed, with the power each step implies; then the joules a call
that clocks.sampling finds over the blocks measure.py times, on a plain matmul, against the
draw nvidia-smi samples meanwhile. Read by path from this tree, so no built mok_jax is needed.
Usage: python tools/ab/energy_ticks.py [SECONDS] (default 2)."""

import importlib.util
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def bench_module(name):
  """mok_jax.bench's `name` module loaded from this tree by path (it needs no built mok_jax)."""
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(ROOT, "mok_jax", "bench", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def blocks(clocks, timing, f, a):
  """Joules a call over the blocks that measure.py times (clocks.sampling around one synchronised
  call at a time, then around back-to-back calls), with the block's host seconds and the power
  they imply, against nvidia-smi's median draw meanwhile."""
  for label in ("wall", "b2b", "wall", "b2b"):
    gpu = {}
    with clocks.sampling(gpu, label) as mark:
      if label == "wall":
        _, how = timing.repeat(timing.wall_clock(lambda i: f(a), jax.block_until_ready),
                               n_sets=1, warmup=3, warmup_s=1.0, reps=1000, min_reps=30,
                               budget_s=2.0, on_timed=mark)
      else:
        _, how = timing.batched(lambda i: f(a), jax.block_until_ready, n_sets=1, warmup_s=0.5,
                                reps=10, min_reps=5, budget_s=10.0, sample_s=0.2,
                                max_in_flight=2, on_timed=mark)
    row = gpu.get(label, {})
    calls = how["timed_calls"]
    if "energy_j" in row:
      print(f"block {label}: {calls} calls in {row['block_s']:.3f} s, {row['energy_j']:.1f} J: "
            f"{row['energy_j'] / calls:.3f} J a call, {row['energy_j'] / row['block_s']:.0f} W "
            f"over the block; nvidia-smi median {row['power_w']:.0f} W at {row['sm_mhz']:.0f} MHz",
            flush=True)


def poll(clocks, read, seconds):
  """[(host seconds, mJ)] at the first reading and each change of the counter over `seconds`
  (clocks.energy_changes, as the bench's poller reads it)."""
  steps = []
  end = time.monotonic() + seconds
  for at, mj in clocks.energy_changes(read):
    if at >= end:
      break
    steps.append((at, mj))
  return steps


def describe(label, steps):
  gaps = [(b[0] - a[0]) * 1e3 for a, b in zip(steps, steps[1:])]
  watts = [(b[1] - a[1]) / (b[0] - a[0]) / 1e3 for a, b in zip(steps, steps[1:])]
  if not gaps:
    print(f"{label}: {len(steps)} readings, no step", flush=True)
    return
  print(f"{label}: {len(gaps)} steps, ms between steps median {statistics.median(gaps):.1f} "
        f"(min {min(gaps):.1f}, max {max(gaps):.1f}); W a step median "
        f"{statistics.median(watts):.0f} (min {min(watts):.0f}, max {max(watts):.0f}); over "
        f"the whole poll {(steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0]) / 1e3:.0f} W",
        flush=True)
  print(f"{label} first steps (ms since the first, mJ since the first): " + ", ".join(
      f"{(t - steps[0][0]) * 1e3:.1f}:{e - steps[0][1]}" for t, e in steps[:12]), flush=True)


def main(argv):
  seconds = float(argv[0]) if argv else 2.0
  clocks, timing = bench_module("clocks"), bench_module("timing")
  read, close = clocks.energy_reader()
  describe("idle", poll(clocks, read, seconds))
  a = jnp.ones((8192, 8192), jnp.bfloat16)
  f = jax.jit(lambda a: (a @ a).astype(jnp.bfloat16) * 0.0001)
  jax.block_until_ready(f(a))
  stop = threading.Event()

  def load():  # about 1.4 ms a matmul; at most a few in flight
    out = a
    while not stop.is_set():
      for _ in range(8):
        out = f(out)
      jax.block_until_ready(out)

  worker = threading.Thread(target=load)
  worker.start()
  time.sleep(1.0)
  describe("load", poll(clocks, read, seconds))
  stop.set()
  worker.join()
  describe("after load", poll(clocks, read, seconds))
  close()
  big = jnp.ones((16384, 16384), jnp.bfloat16)  # about 11 ms a call
  jax.block_until_ready(f(big))
  blocks(clocks, timing, f, big)


if __name__ == "__main__":
  main(sys.argv[1:])
