"""Plans the jobs of a benchmark run, runs each one (in a fresh process, or in this one), and
turns their results into records: one per (shape, implementation, mode), plus the dense peak.

Nothing here touches an accelerator: in the isolated mode (the default, except with --tiny)
this process never initialises a JAX backend or imports torch, so the GPU is free for each
worker in turn. The first job measures the dense-matmul peak and tells the platform; the
implementations to time depend on it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from mok_jax.bench import env, jobs, peers
from mok_jax.bench.shapes import Shape

# Workers' JAX takes this fraction of GPU memory (JAX's default is 0.75) unless the caller set
# XLA_PYTHON_CLIENT_MEM_FRACTION: PyTorch's peer may use all of it, so JAX's should be close.
JAX_MEM_FRACTION = "0.90"
WORKER = [sys.executable, "-m", "mok_jax.bench.jobs"]  # + JOB.json RESULT.json
LOG_TAIL_LINES = 25


@dataclasses.dataclass
class Options:
  shapes: list[Shape]
  impls: str  # --impls text; "" for the defaults of the platform
  modes: list[str]
  dtype: str
  seed: int
  skew: float
  sets: int
  warmup: int
  reps: int
  min_reps: int
  budget_s: float
  peak_n: int | None  # None: by platform (jobs.PEAK_N_GPU, jobs.PEAK_N_CPU)
  isolate: bool
  job_timeout_s: float
  log_dir: str | None = None
  partial_path: str | None = None


def new_run_id() -> str:
  return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def _progress(text: str):
  print(text, file=sys.stderr, flush=True)


class Runner:

  def __init__(self, opts: Options):
    self.opts = opts
    self.run_id = new_run_id()
    self.date = env.now()
    self.about = env.describe()
    self.records: list[dict] = []
    self.device: dict = {}
    self.log_dir = opts.log_dir or tempfile.mkdtemp(prefix="mok_bench_")
    os.makedirs(self.log_dir, exist_ok=True)

  # -- jobs ------------------------------------------------------------------------------------

  def _job(self, kind: str, impl: str, shape: Shape | None) -> dict:
    o = self.opts
    return {"kind": kind, "impl": impl, "shape": shape.to_json() if shape else None,
            "modes": list(o.modes) if kind == "moe" else ["dense"], "dtype": o.dtype,
            "seed": o.seed, "skew": o.skew, "sets": o.sets, "warmup": o.warmup, "reps": o.reps,
            "min_reps": o.min_reps, "budget_s": o.budget_s, "peak_n": o.peak_n}

  def _worker_env(self, impl: str) -> dict:
    child = dict(os.environ)
    child["PYTHONUNBUFFERED"] = "1"
    if impl == "torch._grouped_mm":
      child["JAX_PLATFORMS"] = "cpu"  # JAX only routes there; the GPU is torch's
    else:
      child.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION)
    return child

  def _execute(self, job: dict, name: str) -> tuple[dict, str]:
    """(result, memory scope) of a job, in this process or in a fresh one."""
    if not self.opts.isolate:
      return jobs.run_job(job), "process"
    return self._execute_isolated(job, name), "worker"

  def _execute_isolated(self, job: dict, name: str) -> dict:
    stem = os.path.join(self.log_dir, _file_name(name))
    job_path, result_path, log_path = stem + ".job.json", stem + ".result.json", stem + ".log"
    with open(job_path, "w") as f:
      json.dump(job, f)
    if os.path.exists(result_path):
      os.remove(result_path)
    cmd = WORKER + [job_path, result_path]
    start = time.perf_counter()
    with open(log_path, "w") as log:
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env=self._worker_env(job["impl"]), start_new_session=True)
      try:
        code = proc.wait(timeout=self.opts.job_timeout_s)
      except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"device": None, "wall_s": time.perf_counter() - start, "records": jobs.failed(
            job["modes"], "timeout", f"no result after {self.opts.job_timeout_s:.0f} s "
            f"(--job-timeout); log: {log_path}", detail=_tail(log_path))}
    if code == 0 and os.path.exists(result_path):
      with open(result_path) as f:
        return json.load(f)
    why = f"exit code {code}"
    if code < 0:
      try:
        why = f"killed by signal {signal.Signals(-code).name}"
      except ValueError:
        why = f"killed by signal {-code}"
    return {"device": None, "wall_s": time.perf_counter() - start, "records": jobs.failed(
        job["modes"], "crashed", f"worker {why}: {_last_line(log_path)}; log: {log_path}",
        detail=_tail(log_path))}

  # -- records ---------------------------------------------------------------------------------

  def _emit(self, job: dict, result: dict, mem_scope: str, impl: str, shape: Shape | None):
    device = result.get("device") or {}
    if device and job["impl"] != "torch._grouped_mm":
      self.device = self.device or device
    for raw in result["records"]:
      record = {
          "kind": "peak" if job["kind"] == "peak" else "moe",
          "run_id": self.run_id,
          "date": self.date,
          "impl": impl,
          "group": peers.IMPLS[impl].group if impl in peers.IMPLS else "ceiling",
          "device": device.get("name") or self.device.get("name"),
          "platform": device.get("platform") or self.device.get("platform"),
          "skew": self.opts.skew,
          "seed": self.opts.seed,
          "isolated": self.opts.isolate,
          "mem_scope": mem_scope,
          "job_wall_s": result.get("wall_s"),
      }
      if shape is not None:
        record.update(shape=shape.name, T=shape.T, H=shape.H, I=shape.I, E=shape.E, k=shape.k,
                      Is=shape.Is, flops=shape.flops(raw["mode"]))
      record.update(raw)
      record.setdefault("status", "error")
      record.setdefault("dtype", jobs.resolve_dtype(self.opts.dtype,
                                                    record["platform"] or "gpu"))
      record.update(self.about)
      record["worker_env"] = result.get("env_vars")
      self.records.append(record)
      if self.opts.partial_path:
        with open(self.opts.partial_path, "a") as f:
          f.write(json.dumps(record) + "\n")

  def _skip_reason(self, impl: str, shape: Shape, platform: str | None) -> str | None:
    """Why a job need not start a worker at all (saves a process start on the GPU)."""
    if impl == "torch._grouped_mm" and not _installed("torch"):
      return "torch is not installed"
    if impl == "tokamax.ragged_dot" and not _installed("tokamax"):
      return "tokamax is not installed"
    if impl == "mok_jax:cuda" and platform is not None:
      from mok_jax import ops  # pylint: disable=import-outside-toplevel
      from mok_jax.config import Config  # pylint: disable=import-outside-toplevel

      dtype = {"bf16": "bfloat16", "f32": "float32"}[jobs.resolve_dtype(self.opts.dtype,
                                                                          platform)]
      dims = ops.MoeDims(shape.T, shape.H, shape.I, shape.E, shape.k, shape.Is)
      return ops.cuda_unsupported_reason(platform, dtype, dims, Config())
    return None

  # -- the run ---------------------------------------------------------------------------------

  def run(self) -> list[dict]:
    o = self.opts
    _progress(f"mok_jax.bench run {self.run_id}: {len(o.shapes)} shape(s), modes "
              f"{', '.join(o.modes)}, {'a fresh process per job' if o.isolate else 'in-process'}"
              f"; logs in {self.log_dir}")
    job = self._job("peak", "dense_matmul", None)
    result, scope = self._execute(job, "peak")
    self._emit(job, result, scope, "dense_matmul", None)
    peak = self.records[-1]
    platform = self.device.get("platform")
    _progress(f"[peak] {self.device.get('name', '?')} ({platform or 'platform unknown'}): "
              f"dense {peak.get('dtype')} {peak.get('n', o.peak_n)}^3 {_brief(peak)}")
    if platform is None:  # the peak worker died: time every backend, each says if it cannot run
      names = list(dict.fromkeys(peers.default_impls("gpu") + peers.default_impls("cpu")))
      impls = peers.resolve(o.impls, "gpu") if o.impls else names
    else:
      impls = peers.resolve(o.impls, platform)
    total = len(o.shapes) * len(impls)
    n = 0
    for shape in o.shapes:
      for impl in impls:
        n += 1
        job = self._job("moe", impl, shape)
        reason = self._skip_reason(impl, shape, platform)
        if reason:
          result, scope = {"device": None, "records": jobs.failed(
              o.modes, "unavailable", reason)}, None
        else:
          result, scope = self._execute(job, f"{shape.name}.{impl}")
        self._emit(job, result, scope, impl, shape)
        got = self.records[-len(o.modes):]
        _progress(f"[{n}/{total}] {shape.name} {impl}: "
                  + " | ".join(f"{r['mode']} {_brief(r)}" for r in got)
                  + (f" ({result['wall_s']:.0f} s)" if result.get("wall_s") else ""))
    return self.records


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a broken install: let the worker say how it fails
    return True


def _file_name(text: str) -> str:
  return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def _brief(record: dict) -> str:
  if record.get("status") == "ok":
    return f"{record['ms']['median']:.3f} ms"
  text = record.get("status", "?")
  if record.get("reason"):
    text += f" ({record['reason'][:100]})"
  return text


def _kill_group(proc: subprocess.Popen):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    proc.kill()
  proc.wait()


def _tail(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-LOG_TAIL_LINES:])[-3000:]
  except OSError:
    return ""


def _last_line(path: str) -> str:
  lines = [line.strip() for line in _tail(path).splitlines() if line.strip()]
  return lines[-1][:300] if lines else "no output"
