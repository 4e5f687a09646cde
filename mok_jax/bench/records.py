"""What the workers (jobs.py, torch_peer.py) share: dtype names, failures and their records,
stage events, the variables recorded with a run, and the back-to-back figure of a mode."""

from __future__ import annotations

import math
import os
import time

from mok_jax.bench import clocks, timing

DTYPES = ("auto", "bf16", "f32")
# Variables that change what the benchmark measures.
ENV_VARS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")
# Seconds of calls in one back-to-back sample. At the dense peak's 50 ms a sample would hold one
# or two forward+backward calls of mixtral and dsv3 (22.5-40 ms on an H200), which would still
# pay a synchronisation every call or two; at 250 ms every shape gets 6-86 calls a sample.
B2B_SAMPLE_S = 0.25
CHECK_NAMES = ("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down")  # then "dws": shared's


def resolve_dtype(name: str, platform: str) -> str:
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
  return ("bf16" if platform == "gpu" else "f32") if name == "auto" else name


def env_vars() -> dict:
  return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


def checks(sums) -> dict:
  """The sum |.| of the output, then of each gradient, by CHECK_NAMES; NaN and inf as text,
  which JSON has no number for."""
  sums = [float(v) for v in sums]
  named = dict(zip(CHECK_NAMES, sums), **({"dws": sum(sums[6:])} if sums[6:] else {}))
  return {name: v if math.isfinite(v) else str(v) for name, v in named.items()}


def failure(exc: BaseException, limit: int = 400) -> dict:
  text = " ".join(f"{type(exc).__name__}: {exc}".split())
  oom = "RESOURCE_EXHAUSTED" in text or "OutOfMemory" in text or "out of memory" in text.lower()
  return {"status": "oom" if oom else "error",
          "reason": text if len(text) <= limit else text[:limit - 3] + "..."}


def failed(modes, status: str, reason: str, **extra) -> list[dict]:
  return [dict(mode=mode, status=status, reason=reason, **extra) for mode in modes]


def stage(mode: str, text: str) -> dict:
  return {"event": "stage", "mode": mode, "stage": text}


def timed(run_once, job: dict, prior_s: float) -> tuple[list[float], dict, dict]:
  """timing.repeat with the job's knobs, and {"gpu": the clocks meanwhile} where sampled."""
  gpu = {}
  with clocks.sampling(gpu, "gpu") as mark:
    seconds, how = timing.repeat(run_once, n_sets=job["sets"], warmup=job["warmup"],
                                 warmup_s=job["warmup_s"], reps=job["reps"],
                                 min_reps=job["min_reps"], budget_s=job["budget_s"],
                                 prior_s=prior_s, on_timed=mark)
  return seconds, how, gpu


def measure(mode: str, job: dict, prepare, sync, sums, peak_bytes, run_once=None):
  """Yields stage events; returns the mode's figures or its failure. prepare() -> (call,
  compile_s or None): call(i) runs input set i, sync(out) waits for that call alone. A first
  call, checksummed (sums(out): records.checks' values), the timing a synchronised call at a
  time (run_once; by default the host's clock around call and sync), the peak memory, then back
  to back, which holds two calls' buffers."""
  try:
    yield stage(mode, "compiling")
    call, compile_s = prepare()
    yield stage(mode, "first call")
    t0 = time.perf_counter()
    first = call(0)
    sync(first)
    first_s = time.perf_counter() - t0
    check = checks(sums(first))
    del first
    yield stage(mode, f"warm-up and timing (first call {first_s * 1e3:.1f} ms)")
    seconds, how, gpu = timed(run_once or timing.wall_clock(call, sync), job, first_s)
    peak = peak_bytes()
    yield stage(mode, "back-to-back timing")
    b2b = back_to_back(call, sync, job)
  except Exception as exc:  # pylint: disable=broad-except
    return failure(exc)
  # Without a compile (eager PyTorch), compile_s is the first call's (kernels, cuBLAS setup).
  return {"status": "ok", "ms": timing.summarize(seconds), "timing": how,
          "compile_s": first_s if compile_s is None else compile_s, "check": check,
          "peak_mem_bytes": peak, **gpu, **b2b}


def back_to_back(call, sync, job: dict) -> dict:
  """The mode's call timed as the dense peak is (timing.batched), after its one synchronised
  call at a time: the per-call figure includes the framework's dispatch and sync latency, which
  layers running back to back in a training step do not pay one by one. sync(out) must wait for
  that call alone: two calls in flight hold two forwards' buffers, under what fwd+bwd, which
  runs after it in the same process and reports the peak memory, needs itself. Half the mode's
  budget, on top of its own timing under the same --mode-timeout. {"ms_b2b", "timing_b2b",
  "gpu_b2b"}, or {"b2b_status", "b2b_reason"} (the mode's own figures stand)."""
  found = {}
  try:
    with clocks.sampling(found, "gpu_b2b") as mark:
      seconds, how = timing.batched(call, sync, n_sets=job["sets"], warmup_s=0.0,
                                    reps=job["reps"], min_reps=min(3, job["min_reps"]),
                                    budget_s=job["budget_s"] / 2, sample_s=B2B_SAMPLE_S,
                                    max_in_flight=2, on_timed=mark)
  except Exception as exc:  # pylint: disable=broad-except
    return {f"b2b_{key}": value for key, value in failure(exc).items()}
  return {"ms_b2b": timing.summarize(seconds), "timing_b2b": how, **found}
