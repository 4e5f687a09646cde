"""One benchmark job: the dense-matmul peak, or one implementation on one shape (every mode).

`run_job(job)` runs in the calling process; `python -m mok_jax.bench.jobs JOB.json RESULT.json`
runs it in a fresh process (the default on a GPU), so that each job gets its own peak-memory
counter (JAX cannot reset one), a crash or a poisoned CUDA context takes down only its own row,
and PyTorch never shares a GPU with JAX's preallocated pool.

A job is a dict: kind ("peak" | "moe"), impl, shape (Shape fields), modes, dtype ("auto" |
"bf16" | "f32"), seed, skew, sets, warmup, reps, min_reps, budget_s, peak_n (None: by
platform). The result is {"device": {...}, "records": [one dict per mode], "wall_s",
"env_vars"}; a record holds status ("ok", "oom", "error", "unavailable") and, when ok, ms
(median, min, max, p25, p75, mean, n), compile_s and the output's checksums. Whatever fails is
caught and becomes a record with its reason.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from mok_jax.bench import env, inputs, peers, timing
from mok_jax.bench.shapes import Shape

DTYPES = ("auto", "bf16", "f32")
# Dense peak sizes when the job leaves peak_n to the platform: 8192^3 saturates an H100/H200
# (about 1.4 ms in bf16); on a CPU that would take tens of seconds a call.
PEAK_N_GPU, PEAK_N_CPU = 8192, 1024


def resolve_dtype(name: str, platform: str) -> str:
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
  if name == "auto":
    return "bf16" if platform == "gpu" else "f32"
  return name


def _jnp_dtype(name: str):
  return {"bf16": jnp.bfloat16, "f32": jnp.float32}[name]


def finite_or_text(value: float):
  """JSON has no NaN or inf: keep those as text so that the file stays standard JSON."""
  return value if math.isfinite(value) else str(value)


def failed(modes, status: str, reason: str, **extra) -> list[dict]:
  return [dict(mode=mode, status=status, reason=reason, **extra) for mode in modes]


def run_job(job: dict) -> dict:
  start = time.perf_counter()
  try:
    if job["impl"] == "torch._grouped_mm":
      from mok_jax.bench import torch_peer  # pylint: disable=import-outside-toplevel

      result = torch_peer.run(job)
    elif job["kind"] == "peak":
      result = _run_peak(job)
    else:
      result = _run_jax_moe(job)
  except Exception as exc:  # pylint: disable=broad-except
    modes = job.get("modes", ["dense"])
    result = {"device": None, "records": failed(
        modes, peers.failure_status(exc), peers.describe_exception(exc),
        detail=traceback.format_exc()[-2000:])}
  result["wall_s"] = time.perf_counter() - start
  result["env_vars"] = {k: os.environ[k] for k in env.ENV_VARS if k in os.environ}
  return result


def _jax_device_and_dtype(job):
  device = env.jax_device()
  return device, resolve_dtype(job["dtype"], device["platform"])


def _peak_bytes():
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return stats.get("peak_bytes_in_use") if stats else None


def _repeat(job, call):
  run_once = timing.wall_clock(call, jax.block_until_ready)
  return timing.repeat(run_once, n_sets=job["sets"], warmup=job["warmup"], reps=job["reps"],
                       min_reps=job["min_reps"], budget_s=job["budget_s"])


def _run_peak(job: dict) -> dict:
  """Dense n^3 matmul (jnp.dot under jit) in the benchmark's dtype: the ceiling for % of peak."""
  device, dtype = _jax_device_and_dtype(job)
  n = job["peak_n"] or (PEAK_N_GPU if device["platform"] == "gpu" else PEAK_N_CPU)
  record = {"mode": "dense", "n": n, "dtype": dtype, "flops": 2 * n ** 3}
  try:
    keys = jax.random.split(jax.random.key(job["seed"]), 2 * job["sets"])
    make = jax.jit(lambda key: jax.random.normal(key, (n, n), jnp.float32).astype(
        _jnp_dtype(dtype)))
    sets = [(make(keys[2 * i]), make(keys[2 * i + 1])) for i in range(job["sets"])]
    t0 = time.perf_counter()
    compiled = jax.jit(jnp.dot).lower(*sets[0]).compile()
    record["compile_s"] = time.perf_counter() - t0
    seconds = _repeat(job, lambda i: compiled(*sets[i]))
    record.update(status="ok", ms=timing.summarize(seconds))
  except Exception as exc:  # pylint: disable=broad-except
    record.update(status=peers.failure_status(exc), reason=peers.describe_exception(exc))
  return {"device": device, "records": [record]}


def _run_jax_moe(job: dict) -> dict:
  device, dtype = _jax_device_and_dtype(job)
  shape = Shape(**job["shape"])
  modes = job["modes"]
  common = {"dtype": dtype}
  try:
    layer, note = peers.jax_layer(job["impl"], shape, _jnp_dtype(dtype))
  except peers.Unavailable as exc:
    return {"device": device, "records": failed(modes, "unavailable", str(exc), **common)}
  except Exception as exc:  # pylint: disable=broad-except
    return {"device": device, "records": failed(modes, peers.failure_status(exc),
                                                peers.describe_exception(exc), **common)}
  try:
    params, sets = inputs.jax_inputs(shape, _jnp_dtype(dtype), job["seed"], job["skew"],
                                     job["sets"])
  except Exception as exc:  # pylint: disable=broad-except
    return {"device": device, "records": failed(
        modes, peers.failure_status(exc), "building inputs: " + peers.describe_exception(exc),
        **common)}
  common["load"] = inputs.load_stats(sets[0][1], shape.E)
  records = []
  for mode in modes:
    record = dict(mode=mode, note=note.get(mode) if isinstance(note, dict) else note, **common)
    record.update(_time_jax_mode(job, layer, params, sets, mode))
    record["peak_mem_bytes"] = _peak_bytes()
    records.append(record)
    gc.collect()
  return {"device": device, "records": records}


def _time_jax_mode(job, layer, params, sets, mode) -> dict:
  w_gate, w_up, w_down, shared = params

  if mode == "fwd":
    def step(x, experts, weights, dy, w_gate, w_up, w_down, shared):
      del dy
      return layer(x, experts, weights, w_gate, w_up, w_down, shared)
  elif mode == "fwd+bwd":
    def step(x, experts, weights, dy, w_gate, w_up, w_down, shared):
      def f(x, weights, w_gate, w_up, w_down, shared):
        return layer(x, experts, weights, w_gate, w_up, w_down, shared)

      y, pull = jax.vjp(f, x, weights, w_gate, w_up, w_down, shared)
      return y, pull(dy)
  else:
    raise ValueError(f"unknown mode {mode!r}")

  def args(i):
    return (*sets[i], w_gate, w_up, w_down, shared)

  try:
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args(0)).compile()
    compile_s = time.perf_counter() - t0
    first = compiled(*args(0))
    jax.block_until_ready(first)
    check = _checksums(first, mode)
    del first
    seconds = _repeat(job, lambda i: compiled(*args(i)))
  except Exception as exc:  # pylint: disable=broad-except
    return {"status": peers.failure_status(exc), "reason": peers.describe_exception(exc)}
  return {"status": "ok", "ms": timing.summarize(seconds), "compile_s": compile_s,
          "check": check}


def _checksums(out, mode) -> dict:
  """sum |.| of the output (and of every gradient) in f32: the report compares them across
  implementations that ran on the same inputs, to catch one that computes something else.
  One jitted reduction per array: no f32 copy of a gradient is ever materialised."""
  sums = jax.jit(lambda tree: jax.tree.map(
      lambda a: jnp.sum(jnp.abs(a.astype(jnp.float32))), tree))(out)
  if mode == "fwd":
    return {"y": finite_or_text(float(sums))}
  y, (dx, dweights, dw_gate, dw_up, dw_down, dshared) = sums
  named = {"y": y, "dx": dx, "dweights": dweights, "dw_gate": dw_gate, "dw_up": dw_up,
           "dw_down": dw_down}
  if dshared is not None:
    named["dws"] = sum(dshared)
  return {name: finite_or_text(float(value)) for name, value in named.items()}


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("usage: python -m mok_jax.bench.jobs JOB.json RESULT.json", file=sys.stderr)
    return 2
  with open(argv[0]) as f:
    job = json.load(f)
  result = run_job(job)
  with open(argv[1], "w") as f:
    json.dump(result, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
