"""Repetition loops and summary statistics shared by every framework.

MoE modes (`repeat`): after the caller's first call (compile-time work, checksums), `warmup`
untimed calls and at least `warmup_s` seconds of them (so that the clocks have ramped up after
the idle compile), then timed calls, each on the next of a few input sets (so that no call
re-reads operands the previous one left in L2), each ended by a device synchronisation. The
number of timed calls is `reps`, cut when one call says they would take longer than `budget_s`,
never below `min_reps` unless even that would take more than HARD_CAP budgets (then as many
calls as fit, at least one). Warm-up stops early, after one call at least, once it has run for
WARMUP_CAP budgets. So a slow peer's mode costs at most about
compile + (WARMUP_CAP + HARD_CAP) * budget_s + 3 calls, however slow its calls are.

Dense peak (`batched`): back-to-back calls with one synchronisation per sample of many calls
(so that neither dispatch nor synchronisation latency sits between two matmuls), after at least
`warmup_s` seconds of the same; each sample gives the mean seconds per call of its batch. With
max_in_flight (the MoE modes' back-to-back figure) a call is dispatched only once the call
max_in_flight before it has finished, which bounds the memory of calls in flight while the
device still always has the next call queued.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Callable

WARMUP_CAP = 0.5  # warm-up stops once it has run this many budget_s (after one call at least)
HARD_CAP = 3.0  # min_reps gives way when it would take more than this many budget_s
SAMPLE_S = 0.05  # target seconds of one batched sample of the dense peak
MAX_BATCH = 1000


def plan_reps(seconds_per_call: float, reps: int, min_reps: int, budget_s: float) -> int:
  """Timed calls: reps, or as many as fit in budget_s but at least min_reps, or, when min_reps
  calls would take more than HARD_CAP * budget_s, as many as fit in that (at least one)."""
  if seconds_per_call <= 0:
    return reps
  fit = int(budget_s / seconds_per_call)
  floor = min(min_reps, reps, max(1, int(HARD_CAP * budget_s / seconds_per_call)))
  return max(min(reps, fit), floor)


def repeat(run_once: Callable[[int], float], *, n_sets: int, warmup: int, reps: int,
           min_reps: int, budget_s: float, warmup_s: float = 0.0,
           prior_s: float | None = None,
           on_timed: Callable[[], None] | None = None) -> tuple[list[float], dict]:
  """Warm-up calls of run_once(i) (which runs input set i, synchronises, and returns its
  seconds), then a planned number of timed ones. prior_s: seconds of the first call, which the
  caller made (for checksums); it may include one-time work (kernel loading, cuBLAS handles),
  so it neither counts as warm-up time nor sets the number of timed calls, unless no warm-up
  is asked for. on_timed() runs once between the warm-up and the timed calls (clocks.sampling's
  mark). Returns (timed seconds, how they were taken; warmup_calls includes the first, and
  timed_calls counts the calls after on_timed)."""
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
    out = call(i)
    sync(out)
    seconds = time.perf_counter() - start
    del out
    return seconds

  return run_once


def batched(call: Callable[[int], object], sync: Callable[[object], None], *, n_sets: int,
            warmup_s: float, reps: int, min_reps: int, budget_s: float,
            sample_s: float = SAMPLE_S, max_in_flight: int = 0,
            on_timed: Callable[[], None] | None = None) -> tuple[list[float], dict]:
  """Seconds per call of back-to-back calls: call(i) only enqueues work on input set i;
  sync(out) waits for it (and, the device running its queue in order, for every call before).
  Warm-up runs batches of calls until warmup_s seconds have passed (one call at least); then
  each timed sample is one batch of about sample_s seconds, synchronised once at its end, and,
  with max_in_flight > 0, on each call max_in_flight calls back before the next is dispatched.
  on_timed() runs once between the warm-up and the timed samples, as in repeat()."""

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
  seconds = []
  for _ in range(n):
    seconds.append(run_batch(calls, size))
    calls += size
  return seconds, {"warmup_calls": calls - n * size, "warmup_s": round(warm_s, 4),
                   "reps_asked": reps, "calls_per_sample": size, "sample_s": sample_s,
                   "timed_calls": n * size}


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
