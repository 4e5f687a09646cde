"""Runs a benchmark's jobs, each in a fresh worker (jobs.py), and makes their records. Nothing
here starts JAX or torch, so the GPU is free for each worker in turn. A mode's --mode-timeout
counts from the previous mode's record (from the worker's start for the first, so that it covers
imports and inputs); past it, or when the worker dies, that mode alone fails, with the stage it
was in, and the modes after it get a new worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import time

from mok_jax.bench import shapes
from mok_jax.bench.shapes import Shape

WORKER = [sys.executable, "-m", "mok_jax.bench.jobs"]  # + JOB.json EVENTS.jsonl
POLL_S = 0.2
PACKAGES = ("mok_jax", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "tokamax",
            "torch", "triton", "numpy")
# The variables that change what a worker measures, recorded with its records.
ENV_VARS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")


@dataclasses.dataclass(frozen=True)
class Options:
  shapes: list[Shape]
  impls: str  # --impls text; "" for the platform's defaults
  modes: list[str]
  knobs: dict  # every job's: seed, skew, ep, ep_transport, run_precision, timing's (__main__.KNOBS)
  mode_timeout_s: float
  log_dir: str  # the workers' logs


def make_job(opts: Options, impl: str, shape: Shape | None, precision: str = "bf16") -> dict:
  return {"kind": "moe" if shape else "peak", "impl": impl, "precision": precision, "modes":
          list(opts.modes) if shape else ["dense"], "shape": dataclasses.asdict(shape) if shape
          else None, **opts.knobs}


def worker_env(impl: str) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if impl.startswith("torch."):
    env["JAX_PLATFORMS"] = "cpu"  # JAX only routes there; the GPU is torch's
  else:  # torch's peer may use all of the GPU's memory, so JAX's share (0.75 by default) nears it
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
  return env


def execute(opts: Options, job: dict, name: str, on_record=lambda event: None) -> list[dict]:
  """The job's record events, each handed to on_record as it arrives."""
  stem = os.path.join(opts.log_dir, "".join(c if c.isalnum() or c in "._-" else "_" for c in name))
  remaining, events = list(job["modes"]), []
  while remaining:
    got, failure = _worker(dict(job, modes=remaining), stem, opts.mode_timeout_s, on_record)
    events += got
    remaining = [m for m in remaining if m not in {e["record"]["mode"] for e in got}]
    if not remaining or (failure is None and got):
      continue  # done, or killed as a mode finished: the next mode gets a worker and its time
    status, reason, wall_s = failure or (
        "crashed", f"the worker ended without a result for this mode; log: {stem}.log", None)
    raw = {"mode": remaining.pop(0), "status": status, "reason": reason,
           "detail": _tail(stem + ".log")}
    events.append({"event": "record", "record": raw, "device": None, "mode_wall_s": wall_s})
    on_record(events[-1])
  return events


def _worker(job: dict, stem: str, timeout: float, on_record):
  """(record events, failure) of one worker; failure: None, or (status, reason, seconds) of the
  first mode without a record."""
  job_path, events_path, log_path = stem + ".job.json", stem + ".events.jsonl", stem + ".log"
  with open(job_path, "w") as f:
    json.dump(job, f)
  open(events_path, "w").close()  # pylint: disable=consider-using-with
  got, seen, since, doing = [], 0, time.perf_counter(), "starting the worker (imports, device)"

  def take() -> bool:  # the new events; whether a record came
    nonlocal seen, since, doing
    with open(events_path) as f:  # a last line without its \n is still being written
      new = [json.loads(line) for line in f.read().split("\n")[seen:-1]]
    seen += len(new)
    for event in new:
      doing = event.get("stage") or doing
      if event["event"] == "record":
        event["mode_wall_s"], since = time.perf_counter() - since, time.perf_counter()
        doing = "starting the next mode"
        got.append(event)
        on_record(event)
    return any(e["event"] == "record" for e in new)

  with open(log_path, "a") as log:
    print(f"== worker for {', '.join(job['modes'])}", file=log, flush=True)
    proc = subprocess.Popen(WORKER + [job_path, events_path], stdout=log, stderr=subprocess.STDOUT,
                            env=worker_env(job["impl"]), start_new_session=True)
    code = None
    while code is None:
      with contextlib.suppress(subprocess.TimeoutExpired):
        code = proc.wait(timeout=POLL_S)
      take()
      if code is None and (waited := time.perf_counter() - since) > timeout:
        with contextlib.suppress(ProcessLookupError):  # the worker and what it started
          os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # None: a record that landed as the worker was being killed
        return got, None if take() else (
            "timeout", f"no result after {timeout:g} s (--mode-timeout), while {doing}; log: "
            f"{log_path}", waited)
  if code == 0:
    return got, None
  why = f"exit code {code}" if code > 0 else f"killed by {signal.strsignal(-code)}"
  last = ([line.strip() for line in _tail(log_path).splitlines() if line.strip()]
          or ["no output"])[-1][:300]
  return got, ("crashed", f"worker {why} while {doing}: {last}; log: {log_path}",
               time.perf_counter() - since)


def _tail(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-25:])[-3000:]
  except OSError:
    return ""


def describe() -> dict:
  """What a run was measured with, but for the accelerator, which its workers report. Versions
  come from metadata: importing torch here would cost seconds and a CUDA context."""
  versions = {}  # of those installed
  for name in PACKAGES:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      versions[name] = importlib.metadata.version(name)
  try:  # the commit's hash (no tag names), +dirty with changes to tracked files; None outside git
    commit = subprocess.run(["git", "describe", "--always", "--exclude=*", "--abbrev=12",
                             "--dirty=+dirty"], cwd=os.path.dirname(os.path.abspath(__file__)),
                            text=True, capture_output=True, timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    commit = None
  return {"machine": {"host": platform.node(), "os": platform.platform(),
                      "cpu": platform.processor() or platform.machine(),
                      "cpu_count": os.cpu_count(), "python": platform.python_version()},
          "versions": versions, "commit": commit}


def _brief(r: dict) -> str:
  if r.get("status") == "ok":
    return f"{r['ms']['median']:.3f} ms"
  return r.get("status", "?") + (f" ({r['reason'][:100]})" if r.get("reason") else "")


def run(opts: Options, on_record=lambda record: None) -> list[dict]:
  """The run's records, in the order they came, each handed to on_record as it comes."""
  t_run, now = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)
  run_id = f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"
  base = {"run_id": run_id, "date": now.isoformat(timespec="seconds"), **describe(),
          **{k: opts.knobs[k] for k in ("skew", "ep", "ep_transport", "seed")}}
  os.makedirs(opts.log_dir, exist_ok=True)
  out, device = [], {}
  progress = lambda text: print(text, file=sys.stderr, flush=True)
  progress(f"mok_jax.bench run {run_id}: {len(opts.shapes)} shape(s), modes "
           f"{', '.join(opts.modes)}, a fresh process per job, logs in {opts.log_dir}")

  def emit(event, impl, shape, label=None, precision="bf16"):
    raw, seen, env = event["record"], event.get("device") or {}, worker_env(impl)
    if seen and not device and not impl.startswith("torch."):
      device.update(seen)
    r = {"kind": "moe" if shape else "peak", **base, "impl": impl,
         "device": seen.get("name") or device.get("name"),
         "platform": seen.get("platform") or device.get("platform"),
         "mode_wall_s": event.get("mode_wall_s"), "env": {k: env[k] for k in ENV_VARS if k in env}}
    if shape:
      r.update(shape=shape.name, T=shape.T, H=shape.H, I=shape.I, E=shape.E, k=shape.k,
               precision=precision, flops=shape.flops(raw["mode"]))  # FLOPs as bf16's
    r.update(raw)
    r.setdefault("dtype", shapes.dtype_for(r["platform"] or "gpu", opts.knobs["run_precision"]))
    out.append(r)
    on_record(r)
    if label:
      took = r.get("mode_wall_s")
      progress(f"{label} {r['mode']}: {_brief(r)}" + (f" ({took:.0f} s)" if took else ""))

  execute(opts, make_job(opts, "dense_matmul", None), "peak",
          lambda event: emit(event, "dense_matmul", None))
  peak = next((r for r in out if r["kind"] == "peak"), {})
  progress(f"[peak] {device.get('name', '?')} ({device.get('platform') or 'platform unknown'}): "
           f"dense {peak.get('dtype')} {peak.get('n', opts.knobs['peak_n'])}^3 {_brief(peak)}")
  # Without the peak's platform (its worker died), every backend: each says whether it can run.
  cases = [(shape, *impl) for shape in opts.shapes for impl in shapes.resolve_impls(
      opts.impls, device.get("platform") or "any", opts.knobs["run_precision"])]
  for n, (shape, impl, p) in enumerate(cases, 1):
    name = shapes.label(impl, p)
    label = f"[{n}/{len(cases)}] {shape.name} {name}"
    execute(opts, make_job(opts, impl, shape, p), f"{shape.name}.{name}",
            lambda event, i=impl, s=shape, l=label, p=p: emit(event, i, s, l, p))
  progress(f"run {run_id} took {time.perf_counter() - t_run:.0f} s")
  return out
