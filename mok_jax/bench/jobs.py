"""One benchmark job: the dense-matmul peak, one implementation on one shape (its modes in
order), or the stage breakdown of the CUDA forward on one shape (its variants as modes).

`iter_job(job)` yields the job's events as they happen: {"event": "stage", "mode", "stage"} when
a mode enters a stage (building inputs, compiling, first call, warm-up and timing), and
{"event": "record", "record", "device", "wall_s", "env_vars"} as soon as a mode has its result.
`python -m mok_jax.bench.jobs JOB.json EVENTS.jsonl` runs it in a fresh process (the default on
a GPU) and appends each event to EVENTS.jsonl, flushed, the moment it happens: the runner reads
them as they come, applies its timeout to each mode on its own, and keeps the modes that
finished when a later one hangs, runs out of memory or kills the process. A fresh process per
job gives it its own peak-memory counter (JAX cannot reset one), lets a crash or a poisoned
CUDA context take down only its own modes, and keeps PyTorch off JAX's preallocated pool.

A job is a dict: kind ("peak" | "moe" | "breakdown"), impl, shape (Shape fields), modes, dtype
("auto" | "bf16" | "f32"), seed, skew, ep, sets, warmup, warmup_s, reps, min_reps, budget_s, peak_n
(None: by platform), peak_warmup_s; a breakdown's modes are shapes.breakdown_modes (the forward,
then the forward with stages left out). A record holds mode, status ("ok", "oom",
"error", "unavailable") and, when ok, ms (median, min, max, p25, p75, mean, n), timing (how the
samples were taken), compile_s and (but for a breakdown, whose skipping modes compute wrong
results) the output's checksums; an MoE mode also ms_b2b and timing_b2b, the same call timed
back to back (records.back_to_back), or b2b_status and b2b_reason when that failed. Whatever
fails is caught and becomes a record with its reason.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from mok_jax.bench import clocks, env, inputs, peers, timing
from mok_jax.bench.records import back_to_back, failed, finite_or_text, resolve_dtype, stage
from mok_jax.bench.shapes import SKIP_ENV, Shape, breakdown_variant

# Dense peak sizes when the job leaves peak_n to the platform: 8192^3 saturates an H100/H200
# (about 1.4 ms in bf16); on a CPU that would take tens of seconds a call.
PEAK_N_GPU, PEAK_N_CPU = 8192, 1024
# Defaults of the knobs a job dict written by an older runner may lack.
JOB_DEFAULTS = {"warmup_s": 0.0, "peak_warmup_s": 0.0, "ep": 1}


def _jnp_dtype(name: str):
  return {"bf16": jnp.bfloat16, "f32": jnp.float32}[name]


def _record_event(raw: dict, device: dict | None) -> dict:
  return {"event": "record", "record": raw, "device": device}


def _env_vars() -> dict:
  return {k: os.environ[k] for k in env.ENV_VARS if k in os.environ}


def iter_job(job: dict):
  """The job's events, each as it happens (see the module's docstring); every mode of the job
  gets exactly one record event, in order, unless the process dies."""
  job = {**JOB_DEFAULTS, **job}
  modes = list(job.get("modes") or ["dense"])
  start = time.perf_counter()
  done = []
  try:
    if job["impl"] == "torch._grouped_mm" and job["ep"] > 1:
      source = iter([_record_event(raw, None) for raw in failed(
          modes, "unavailable", "no expert parallelism in this implementation")])
    elif job["impl"] == "torch._grouped_mm":
      from mok_jax.bench import torch_peer  # pylint: disable=import-outside-toplevel

      source = torch_peer.run(job)
    elif job["kind"] == "peak":
      source = _run_peak(job)
    elif job["kind"] == "breakdown":
      source = _run_breakdown(job)
    else:
      source = _run_jax_moe(job)
    for event in source:
      if event["event"] == "record":
        done.append(event["record"]["mode"])
        event = dict(event, wall_s=time.perf_counter() - start, env_vars=_env_vars())
      yield event
  except Exception as exc:  # pylint: disable=broad-except
    detail = traceback.format_exc()[-2000:]
    for raw in failed([m for m in modes if m not in done], peers.failure_status(exc),
                      peers.describe_exception(exc), detail=detail):
      yield dict(_record_event(raw, None), wall_s=time.perf_counter() - start,
                 env_vars=_env_vars())


def _jax_device_and_dtype(job):
  device = env.jax_device()
  return device, resolve_dtype(job["dtype"], device["platform"])


def _peak_bytes():
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return stats.get("peak_bytes_in_use") if stats else None


def _run_peak(job: dict):
  """Dense n^3 matmul (jnp.dot under jit) in the benchmark's dtype: the ceiling for % of peak.
  Inputs N(0, 1) (all-zero operands would draw less power and clock higher than any real
  GEMM), rotated over `sets` pairs; timed as back-to-back calls, one synchronisation per sample
  of about timing.SAMPLE_S seconds, after peak_warmup_s seconds of the same (clocks ramped)."""
  device, dtype = _jax_device_and_dtype(job)
  n = job["peak_n"] or (PEAK_N_GPU if device["platform"] == "gpu" else PEAK_N_CPU)
  record = {"mode": "dense", "n": n, "dtype": dtype, "flops": 2 * n ** 3,
            "inputs": "normal(0, 1)", "sets": job["sets"]}
  try:
    yield stage("dense", "building inputs")
    keys = jax.random.split(jax.random.key(job["seed"]), 2 * job["sets"])
    make = jax.jit(lambda key: jax.random.normal(key, (n, n), jnp.float32).astype(
        _jnp_dtype(dtype)))
    sets = [(make(keys[2 * i]), make(keys[2 * i + 1])) for i in range(job["sets"])]
    jax.block_until_ready(sets)
    yield stage("dense", "compiling")
    t0 = time.perf_counter()
    compiled = jax.jit(jnp.dot).lower(*sets[0]).compile()
    record["compile_s"] = time.perf_counter() - t0
    yield stage("dense", "warm-up and timing")
    with clocks.sampling(record, "gpu") as mark:
      seconds, how = timing.batched(lambda i: compiled(*sets[i]), jax.block_until_ready,
                                    n_sets=job["sets"], warmup_s=job["peak_warmup_s"],
                                    reps=job["reps"], min_reps=job["min_reps"],
                                    budget_s=job["budget_s"], on_timed=mark)
    record.update(status="ok", ms=timing.summarize(seconds), timing=how)
  except Exception as exc:  # pylint: disable=broad-except
    record.update(status=peers.failure_status(exc), reason=peers.describe_exception(exc))
  yield _record_event(record, device)


def _prepare(job: dict, device: dict, dtype: str):
  """The job's JAX implementation and inputs, yielding stage events: returns (layer, note,
  params, sets, common record fields), or None after a failed record for every mode."""
  shape = Shape(**job["shape"])
  modes = job["modes"]
  common = {"dtype": dtype}

  def fail_all(status, reason):
    for raw in failed(modes, status, reason, **common):
      yield _record_event(raw, device)

  ep = job["ep"]
  try:
    layer, note = peers.jax_layer(job["impl"], shape, _jnp_dtype(dtype), ep)
  except peers.Unavailable as exc:
    yield from fail_all("unavailable", str(exc))
    return None
  except Exception as exc:  # pylint: disable=broad-except
    yield from fail_all(peers.failure_status(exc), peers.describe_exception(exc))
    return None
  try:
    yield stage(modes[0], "building inputs")
    # Under --ep the shape's T is per device: the layer takes ep T tokens in all.
    params, sets = inputs.jax_inputs(dataclasses.replace(shape, T=shape.T * ep),
                                     _jnp_dtype(dtype), job["seed"], job["skew"], job["sets"])
  except Exception as exc:  # pylint: disable=broad-except
    yield from fail_all(peers.failure_status(exc),
                        "building inputs: " + peers.describe_exception(exc))
    return None
  common["load"] = inputs.load_stats(sets[0][1], shape.E)
  if ep > 1:
    common["ep_bytes"] = ep_bytes(shape, ep, jnp.dtype(_jnp_dtype(dtype)).itemsize)
  return layer, note, params, sets, common


def ep_bytes(shape: Shape, ep: int, b: int) -> dict:
  """Bytes one device sends to the others in a call's all_to_alls under --ep (dropless blocks
  of C = T k rows to each other device): the forward sends token rows, ids and weights out
  and route outputs back; the backward dy out, dx and dweights back."""
  rows = (ep - 1) * shape.T * shape.k
  fwd = rows * (2 * shape.H * b + 8)
  return {"fwd": fwd, "fwd+bwd": fwd + rows * (2 * shape.H * b + 4)}


def _run_jax_moe(job: dict):
  device, dtype = _jax_device_and_dtype(job)
  prepared = yield from _prepare(job, device, dtype)
  if prepared is None:
    return
  layer, note, params, sets, common = prepared
  for mode in job["modes"]:
    record = dict(mode=mode, note=note.get(mode) if isinstance(note, dict) else note, **common)
    record.update((yield from _time_jax_mode(job, layer, params, sets, mode)))
    if "peak_mem_bytes" not in record:  # a failed mode: the peak as it stands
      record["peak_mem_bytes"] = _peak_bytes()
    gc.collect()
    yield _record_event(record, device)


def _run_breakdown(job: dict):
  """The forward as it is (mode "fwd"), then with stages left out (shapes.breakdown_variant):
  SKIP_ENV names them while the mode compiles and runs, and until its record has been handed on
  (so that the record's env_vars show it); the caller's value is restored at the end."""
  device, dtype = _jax_device_and_dtype(job)
  prepared = yield from _prepare(job, device, dtype)
  if prepared is None:
    return
  layer, _, params, sets, common = prepared
  before = os.environ.get(SKIP_ENV)
  try:
    for mode in job["modes"]:
      _set_env(SKIP_ENV, ",".join(breakdown_variant(mode)[1]) or None)
      record = dict(mode=mode, **common)
      record.update((yield from _time_breakdown_mode(job, layer, params, sets, mode)))
      yield _record_event(record, device)
  finally:
    _set_env(SKIP_ENV, before)


def _set_env(name: str, value: str | None):
  if value is None:
    os.environ.pop(name, None)
  else:
    os.environ[name] = value


def _time_breakdown_mode(job, layer, params, sets, mode):
  """Yields stage events; returns the mode's figures (or its failure). Timed as back-to-back
  calls with one sync per sample (timing.batched), as the dense peak: a stage can take tens of
  microseconds, which a sync per call would blur."""
  w_gate, w_up, w_down, shared = params

  # A new function per mode: a fresh trace and compile, nothing cached from another mode
  # (the launcher reads SKIP_ENV on every call anyway).
  def forward(x, experts, weights, dy, w_gate, w_up, w_down, shared):
    del dy
    return layer(x, experts, weights, w_gate, w_up, w_down, shared)

  def args(i):
    return (*sets[i], w_gate, w_up, w_down, shared)

  try:
    yield stage(mode, "compiling")
    t0 = time.perf_counter()
    compiled = jax.jit(forward).lower(*args(0)).compile()
    compile_s = time.perf_counter() - t0
    yield stage(mode, "warm-up and timing")
    seconds, how = timing.batched(lambda i: compiled(*args(i)), jax.block_until_ready,
                                  n_sets=job["sets"], warmup_s=job["warmup_s"],
                                  reps=job["reps"], min_reps=job["min_reps"],
                                  budget_s=job["budget_s"])
  except Exception as exc:  # pylint: disable=broad-except
    return {"status": peers.failure_status(exc), "reason": peers.describe_exception(exc)}
  return {"status": "ok", "ms": timing.summarize(seconds), "timing": how,
          "compile_s": compile_s}


def _time_jax_mode(job, layer, params, sets, mode):
  """Yields stage events; returns the mode's figures (or its failure)."""
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
    yield stage(mode, "compiling")
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args(0)).compile()
    compile_s = time.perf_counter() - t0
    yield stage(mode, "first call")
    t0 = time.perf_counter()
    first = compiled(*args(0))
    jax.block_until_ready(first)
    first_s = time.perf_counter() - t0
    check = _checksums(first, mode)
    del first
    yield stage(mode, f"warm-up and timing (first call {first_s * 1e3:.1f} ms)")
    run_once = timing.wall_clock(lambda i: compiled(*args(i)), jax.block_until_ready)
    gpu = {}
    with clocks.sampling(gpu, "gpu") as mark:
      seconds, how = timing.repeat(run_once, n_sets=job["sets"], warmup=job["warmup"],
                                   warmup_s=job["warmup_s"], reps=job["reps"],
                                   min_reps=job["min_reps"], budget_s=job["budget_s"],
                                   prior_s=first_s, on_timed=mark)
    # Before the back-to-back calls, which hold two calls' buffers at once.
    peak = _peak_bytes()
    yield stage(mode, "back-to-back timing")
    b2b = back_to_back(lambda i: compiled(*args(i)), jax.block_until_ready, job)
  except Exception as exc:  # pylint: disable=broad-except
    return {"status": peers.failure_status(exc), "reason": peers.describe_exception(exc)}
  return {"status": "ok", "ms": timing.summarize(seconds), "timing": how,
          "compile_s": compile_s, "check": check, "peak_mem_bytes": peak, **gpu, **b2b}


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
    print("usage: python -m mok_jax.bench.jobs JOB.json EVENTS.jsonl", file=sys.stderr)
    return 2
  with open(argv[0]) as f:
    job = json.load(f)
  start = time.perf_counter()
  with open(argv[1], "a") as out:
    for event in iter_job(job):
      out.write(json.dumps(event) + "\n")
      out.flush()
      record = event.get("record") or {}
      what = event.get("stage") or " ".join(
          str(record.get(key)) for key in ("status", "reason") if record.get(key))
      print(f"[{time.perf_counter() - start:7.1f} s] {event.get('mode') or record.get('mode')}: "
            f"{what}", flush=True)
    out.write(json.dumps({"event": "end", "wall_s": time.perf_counter() - start}) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
