"""How a mode is timed in any framework: the repetition loops and their summary (which
tools/ab/measure.py uses too), and `measure`, a mode's figures as a worker records them."""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Callable

# A slow peer's mode costs at most about compile + (WARMUP_CAP + HARD_CAP) * budget_s + 3 calls.
WARMUP_CAP = 0.5
HARD_CAP = 3.0
SAMPLE_S = 0.05
MAX_BATCH = 1000
# Seconds of calls in a back-to-back sample of a mode: at SAMPLE_S the largest shapes'
# forward+backward would still sync every call or two.
B2B_SAMPLE_S = 0.25
CHECK_NAMES = ("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down")


def plan_reps(seconds_per_call: float, reps: int, min_reps: int, budget_s: float) -> int:
  """reps cut to fit budget_s, not below min_reps unless that takes HARD_CAP budgets."""
  if seconds_per_call <= 0:
    return reps
  floor = min(min_reps, reps, max(1, int(HARD_CAP * budget_s / seconds_per_call)))
  return max(min(reps, int(budget_s / seconds_per_call)), floor)


def repeat(run_once: Callable[[int], float], *, n_sets: int, warmup: int, reps: int,
           min_reps: int, budget_s: float, warmup_s: float = 0.0, prior_s: float | None = None,
           on_timed: Callable[[], None] | None = None) -> tuple[list[float], dict]:
  """A synchronised call a sample: run_once(i) runs input set i (each call the next of a few, so
  that none re-reads what the last left in L2), synchronises and returns its seconds. Warm-up
  stops within WARMUP_CAP budgets. prior_s: the caller's first call, which may hold one-time work
  (kernel loading, cuBLAS handles), so it neither counts as warm-up nor plans the reps unless no
  warm-up runs. on_timed() runs just before the timed calls (tools/ab/clocks.py's mark)."""
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
  """Back-to-back calls, a sync per sample of about sample_s, so that no dispatch or sync latency
  sits between two calls: call(i) only enqueues work on set i; sync(out) waits for it and, the
  device running its queue in order, for every call before it. max_in_flight bounds the calls'
  memory while the device always has the next one queued. Seconds a call of each sample."""

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

  def quantile(q: float) -> float:
    pos = q * (len(ms) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

  return {"median": statistics.median(ms), "min": ms[0], "max": ms[-1], "p25": quantile(0.25),
          "p75": quantile(0.75), "mean": statistics.fmean(ms), "n": len(ms)}


def stage(mode: str, text: str) -> dict:
  return {"event": "stage", "mode": mode, "stage": text}


def record(raw: dict, device: dict | None = None) -> dict:
  """A mode's record as a worker's event; device: {"platform", "name"} of the worker's."""
  return {"event": "record", "record": raw, "device": device}


def failure(exc: BaseException, limit: int = 400) -> dict:
  text = " ".join(f"{type(exc).__name__}: {exc}".split())
  oom = "RESOURCE_EXHAUSTED" in text or "OutOfMemory" in text or "out of memory" in text.lower()
  return {"status": "oom" if oom else "error",
          "reason": text if len(text) <= limit else text[:limit - 3] + "..."}


def measure(mode: str, job: dict, prepare, sync, sums, peak_bytes, run_once=None):
  """Yields stage events; returns the mode's figures or its failure. prepare() -> (call,
  compile_s or None): call(i) runs input set i, sync(out) waits for that call alone. A first
  call, checksummed (sums(out): sum |.| of the output, then of each gradient, by CHECK_NAMES),
  the timing a synchronised call at a time (run_once; by default the host's clock around call
  and sync), the peak memory, then back to back, which holds two calls' buffers."""
  try:
    yield stage(mode, "compiling")
    call, compile_s = prepare()
    yield stage(mode, "first call")
    t0 = time.perf_counter()
    sync(first := call(0))
    first_s = time.perf_counter() - t0
    got = [float(v) for v in sums(first)]
    del first
    yield stage(mode, f"warm-up and timing (first call {first_s * 1e3:.1f} ms)")
    seconds, how = repeat(run_once or wall_clock(call, sync), n_sets=job["sets"],
                          warmup=job["warmup"], warmup_s=job["warmup_s"], reps=job["reps"],
                          min_reps=job["min_reps"], budget_s=job["budget_s"], prior_s=first_s)
    peak = peak_bytes()
    yield stage(mode, "back-to-back timing")
    b2b = back_to_back(call, sync, job)
  except Exception as exc:  # pylint: disable=broad-except
    return failure(exc)
  # Without a compile (eager PyTorch), compile_s is the first call's (kernels, cuBLAS setup).
  # NaN and inf as text, which JSON has no number for.
  return {"status": "ok", "ms": summarize(seconds), "timing": how,
          "compile_s": first_s if compile_s is None else compile_s, "peak_mem_bytes": peak,
          "check": {k: v if math.isfinite(v) else str(v) for k, v in zip(CHECK_NAMES, got)},
          **b2b}


def back_to_back(call, sync, job: dict) -> dict:
  """The mode timed as the dense peak is (batched), on half its budget: without the dispatch and
  sync latency that a call at a time pays and layers back to back in a training step do not.
  Two calls in flight hold two forwards' buffers, under what fwd+bwd needs itself, so sync(out)
  must wait for that call alone. {"ms_b2b", "timing_b2b"}, or {"b2b_status", "b2b_reason"}:
  the mode's other figures stand."""
  try:
    seconds, how = batched(call, sync, n_sets=job["sets"], warmup_s=0.0, reps=job["reps"],
                           min_reps=min(3, job["min_reps"]), budget_s=job["budget_s"] / 2,
                           sample_s=B2B_SAMPLE_S, max_in_flight=2)
  except Exception as exc:  # pylint: disable=broad-except
    return {f"b2b_{key}": value for key, value in failure(exc).items()}
  return {"ms_b2b": summarize(seconds), "timing_b2b": how}
