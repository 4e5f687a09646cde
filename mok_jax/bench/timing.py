"""Repetition loops and their summary, for every framework (and tools/ab/measure.py).

`repeat`: a synchronised call a sample, each on the next of a few input sets so that none
re-reads what the last left in L2; `reps` cut to fit `budget_s`, not below `min_reps` unless that
takes HARD_CAP budgets, and warm-up within WARMUP_CAP budgets, so that a slow peer's mode costs
at most about compile + (WARMUP_CAP + HARD_CAP) * budget_s + 3 calls. `batched`: back-to-back
calls, a sync per sample, so that no dispatch or sync latency sits between two calls;
max_in_flight bounds the calls' memory while the device always has the next one queued.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Callable

WARMUP_CAP = 0.5
HARD_CAP = 3.0
SAMPLE_S = 0.05
MAX_BATCH = 1000


def plan_reps(seconds_per_call: float, reps: int, min_reps: int, budget_s: float) -> int:
  if seconds_per_call <= 0:
    return reps
  floor = min(min_reps, reps, max(1, int(HARD_CAP * budget_s / seconds_per_call)))
  return max(min(reps, int(budget_s / seconds_per_call)), floor)


def repeat(run_once: Callable[[int], float], *, n_sets: int, warmup: int, reps: int,
           min_reps: int, budget_s: float, warmup_s: float = 0.0, prior_s: float | None = None,
           on_timed: Callable[[], None] | None = None) -> tuple[list[float], dict]:
  """run_once(i) runs input set i, synchronises and returns its seconds. prior_s: the caller's
  first call, which may hold one-time work (kernel loading, cuBLAS handles), so it neither counts
  as warm-up nor plans the reps unless no warm-up runs. on_timed() runs just before the timed
  calls (clocks.sampling's mark)."""
  own, elapsed, last = 0, 0.0, prior_s
  start = time.perf_counter()
  while not ((own >= warmup and elapsed >= warmup_s)
             or (own >= 1 and elapsed >= WARMUP_CAP * budget_s)):
    last = run_once(own % n_sets)
    own += 1
    elapsed = time.perf_counter() - start
  n = plan_reps(last, reps, min_reps, budget_s) if last is not None else reps
  if on_timed is not None:
    on_timed()
  seconds = [run_once((own + i) % n_sets) for i in range(n)]
  return seconds, {"warmup_calls": own + (prior_s is not None), "warmup_s": round(elapsed, 4),
                   "reps_asked": reps, "calls_per_sample": 1, "timed_calls": n}


def wall_clock(call: Callable[[int], object], sync: Callable[[object], None]):
  """run_once for repeat(): the host's clock around call(i) and sync(result)."""

  def run_once(i: int) -> float:
    start = time.perf_counter()
    sync(call(i))
    return time.perf_counter() - start

  return run_once


def batched(call: Callable[[int], object], sync: Callable[[object], None], *, n_sets: int,
            warmup_s: float, reps: int, min_reps: int, budget_s: float,
            sample_s: float = SAMPLE_S, max_in_flight: int = 0,
            on_timed: Callable[[], None] | None = None) -> tuple[list[float], dict]:
  """call(i) only enqueues work on set i; sync(out) waits for it and, the device running its
  queue in order, for every call before it. Returns seconds per call of each sample."""

  def run_batch(first: int, size: int) -> float:
    start = time.perf_counter()
    pending = collections.deque()
    for j in range(size):
      if max_in_flight and len(pending) == max_in_flight:
        sync(pending.popleft())
      pending.append(call((first + j) % n_sets))
    sync(pending[-1])
    return (time.perf_counter() - start) / size

  calls, size = 0, 1
  start = time.perf_counter()
  while True:
    per_call = run_batch(calls, size)
    calls += size
    if time.perf_counter() - start >= warmup_s:
      break
    size = min(MAX_BATCH, max(1, int(min(sample_s, warmup_s) / max(per_call, 1e-9))))
  warm_s = time.perf_counter() - start
  size = min(MAX_BATCH, max(1, round(sample_s / max(per_call, 1e-9))))
  n = plan_reps(per_call * size, reps, min_reps, budget_s)
  if on_timed is not None:
    on_timed()
  seconds = [run_batch(calls + i * size, size) for i in range(n)]
  return seconds, {"warmup_calls": calls, "warmup_s": round(warm_s, 4), "reps_asked": reps,
                   "calls_per_sample": size, "sample_s": sample_s, "timed_calls": n * size}


def summarize(seconds: list[float]) -> dict:
  """Milliseconds: median, min, max, quartiles (linear between closest ranks), mean; count."""
  ms = sorted(s * 1e3 for s in seconds)
  if not ms:
    raise ValueError("summarize: no timings")

  def quantile(q: float) -> float:
    pos = q * (len(ms) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

  return {"median": statistics.median(ms), "min": ms[0], "max": ms[-1], "p25": quantile(0.25),
          "p75": quantile(0.75), "mean": statistics.fmean(ms), "n": len(ms)}
