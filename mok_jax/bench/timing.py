"""Repetition loop and summary statistics shared by every framework.

A run is: warm-up calls, then timed calls, each on the next of a few input sets (so that no call
re-reads operands the previous one left in L2), each ended by a device synchronisation. The
number of timed calls is `reps`, cut down (never below `min_reps`) when the last warm-up call
says they would take longer than `budget_s`: a peer that takes 300 ms a call still gets a
median, without holding the GPU for minutes.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable


def plan_reps(seconds_per_call: float, reps: int, min_reps: int, budget_s: float) -> int:
  if seconds_per_call <= 0:
    return reps
  fit = int(budget_s / seconds_per_call)
  return max(min(reps, fit), min(min_reps, reps))


def repeat(run_once: Callable[[int], float], *, n_sets: int, warmup: int, reps: int,
           min_reps: int, budget_s: float) -> list[float]:
  """Calls run_once(i) (which runs input set i, synchronises, and returns its seconds) `warmup`
  times untimed, then a planned number of times; returns the timed seconds."""
  last = 0.0
  for i in range(warmup):
    last = run_once(i % n_sets)
  n = plan_reps(last, reps, min_reps, budget_s) if warmup else reps
  return [run_once((warmup + i) % n_sets) for i in range(n)]


def wall_clock(call: Callable[[int], object], sync: Callable[[object], None]):
  """run_once for repeat(): the host's clock around call(i) and sync(result)."""

  def run_once(i: int) -> float:
    start = time.perf_counter()
    out = call(i)
    sync(out)
    seconds = time.perf_counter() - start
    del out
    return seconds

  return run_once


def summarize(seconds: list[float]) -> dict:
  """Median, min, max, quartiles and mean in milliseconds, and the count."""
  ms = sorted(s * 1e3 for s in seconds)
  n = len(ms)
  if n == 0:
    raise ValueError("summarize: no timings")

  def quantile(q: float) -> float:  # linear interpolation between closest ranks
    pos = q * (n - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

  return {
      "median": statistics.median(ms),
      "min": ms[0],
      "max": ms[-1],
      "p25": quantile(0.25),
      "p75": quantile(0.75),
      "mean": statistics.fmean(ms),
      "n": n,
  }
