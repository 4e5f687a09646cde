"""A job in a worker process: the dense-matmul peak, or one implementation's modes on one shape.

`python -m mok_jax.bench.jobs JOB.json EVENTS.jsonl` appends each event (a stage, or a mode's
record) to EVENTS as it happens, so that the runner times out each mode on its own. A fresh
process gives a job its own peak-memory counter (JAX cannot reset one), keeps a crash or a
poisoned CUDA context to its own modes, and PyTorch off JAX's preallocated pool.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

import mok_jax
from mok_jax import expert_parallel, ops
from mok_jax.bench import inputs, timing, torch_peer
from mok_jax.bench.shapes import RUNS_AT, Shape, dtype_for
from mok_jax.bench.timing import failure, record, stage

PEAK_N_GPU, PEAK_N_CPU = 8192, 1024  # 8192^3 saturates an H100 or H200
JNP = {"bf16": jnp.bfloat16, "f32": jnp.float32}


class Unavailable(Exception):
  """The implementation cannot run here; str(self) says why (the record's reason)."""


def iter_job(job: dict):
  """The job's events as they happen; every mode gets a record unless the process dies."""
  done = []
  try:
    source = (torch_peer.run(job) if job["impl"].startswith("torch.") else
              _peak(job) if job["kind"] == "peak" else _moe(job))
    for event in source:
      if event["event"] == "record":
        done.append(event["record"]["mode"])
      yield event
  except Exception as exc:  # pylint: disable=broad-except
    for mode in (m for m in job["modes"] if m not in done):
      yield record(dict(mode=mode, **failure(exc), detail=traceback.format_exc()[-2000:]))


def _device() -> dict:
  return {"platform": jax.default_backend(), "name": jax.devices()[0].device_kind}


def _peak_bytes():
  try:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  except Exception:  # pylint: disable=broad-except
    return None


def _peak(job: dict):
  """n^3 jnp.dot, back to back: the ceiling of % peak. N(0, 1) inputs: all-zero operands would
  draw less power and clock higher than any real GEMM."""
  device = _device()
  dtype = dtype_for(device["platform"], job["run_precision"])
  n = job["peak_n"] or (PEAK_N_GPU if device["platform"] == "gpu" else PEAK_N_CPU)
  raw = {"mode": "dense", "n": n, "dtype": dtype, "flops": 2 * n ** 3}
  try:
    yield stage("dense", "building inputs")
    keys = jax.random.split(jax.random.key(job["seed"]), 2 * job["sets"])
    make = jax.jit(lambda key: jax.random.normal(key, (n, n), jnp.float32).astype(JNP[dtype]))
    pairs = jax.block_until_ready([(make(a), make(b)) for a, b in keys.reshape(-1, 2)])
    yield stage("dense", "compiling")
    t0 = time.perf_counter()
    compiled = jax.jit(jnp.dot).lower(*pairs[0]).compile()
    raw["compile_s"] = time.perf_counter() - t0
    yield stage("dense", "warm-up and timing")
    seconds, how = timing.batched(lambda i: compiled(*pairs[i]), jax.block_until_ready,
                                  n_sets=job["sets"], warmup_s=job["peak_warmup_s"],
                                  **{k: job[k] for k in ("reps", "min_reps", "budget_s")})
    raw.update(status="ok", ms=timing.summarize(seconds), timing=how)
  except Exception as exc:  # pylint: disable=broad-except
    raw.update(failure(exc))
  yield record(raw, device)


def ep_bytes(shape: Shape, ep: int, b: int, experts, ragged: bool) -> dict:
  """Bytes a device sends the others a call under --ep, the mean over devices: token rows, ids
  and weights out, route outputs back; then dy out, dx and dweights back. ragged (GPUs): only
  its routes to other devices' experts; else (XLA:CPU) whole blocks of T k rows to each."""
  T, H, k = shape.T, shape.H, shape.k
  if ragged:  # the rows the layer's own send layout puts in the other devices' blocks
    ids = np.asarray(experts).reshape(ep, T, k)
    sent = [np.asarray(expert_parallel.plan(ids[d], shape.E // ep, ep, T * k).sent)
            for d in range(ep)]
    rows = float(np.mean([s.sum() - s[d] for d, s in enumerate(sent)]))
  else:
    rows = (ep - 1) * T * k
  fwd = rows * (2 * H * b + 8)
  return {"fwd": fwd, "fwd+bwd": fwd + rows * (2 * H * b + 4)}


def _moe(job: dict):
  device = _device()
  dtype = dtype_for(device["platform"], job["run_precision"])
  shape, ep, modes = Shape(**job["shape"]), job["ep"], job["modes"]
  common = {"dtype": dtype}
  try:
    layer = jax_layer(job["impl"], shape, JNP[dtype], ep, job["ep_transport"], job["precision"])
    unavailable = {"fwd+bwd": "tokamax's quantized ragged_dot is timed forward only: it "
                   "differentiates arrays, not the qwix.QArray operands of its quantized path"} if (
        job["impl"], job["precision"]) == ("tokamax.ragged_dot", "fp8") else {}
  except Unavailable as exc:
    unavailable = dict.fromkeys(modes, str(exc))
  yield from (record(dict(mode=m, status="unavailable", reason=unavailable[m], **common), device)
              for m in modes if m in unavailable)
  if not (modes := [m for m in modes if m not in unavailable]):
    return
  yield stage(modes[0], "building inputs")
  params, sets = inputs.jax_inputs(dataclasses.replace(shape, T=shape.T * ep), JNP[dtype],
                                   job["seed"], job["skew"], job["sets"])  # T per device
  common["load"] = inputs.load_stats(sets[0][1], shape.E)
  if job["impl"].startswith("mok_jax:") and job["precision"] != "bf16":
    yield stage(modes[0], "quantizing the expert weights")
    params, common["quantize_ms"] = _quantized(params, job["precision"])
  if ep > 1:
    ragged = device["platform"] not in expert_parallel.DENSE_PLATFORMS
    common["ep_bytes"] = ep_bytes(shape, ep, jnp.dtype(JNP[dtype]).itemsize, sets[0][1], ragged)
  for mode in modes:
    raw = dict(mode=mode, **common)
    raw.update((yield from timing.measure(
        mode, job, lambda: _compiled(layer, mode, params, sets), jax.block_until_ready,
        _abs_sums, _peak_bytes)))
    raw.setdefault("peak_mem_bytes", _peak_bytes())  # a failed mode: the peak as it stands
    gc.collect()
    yield record(raw, device)


def _quantized(params, recipe: str):
  """The expert weights quantized once, as a training step does for its micro-batches
  (mok_jax.quantize_experts), and the ms of one such quantization after a first."""
  quantize = jax.jit(functools.partial(mok_jax.quantize_experts, recipe=recipe))
  jax.block_until_ready(quantize(*params))
  t0 = time.perf_counter()
  quantized = jax.block_until_ready(quantize(*params))
  return quantized, 1e3 * (time.perf_counter() - t0)


def _compiled(layer, mode: str, params, sets):
  """(call(i): the mode's compiled step on input set i, the compile's seconds). Quantized
  weights are differentiated w.r.t. their masters, as quantize_experts' user does."""

  def step(x, experts, weights, dy, *w):
    swap = lambda q, m: dataclasses.replace(q, master=m) if hasattr(q, "master") else m
    f = lambda x, weights, *m: layer(x, experts, weights, *map(swap, w, m))
    masters = [getattr(q, "master", q) for q in w]
    if mode == "fwd":
      return f(x, weights, *masters)
    y, pull = jax.vjp(f, x, weights, *masters)
    return y, pull(dy)

  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(*sets[0], *params).compile()
  return (lambda i: compiled(*sets[i], *params)), time.perf_counter() - t0


# sum |.| in f32, one jitted reduction an array: no f32 copy of a gradient is made.
_abs_sums = jax.jit(lambda out: [jnp.sum(jnp.abs(a.astype(jnp.float32)))
                                 for a in jax.tree.leaves(out)])


def jax_layer(name: str, shape: Shape, dtype, ep: int = 1, ep_transport: str = "auto",
              precision: str = "bf16"):
  """layer(x, experts, weights, w_gate, w_up, w_down) -> y, as mok_jax.moe at `precision`, or
  raises Unavailable. ep > 1, or an ep_transport other than "auto": mok_jax's layer in shard_map
  over ep devices, tokens and experts split, its rows moved by ep_transport."""
  routed = ep > 1 or ep_transport != "auto"
  if precision not in RUNS_AT[name]:
    raise Unavailable(f"{name} runs at {', '.join(RUNS_AT[name])} only")
  if not name.startswith("mok_jax:"):
    if routed:
      raise Unavailable("no expert parallelism in this implementation")
    return _peer(name, precision)
  backend, platform = name.split(":", 1)[1], jax.default_backend()
  config = mok_jax.Config(ep_transport=ep_transport, precision=precision)
  dims = ops.MoeDims(shape.T, shape.H, shape.I, shape.E, shape.k, 0)
  reason = None
  if backend == "cuda" or (backend == "ffi" and platform != "cpu"):
    reason = ops.cuda_unsupported_reason(platform, dtype, dims, config)
  elif backend == "ffi" and precision != "bf16":  # the C++ target, in the FP8 kernels' bounds
    reason = ops.fp8_unsupported_reason(dtype, dims, config)
  if reason:
    raise Unavailable(reason)
  layer = lambda *args: mok_jax.moe(*args, backend=backend, axis_name="ep" * routed or None,
                                    config=config)
  if not routed:
    return layer
  if len(jax.devices()) < ep:
    raise Unavailable(f"--ep {ep} needs {ep} devices, found {len(jax.devices())}")
  if shape.E % ep:
    raise Unavailable(f"--ep {ep} does not divide the {shape.E} experts")
  mesh = jax.make_mesh((ep,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
  split = PartitionSpec("ep")  # every argument and y: tokens and experts
  return jax.shard_map(layer, mesh=mesh, in_specs=split, out_specs=split)


def _peer(name: str, precision: str):
  """mok_jax's xla layer with its grouped matmul swapped for the peer's, as a user of the peer
  writes the layer: jax.lax.ragged_dot, or tokamax.ragged_dot letting tokamax pick its kernel, at
  fp8 on qwix.QArray operands made in the call (e4m3, a scale a row and a weights' column)."""
  grouped = jax.lax.ragged_dot
  if name == "tokamax.ragged_dot":
    try:
      import tokamax  # pylint: disable=import-outside-toplevel
      if precision == "fp8":
        import qwix  # pylint: disable=import-outside-toplevel  # tokamax's quantized operands
    except Exception as exc:  # pylint: disable=broad-except  # SyntaxError on Python < 3.12, ...
      raise Unavailable(f"import tokamax failed: {failure(exc)['reason']}") from None
    grouped = tokamax.ragged_dot
  if precision == "fp8":
    e4m3 = lambda a, axes: qwix.quantize(a, jnp.float8_e4m3fn, channelwise_axes=axes)
    grouped = lambda lhs, rhs, **kwargs: tokamax.ragged_dot(e4m3(lhs, (0,)), e4m3(rhs, (0, 2)),
                                                            **kwargs)

  def ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None, **kwargs):
    # The product in the operands' dtype, widened after: tokamax's backward rejects a cotangent
    # of another dtype, and jax.lax.ragged_dot's f32 products run at half the rate.
    out = grouped(lhs, rhs, group_sizes=group_sizes, **kwargs)
    return out if preferred_element_type is None else out.astype(preferred_element_type)

  pieces = expert_parallel.XlaPieces(ragged_dot=ragged_dot)
  return lambda *args: expert_parallel.routed_moe(*args, None, pieces=pieces, axis_name=None,
                                                  config=mok_jax.Config())


def main(argv: list[str]) -> None:
  job_path, events_path = argv
  with open(job_path) as f:
    job = json.load(f)
  with open(events_path, "a") as out:
    for event in iter_job(job):
      print(json.dumps(event), file=out, flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
