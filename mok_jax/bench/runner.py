"""Plans the jobs of a benchmark run, runs each one (in a fresh process, or in this one), and
turns their results into records: one per (shape, implementation, mode), plus the dense peak;
or, with --breakdown, one per (shape, variant of the CUDA forward), with no peak.

Nothing here touches an accelerator: in the isolated mode (the default, except with --tiny)
this process never initialises a JAX backend or imports torch, so the GPU is free for each
worker in turn. The first job measures the dense-matmul peak and tells the platform; the
implementations to time depend on it.

A worker streams its events (jobs.py) to a file that this process polls. Each mode has its
own timeout (--mode-timeout), counted from the previous mode's record (from the worker's start
for the first mode, so it covers imports and inputs too): a mode that runs past it is reported
as "timeout" with the stage it was in, the worker is killed, and the modes after it get a fresh
worker. A worker that dies (out of host memory, a segfault) costs only the mode it was in. Every
record is reported (progress line, .partial.jsonl) the moment it arrives.
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

from mok_jax.bench import env, jobs, peers, records
from mok_jax.bench.shapes import Shape, breakdown_modes, breakdown_variant

# Workers' JAX takes this fraction of GPU memory (JAX's default is 0.75) unless the caller set
# XLA_PYTHON_CLIENT_MEM_FRACTION: PyTorch's peer may use all of it, so JAX's should be close.
JAX_MEM_FRACTION = "0.90"
WORKER = [sys.executable, "-m", "mok_jax.bench.jobs"]  # + JOB.json EVENTS.jsonl
LOG_TAIL_LINES = 25
POLL_S = 0.2  # how often the events file is read while a worker runs
BREAKDOWN_IMPL = "mok_jax:cuda"  # the only one that reads shapes.SKIP_ENV


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
  warmup_s: float
  reps: int
  min_reps: int
  budget_s: float
  peak_n: int | None  # None: by platform (jobs.PEAK_N_GPU, jobs.PEAK_N_CPU)
  peak_warmup_s: float
  isolate: bool
  mode_timeout_s: float  # per mode of a job, see the module's docstring
  log_dir: str | None = None
  partial_path: str | None = None
  breakdown: bool = False  # the stage breakdown of the CUDA forward instead (impls, modes unused)
  ep: int = 1  # expert-parallel devices (the shapes' T per device)


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
    if kind == "moe":
      modes = list(o.modes)
    elif kind == "breakdown":
      modes = breakdown_modes(shape)
    else:
      modes = ["dense"]
    return {"kind": kind, "impl": impl, "shape": shape.to_json() if shape else None,
            "modes": modes, "dtype": o.dtype,
            "seed": o.seed, "skew": o.skew, "sets": o.sets, "warmup": o.warmup,
            "warmup_s": o.warmup_s, "reps": o.reps, "min_reps": o.min_reps,
            "budget_s": o.budget_s, "peak_n": o.peak_n, "peak_warmup_s": o.peak_warmup_s,
            "ep": o.ep}

  def _worker_env(self, impl: str) -> dict:
    child = dict(os.environ)
    child["PYTHONUNBUFFERED"] = "1"
    if impl == "torch._grouped_mm":
      child["JAX_PLATFORMS"] = "cpu"  # JAX only routes there; the GPU is torch's
    else:
      child.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION)
    return child

  def _execute(self, job: dict, name: str, on_record=None) -> tuple[list[dict], str]:
    """(record events, memory scope) of a job, in this process or in fresh ones; each record
    event also goes to on_record(event) the moment it is known."""
    on_record = on_record or (lambda event: None)
    if not self.opts.isolate:
      events = []
      for event in jobs.iter_job(job):
        if event["event"] == "record":
          events.append(event)
          on_record(event)
      return events, "process"
    return self._execute_isolated(job, name, on_record), "worker"

  def _execute_isolated(self, job: dict, name: str, on_record) -> list[dict]:
    """Runs the job's modes in a worker; when the worker times out on a mode or dies in it,
    that mode becomes a failed record and the modes after it get a fresh worker."""
    stem = os.path.join(self.log_dir, _file_name(name))
    log_path = stem + ".log"
    if os.path.exists(log_path):
      os.remove(log_path)
    remaining = list(job["modes"])
    events = []
    while remaining:
      got, failure = self._run_worker(dict(job, modes=remaining), stem, log_path, on_record)
      events += got
      done = {event["record"]["mode"] for event in got}
      remaining = [mode for mode in remaining if mode not in done]
      if not remaining:
        break
      if failure is None and got:
        continue  # killed just as a mode finished: the next one gets a fresh worker and its time
      status, reason, wall_s = failure or (
          "crashed", f"the worker ended without a result for this mode; log: {log_path}", None)
      raw = records.failed([remaining.pop(0)], status, reason, detail=_tail(log_path))[0]
      event = {"event": "record", "record": raw, "device": None, "wall_s": None,
               "mode_wall_s": wall_s, "env_vars": None}
      events.append(event)
      on_record(event)
    return events

  def _run_worker(self, job: dict, stem: str, log_path: str, on_record):
    """(record events, failure) of one worker; failure is None or (status, reason, seconds)
    for the first mode without a record. None with modes left: the worker was killed as a
    mode's record arrived, so the mode after it has not had its time."""
    job_path, events_path = stem + ".job.json", stem + ".events.jsonl"
    with open(job_path, "w") as f:
      json.dump(job, f)
    if os.path.exists(events_path):
      os.remove(events_path)
    timeout = self.opts.mode_timeout_s
    stream = _EventStream(events_path)
    got = []
    mode_stage = "starting the worker (imports, device)"
    since = time.perf_counter()
    with open(log_path, "a") as log:
      log.write(f"== worker for {', '.join(job['modes'])}: {' '.join(WORKER)} {job_path} "
                f"{events_path}\n")
      log.flush()
      proc = subprocess.Popen(WORKER + [job_path, events_path], stdout=log,
                              stderr=subprocess.STDOUT, env=self._worker_env(job["impl"]),
                              start_new_session=True)
      code = None
      while True:
        try:
          code = proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
          pass
        for event in stream.read():
          if event.get("event") == "record":
            now = time.perf_counter()
            event["mode_wall_s"] = now - since
            since = now
            mode_stage = "starting the next mode"
            got.append(event)
            on_record(event)
          elif event.get("event") == "stage":
            mode_stage = event.get("stage") or mode_stage
        if code is not None:
          break
        if time.perf_counter() - since > timeout:
          _kill_group(proc)
          late = [e for e in stream.read() if e.get("event") == "record"]
          for event in late:  # a record that landed as the worker was being killed
            event["mode_wall_s"] = time.perf_counter() - since
            got.append(event)
            on_record(event)
          if late:
            return got, None
          return got, ("timeout", f"no result after {timeout:g} s (--mode-timeout), "
                       f"while {mode_stage}; log: {log_path}", time.perf_counter() - since)
    if code == 0:
      return got, None
    why = f"exit code {code}"
    if code < 0:
      try:
        why = f"killed by signal {signal.Signals(-code).name}"
      except ValueError:
        why = f"killed by signal {-code}"
    return got, ("crashed", f"worker {why} while {mode_stage}: {_last_line(log_path)}; log: "
                 f"{log_path}", time.perf_counter() - since)

  # -- records ---------------------------------------------------------------------------------

  def _emit(self, job: dict, event: dict, mem_scope: str | None, impl: str,
            shape: Shape | None) -> dict:
    """A record event of a job -> a full record, kept, and appended to the partial file."""
    raw = event["record"]
    device = event.get("device") or {}
    if device and job["impl"] != "torch._grouped_mm":
      self.device = self.device or device
    record = {
        "kind": job["kind"],
        "run_id": self.run_id,
        "date": self.date,
        "impl": impl,
        "group": peers.IMPLS[impl].group if impl in peers.IMPLS else "ceiling",
        "device": device.get("name") or self.device.get("name"),
        "platform": device.get("platform") or self.device.get("platform"),
        "skew": self.opts.skew,
        "ep": self.opts.ep,
        "seed": self.opts.seed,
        "isolated": self.opts.isolate,
        "mem_scope": mem_scope,
        "job_wall_s": event.get("wall_s"),  # the worker's seconds from its start to this record
        "mode_wall_s": event.get("mode_wall_s"),  # what --mode-timeout bounds
    }
    if shape is not None:
      # A breakdown's flops are those of the whole forward, whatever its mode skips.
      mode = "fwd" if job["kind"] == "breakdown" else raw["mode"]
      record.update(shape=shape.name, T=shape.T, H=shape.H, I=shape.I, E=shape.E, k=shape.k,
                    Is=shape.Is, flops=shape.flops(mode))
    if job["kind"] == "breakdown":
      stage, skipped = breakdown_variant(raw["mode"])
      record.update(stage=stage, skip=list(skipped))
    record.update(raw)
    record.setdefault("status", "error")
    record.setdefault("dtype", records.resolve_dtype(self.opts.dtype, record["platform"] or "gpu"))
    record.update(self.about)
    record["worker_env"] = event.get("env_vars")
    self.records.append(record)
    if self.opts.partial_path:
      with open(self.opts.partial_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record

  def _skip_reason(self, impl: str, shape: Shape, platform: str | None) -> str | None:
    """Why a job need not start a worker at all (saves a process start on the GPU)."""
    if impl == "torch._grouped_mm" and not _installed("torch"):
      return "torch is not installed"
    if impl == "tokamax.ragged_dot" and not _installed("tokamax"):
      return "tokamax is not installed"
    if impl == "mok_jax:cuda" and platform is not None:
      from mok_jax import ops  # pylint: disable=import-outside-toplevel
      from mok_jax.config import Config  # pylint: disable=import-outside-toplevel

      dtype = {"bf16": "bfloat16", "f32": "float32"}[records.resolve_dtype(self.opts.dtype,
                                                                          platform)]
      dims = ops.MoeDims(shape.T, shape.H, shape.I, shape.E, shape.k, shape.Is)
      return ops.cuda_unsupported_reason(platform, dtype, dims, Config())
    return None

  # -- the run ---------------------------------------------------------------------------------

  def run(self) -> list[dict]:
    o = self.opts
    t_run = time.perf_counter()
    what = "the CUDA forward's stage breakdown" if o.breakdown else f"modes {', '.join(o.modes)}"
    _progress(f"mok_jax.bench run {self.run_id}: {len(o.shapes)} shape(s), {what}, "
              f"{'a fresh process per job' if o.isolate else 'in-process'}; logs in "
              f"{self.log_dir}")
    if o.breakdown:
      self._run_breakdown()
    else:
      self._run_impls()
    _progress(f"run {self.run_id} took {time.perf_counter() - t_run:.0f} s")
    return self.records

  def _run_breakdown(self):
    """One job per shape: the CUDA forward, then the same with stages left out, a variant per
    mode. No peak job: the worker itself says when the CUDA kernel cannot run."""
    o = self.opts
    for n, shape in enumerate(o.shapes, 1):
      job = self._job("breakdown", BREAKDOWN_IMPL, shape)
      label = f"[{n}/{len(o.shapes)}] {shape.name} breakdown"
      self._execute(job, f"{shape.name}.breakdown",
                    self._reporter(job, BREAKDOWN_IMPL, shape, label))

  def _run_impls(self):
    """The dense peak, then every implementation on every shape."""
    o = self.opts
    job = self._job("peak", "dense_matmul", None)
    peak = None

    def on_peak(event):
      nonlocal peak
      peak = self._emit(job, event, scope_of(o), "dense_matmul", None)

    self._execute(job, "peak", on_peak)
    platform = self.device.get("platform")
    peak = peak or {}
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
        label = f"[{n}/{total}] {shape.name} {impl}"
        reason = self._skip_reason(impl, shape, platform)
        if reason:
          for raw in records.failed(o.modes, "unavailable", reason):
            self._emit(job, {"record": raw}, None, impl, shape)
          _progress(f"{label}: n/a ({reason[:100]})")
        else:
          self._execute(job, f"{shape.name}.{impl}", self._reporter(job, impl, shape, label))

  def _reporter(self, job: dict, impl: str, shape: Shape, label: str):
    """on_record for _execute: each record event becomes a record, with a progress line."""

    def on_record(event):
      record = self._emit(job, event, scope_of(self.opts), impl, shape)
      took = record.get("mode_wall_s")
      _progress(f"{label} {record['mode']}: {_brief(record)}"
                + (f" ({took:.0f} s)" if took is not None else ""))

    return on_record


def scope_of(opts: Options) -> str:
  return "worker" if opts.isolate else "process"


class _EventStream:
  """Reads the complete lines a worker has appended to its events file since the last read."""

  def __init__(self, path: str):
    self.path, self.offset, self.rest = path, 0, b""

  def read(self) -> list[dict]:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return []
    self.offset += len(data)
    lines = (self.rest + data).split(b"\n")
    self.rest = lines.pop()
    events = []
    for line in lines:
      if line.strip():
        try:
          events.append(json.loads(line))
        except ValueError:  # never written by a worker; skip rather than lose the rest
          continue
    return events


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
