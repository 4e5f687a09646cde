"""Plans a run's jobs, runs each (in a fresh worker process, or in this one) and makes their
records: one per (shape, implementation, mode), and the dense peak.

Nothing here initialises a JAX backend or imports torch, so the GPU is free for each worker in
turn. The peak's job runs first and tells the platform, on which the default implementations
depend. A worker streams its events (jobs.py) to a file that this process polls. Each mode has
its own --mode-timeout, counted from the previous mode's record (from the worker's start for
the first, so that it covers imports and inputs): a mode past it is reported as "timeout" with
the stage it was in, the worker is killed, and the modes after it get a fresh worker. A worker
that dies (host OOM, a segfault) costs only the mode it was in. Every record is reported
(progress line, .partial.jsonl) the moment it arrives.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from mok_jax.bench import jobs, peers, records
from mok_jax.bench.shapes import Shape

# PyTorch's peer may use all of the GPU's memory, so JAX's share (its default 0.75) is near it.
JAX_MEM_FRACTION = "0.90"
WORKER = [sys.executable, "-m", "mok_jax.bench.jobs"]  # + JOB.json EVENTS.jsonl
POLL_S = 0.2
PACKAGES = ("mok_jax", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "tokamax",
            "torch", "triton", "numpy")
KNOBS = ("dtype", "seed", "skew", "ep", "sets", "warmup", "warmup_s", "reps", "min_reps",
         "budget_s", "peak_n", "peak_warmup_s")  # what every job gets of Options


@dataclasses.dataclass
class Options:
  shapes: list[Shape]
  impls: str  # --impls text; "" for the platform's defaults
  modes: list[str]
  knobs: dict  # KNOBS; peak_n None: by platform
  isolate: bool
  mode_timeout_s: float
  log_dir: str | None = None
  partial_path: str | None = None


def make_job(opts: Options, impl: str, shape: Shape | None) -> dict:
  return {"kind": "moe" if shape else "peak", "impl": impl, "modes": list(opts.modes) if shape
          else ["dense"], "shape": dataclasses.asdict(shape) if shape else None, **opts.knobs}


def execute(opts: Options, job: dict, name: str, on_record=lambda event: None) -> list[dict]:
  """The job's record events, each also handed to on_record as it arrives."""
  if opts.isolate:
    return _isolated(job, os.path.join(opts.log_dir, _safe(name)), opts.mode_timeout_s, on_record)
  got = [event for event in jobs.iter_job(job) if event["event"] == "record"]
  for event in got:
    on_record(event)
  return got


def _isolated(job: dict, stem: str, timeout: float, on_record) -> list[dict]:
  log = stem + ".log"
  if os.path.exists(log):
    os.remove(log)
  remaining, events = list(job["modes"]), []
  while remaining:
    got, failure = _worker(dict(job, modes=remaining), stem, timeout, on_record)
    events += got
    remaining = [m for m in remaining if m not in {e["record"]["mode"] for e in got}]
    if not remaining or (failure is None and got):
      continue  # done, or killed as a mode finished: the next mode gets a worker and its time
    status, reason, wall_s = failure or (
        "crashed", f"the worker ended without a result for this mode; log: {log}", None)
    raw = records.failed([remaining.pop(0)], status, reason, detail=_tail(log))[0]
    events.append({"event": "record", "record": raw, "device": None, "mode_wall_s": wall_s})
    on_record(events[-1])
  return events


def _worker(job: dict, stem: str, timeout: float, on_record):
  """(record events, failure) of one worker; failure: None, or (status, reason, seconds) of the
  first mode without a record."""
  job_path, events_path, log_path = stem + ".job.json", stem + ".events.jsonl", stem + ".log"
  with open(job_path, "w") as f:
    json.dump(job, f)
  if os.path.exists(events_path):
    os.remove(events_path)
  got, state = [], {"seen": 0, "since": time.perf_counter(),
                    "doing": "starting the worker (imports, device)"}

  def take() -> int:  # reads the new events; returns how many records came
    try:
      with open(events_path) as f:
        lines = f.read().split("\n")[:-1]  # the last line is complete only once it has its \n
    except FileNotFoundError:
      return 0
    new, state["seen"] = lines[state["seen"]:], len(lines)
    count = 0
    for event in (json.loads(line) for line in new if line.strip()):
      if event["event"] == "stage":
        state["doing"] = event["stage"]
      elif event["event"] == "record":
        now = time.perf_counter()
        event["mode_wall_s"], state["since"] = now - state["since"], now
        state["doing"], count = "starting the next mode", count + 1
        got.append(event)
        on_record(event)
    return count

  with open(log_path, "a") as log:
    log.write(f"== worker for {', '.join(job['modes'])}\n")
    log.flush()
    proc = subprocess.Popen(WORKER + [job_path, events_path], stdout=log,
                            stderr=subprocess.STDOUT, env=_worker_env(job["impl"]),
                            start_new_session=True)
    while True:
      try:
        code = proc.wait(timeout=POLL_S)
      except subprocess.TimeoutExpired:
        code = None
      take()
      if code is not None:
        break
      waited = time.perf_counter() - state["since"]
      if waited > timeout:
        _kill(proc)
        if take():  # a record that landed as the worker was being killed
          return got, None
        return got, ("timeout", f"no result after {timeout:g} s (--mode-timeout), while "
                     f"{state['doing']}; log: {log_path}", waited)
  if code == 0:
    return got, None
  why = f"exit code {code}"
  if code < 0:
    try:
      why = f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
      why = f"killed by signal {-code}"
  lines = [line.strip() for line in _tail(log_path).splitlines() if line.strip()]
  return got, ("crashed", f"worker {why} while {state['doing']}: "
               f"{lines[-1][:300] if lines else 'no output'}; log: {log_path}",
               time.perf_counter() - state["since"])


def _worker_env(impl: str) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if impl == "torch._grouped_mm":
    env["JAX_PLATFORMS"] = "cpu"  # JAX only routes there; the GPU is torch's
  else:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION)
  return env


def _kill(proc: subprocess.Popen):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    proc.kill()
  proc.wait()


def _tail(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-25:])[-3000:]
  except OSError:
    return ""


def _safe(text: str) -> str:
  return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def git_commit() -> str | None:
  # MOK_BENCH_COMMIT names the commit of a tree copied without its history (a remote GPU machine
  # may hold a stale .git).
  if os.environ.get("MOK_BENCH_COMMIT"):
    return os.environ["MOK_BENCH_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    head, dirty = (subprocess.run(["git", *args], cwd=here, text=True, capture_output=True,
                                  timeout=10) for args in (["rev-parse", "--short=12", "HEAD"],
                   ["status", "--porcelain", "--untracked-files=no"]))
  except (OSError, subprocess.SubprocessError):
    return None
  return None if head.returncode else head.stdout.strip() + ("+dirty" if dirty.stdout.strip()
                                                             else "")


def describe() -> dict:
  """What a run was measured with, but for the accelerator, which its workers report. Versions
  from the distributions' metadata: importing torch here would cost seconds and a CUDA context."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return {"machine": {"host": platform.node(), "os": platform.platform(),
                      "cpu": platform.processor() or platform.machine(),
                      "cpu_count": os.cpu_count(), "python": platform.python_version()},
          "versions": versions, "commit": git_commit(), "env": records.env_vars()}


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a broken install: the worker says how it fails
    return True


def _brief(record: dict) -> str:
  if record.get("status") == "ok":
    return f"{record['ms']['median']:.3f} ms"
  return record.get("status", "?") + (f" ({record['reason'][:100]})" if record.get("reason")
                                      else "")


def _progress(text: str):
  print(text, file=sys.stderr, flush=True)


def run(opts: Options) -> list[dict]:
  """The dense peak, then every implementation on every shape: the run's records."""
  t_run = time.perf_counter()
  now = datetime.datetime.now(datetime.timezone.utc)
  run_id = f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"
  base = {"run_id": run_id, "date": now.isoformat(timespec="seconds"),
          "skew": opts.knobs["skew"], "ep": opts.knobs["ep"], "seed": opts.knobs["seed"],
          "isolated": opts.isolate}
  about, out, device = describe(), [], {}
  scope = "worker" if opts.isolate else "process"
  if opts.isolate:
    opts = dataclasses.replace(opts, log_dir=opts.log_dir or tempfile.mkdtemp(prefix="mok_bench_"))
    os.makedirs(opts.log_dir, exist_ok=True)
  _progress(f"mok_jax.bench run {run_id}: {len(opts.shapes)} shape(s), modes "
            f"{', '.join(opts.modes)}, " + (f"a fresh process per job, logs in {opts.log_dir}"
                                            if opts.isolate else "in-process"))

  def emit(event, impl, shape, mem_scope, label=None) -> dict:
    raw, seen = event["record"], event.get("device") or {}
    if seen and impl != "torch._grouped_mm":
      device.update(device or seen)
    record = {"kind": "moe" if shape else "peak", **base, "impl": impl, "group": peers.group(impl),
              "device": seen.get("name") or device.get("name"),
              "platform": seen.get("platform") or device.get("platform"), "mem_scope": mem_scope,
              "job_wall_s": event.get("wall_s"), "mode_wall_s": event.get("mode_wall_s")}
    if shape:
      record.update(shape=shape.name, T=shape.T, H=shape.H, I=shape.I, E=shape.E, k=shape.k,
                    Is=shape.Is, flops=shape.flops(raw["mode"]))
    record.update(raw)
    record.setdefault("status", "error")
    record.setdefault("dtype", records.resolve_dtype(opts.knobs["dtype"],
                                                     record["platform"] or "gpu"))
    record.update(about, worker_env=event.get("env_vars"))
    out.append(record)
    if opts.partial_path:
      with open(opts.partial_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if label:
      took = record.get("mode_wall_s")
      _progress(f"{label} {record['mode']}: {_brief(record)}"
                + (f" ({took:.0f} s)" if took is not None else ""))
    return record

  execute(opts, make_job(opts, "dense_matmul", None), "peak",
          lambda event: emit(event, "dense_matmul", None, scope))
  peak = next((r for r in out if r["kind"] == "peak"), {})
  _progress(f"[peak] {device.get('name', '?')} ({device.get('platform') or 'platform unknown'}): "
            f"dense {peak.get('dtype')} {peak.get('n', opts.knobs['peak_n'])}^3 {_brief(peak)}")
  if device.get("platform") or opts.impls:
    impls = peers.resolve(opts.impls, device.get("platform") or "gpu")
  else:  # the peak's worker died: time every backend, each says whether it can run
    impls = list(dict.fromkeys(peers.default_impls("gpu") + peers.default_impls("cpu")))
  cases = [(shape, impl) for shape in opts.shapes for impl in impls]
  for n, (shape, impl) in enumerate(cases, 1):
    label = f"[{n}/{len(cases)}] {shape.name} {impl}"
    missing = {"torch._grouped_mm": "torch", "tokamax.ragged_dot": "tokamax"}.get(impl)
    if missing and not _installed(missing):  # saves a worker's start on the GPU
      for raw in records.failed(opts.modes, "unavailable", f"{missing} is not installed"):
        emit({"record": raw}, impl, shape, None, label)
      continue
    execute(opts, make_job(opts, impl, shape), f"{shape.name}.{impl}",
            lambda event, i=impl, s=shape, l=label: emit(event, i, s, scope, l))
  _progress(f"run {run_id} took {time.perf_counter() - t_run:.0f} s")
  return out
