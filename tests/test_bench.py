"""`python -m mok_jax.bench`: the --tiny run on CPU, its JSON lines, table and chart; the
figures derived from records; a worker that dies; the PyTorch peer's inputs, the JAX ones' bits;
the modules' imports and size.

The tiny run goes through a subprocess with JAX on the CPU, and stand-in `tokamax` and `qwix`
packages on its path (they take the calls the way tokamax.ragged_dot and qwix.quantize do, and
run jax.lax.ragged_dot on the dequantized operands), so the tokamax peer's code path runs too,
at bf16 and at fp8. torch is not given a GPU, so its row must say why it did not run.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mok_jax.bench import __main__ as bench_main
from mok_jax.bench import inputs, jobs, report, runner, shapes, timing, torch_peer


def expected_flops(T, H, I, E, k, mode):
  """Reference: 2*T*k*3*H*I per forward, x3 for forward+backward."""
  del E
  forward = 2 * T * k * 3 * H * I
  return forward if mode == "fwd" else 3 * forward


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK_FIELDS = ("run_id", "date", "impl", "mode", "status", "device", "platform", "dtype",
             "shape", "T", "H", "I", "E", "k", "flops", "ms", "tflops", "pct_of_peak",
             "compile_s", "machine", "versions", "check", "check_result", "load", "ms_b2b",
             "timing_b2b", "tflops_b2b", "peak_mem_bytes", "precision", "label")
FAILED_STATUSES = ("oom", "error", "unavailable", "timeout", "crashed")

FAKE_TOKAMAX = '''
"""Test double of tokamax: ragged_dot's signature. With FAKE_TOKAMAX_BWD=fail its backward
raises, as tokamax 0.0.17's did for an explicit precision."""
import os

import jax

__version__ = "0.0.0+test"


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, *, implementation=None, **kwargs):
  def plain(lhs, rhs):
    if not isinstance(lhs, jax.Array):  # qwix.QArray operands: the quantized ragged_dot
      import qwix
      lhs, rhs = qwix.dequantize(lhs), qwix.dequantize(rhs)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)

  if os.environ.get("FAKE_TOKAMAX_BWD") != "fail":
    return plain(lhs, rhs)

  @jax.custom_vjp
  def product(lhs, rhs):
    return plain(lhs, rhs)

  def bwd(res, g):
    raise NotImplementedError("backward not supported here (test double)")

  product.defvjp(lambda lhs, rhs: (plain(lhs, rhs), None), bwd)
  return product(lhs, rhs)
'''

FAKE_QWIX = '''
"""Test double of qwix: quantize's absmax scales of the channelwise axes, and dequantize."""
import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QArray:
  qvalue: jax.Array
  scale: jax.Array


def quantize(array, qtype, *, channelwise_axes=()):
  others = tuple(a for a in range(array.ndim) if a not in channelwise_axes)
  amax = jnp.max(jnp.abs(array), axis=others, keepdims=True).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / float(jnp.finfo(qtype).max), 1.0)
  return QArray((array / scale).astype(qtype), scale.astype(array.dtype))


def dequantize(q):
  return q.qvalue.astype(q.scale.dtype) * q.scale
'''


def _env(extra_path=None):
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["CUDA_VISIBLE_DEVICES"] = ""  # a torch that is installed finds no GPU
  # conftest.py splits the CPU into 8 devices for the sharding tests; one is enough here.
  flags = env.get("XLA_FLAGS", "").split()
  env["XLA_FLAGS"] = " ".join(f for f in flags if "force_host_platform_device_count" not in f)
  paths = [REPO] + ([extra_path] if extra_path else [])
  env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def _fake_tokamax(tmp):
  fake = tmp / "fake"
  (fake / "tokamax").mkdir(parents=True)
  (fake / "tokamax" / "__init__.py").write_text(textwrap.dedent(FAKE_TOKAMAX))
  (fake / "qwix").mkdir()
  (fake / "qwix" / "__init__.py").write_text(textwrap.dedent(FAKE_QWIX))
  return fake


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("bench")
  fake = _fake_tokamax(tmp)
  out = tmp / "out" / "bench.jsonl"
  proc = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--tiny", "--out", str(out)],
                        cwd=REPO, env=_env(str(fake)), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  return out, records, proc.stdout


def test_tiny_records_have_every_figure(tiny_run):
  _, records, _ = tiny_run
  moe = [r for r in records if r["kind"] == "moe"]
  assert {r["impl"] for r in moe} == {"mok_jax:xla", "mok_jax:ffi", "jax.ragged_dot",
                                       "tokamax.ragged_dot", "torch._grouped_mm"}
  assert len({r["run_id"] for r in records}) == 1
  for shape in shapes.TINY:
    for mode in shapes.MODES:
      rows = [r for r in moe if r["shape"] == shape.name and r["mode"] == mode]
      assert len(rows) == 5, rows
      for r in rows:
        assert r["flops"] == expected_flops(shape.T, shape.H, shape.I, shape.E, shape.k, mode)
        if r["status"] != "ok":
          continue
        missing = [f for f in OK_FIELDS if f not in r]
        assert not missing, (r["impl"], missing)
        assert r["platform"] == "cpu" and r["dtype"] == "f32"
        ms = r["ms"]
        assert 0 < ms["min"] <= ms["p25"] <= ms["median"] <= ms["p75"] <= ms["max"]
        assert ms["n"] >= 2 and r["compile_s"] >= 0
        assert r["tflops"] == pytest.approx(r["flops"] / (ms["median"] * 1e-3) / 1e12)
        b2b = r["ms_b2b"]
        assert 0 < b2b["min"] <= b2b["median"] <= b2b["max"] and b2b["n"] >= 2
        assert r["timing_b2b"]["calls_per_sample"] >= 1
        assert r["tflops_b2b"] == pytest.approx(r["flops"] / (b2b["median"] * 1e-3) / 1e12)
        assert r["pct_of_peak"] > 0
        assert r["speedup_vs_best_peer"] > 0 and r["best_peer"] in ("jax.ragged_dot",
                                                                     "tokamax.ragged_dot")
        assert r["check_result"] in ("reference", "ok"), r["check_result"]


def test_tiny_backends_and_peers_ran(tiny_run):
  _, records, _ = tiny_run
  status = {(r["impl"], r["mode"]): r for r in records if r["kind"] == "moe"}
  for impl in ("mok_jax:xla", "mok_jax:ffi", "jax.ragged_dot", "tokamax.ragged_dot"):
    for mode in shapes.MODES:
      assert status[impl, mode]["status"] == "ok", status[impl, mode]
  for mode in shapes.MODES:  # the stand-in runs jax.lax.ragged_dot: the same sums
    tokamax = status["tokamax.ragged_dot", mode]
    assert tokamax["check_vs"] == "mok_jax:xla" and tokamax["check_result"] == "ok", tokamax


def test_tiny_failed_peer_is_reported_with_reason(tiny_run):
  _, records, stdout = tiny_run
  torch_rows = [r for r in records if r["impl"] == "torch._grouped_mm"]
  assert len(torch_rows) == len(shapes.MODES)
  for r in torch_rows:
    assert r["status"] in FAILED_STATUSES
    assert "torch" in r["reason"]
    assert "ms" not in r
  assert "torch._grouped_mm" in stdout and "n/a [" in stdout


def test_tiny_peak_table_and_chart(tiny_run):
  out, records, stdout = tiny_run
  peaks = [r for r in records if r["kind"] == "peak"]
  assert len(peaks) == 1 and peaks[0]["status"] == "ok"
  assert peaks[0]["flops"] == 2 * peaks[0]["n"] ** 3 and peaks[0]["tflops"] > 0
  how = peaks[0]["timing"]
  assert how["calls_per_sample"] >= 1 and how["warmup_s"] >= 0.05 and how["warmup_calls"] >= 1
  assert peaks[0]["ms"]["n"] >= 2
  assert "back-to-back calls with one sync" in stdout
  assert out.with_suffix(".png").stat().st_size > 1000
  for heading in ("== fwd ==", "== fwd+bwd ==", "TF/s", "% peak", "vs peer"):
    assert heading in stdout


def test_report_rerenders_a_file(tiny_run, tmp_path):
  out, _, stdout = tiny_run
  again = tmp_path / "again.jsonl"
  proc = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--report", str(out), "--out",
                         str(again)], cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == stdout.strip()
  assert (tmp_path / "again.png").exists() and not again.exists()


def _isolated_runner(tmp_path, timeout_s=120.0):
  knobs = dict(seed=0, skew=0.0, ep=1, ep_transport="auto", run_precision="bf16", sets=1,
               warmup=0, warmup_s=0.0, reps=1, min_reps=1, budget_s=1.0, peak_n=8,
               peak_warmup_s=0.0)
  opts = runner.Options(shapes=list(shapes.TINY), impls="xla", modes=list(shapes.MODES),
                        knobs=knobs, mode_timeout_s=timeout_s, log_dir=str(tmp_path))
  return opts, runner.make_job(opts, "mok_jax:xla", shapes.TINY[0])


def _statuses(events):
  return {e["record"]["mode"]: e["record"]["status"] for e in events}


def test_worker_error_becomes_an_error_row(tmp_path):
  opts, job = _isolated_runner(tmp_path)
  job["shape"] = {"name": "bad", "T": 0, "H": 1, "I": 1, "E": 1, "k": 1}
  events = runner.execute(opts, job, "bad")
  assert (tmp_path / "bad.log").exists()  # a worker ran it
  assert [e["record"]["status"] for e in events] == ["error", "error"]
  assert all("T must be an int >= 1" in e["record"]["reason"] for e in events)


# A stand-in worker: `python -c FAKE_WORKER JOB.json EVENTS.jsonl`; per mode, BEHAVIOUR (set
# by the test) says ok (a record), hang (sleeps), die (exits 3) or hang_once (hangs in the
# first worker, a record in the next).
FAKE_WORKER = """
import json, os, sys, time
job_path, events_path = sys.argv[1:]
job = json.load(open(job_path))
behaviour = json.loads(os.environ["FAKE_BEHAVIOUR"])
first_worker = len(job["modes"]) == len(behaviour)
out = open(events_path, "a")
for mode in job["modes"]:
  out.write(json.dumps({"event": "stage", "mode": mode, "stage": "compiling " + mode}) + "\\n")
  out.flush()
  what = behaviour[mode]
  if what == "hang" or (what == "hang_once" and first_worker):
    time.sleep(60)
  if what == "die":
    print("boom in " + mode, flush=True)
    sys.exit(3)
  record = {"mode": mode, "status": "ok", "ms": {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}}
  out.write(json.dumps({"event": "record", "record": record, "device": {"platform": "gpu",
                        "name": "fake"}, "wall_s": 0.1, "env_vars": {}}) + "\\n")
  out.flush()
"""


def _fake_worker(monkeypatch, **behaviour):
  monkeypatch.setattr(runner, "WORKER", [sys.executable, "-c", FAKE_WORKER])
  monkeypatch.setenv("FAKE_BEHAVIOUR", json.dumps({m.replace("_", "+"): b
                                                   for m, b in behaviour.items()}))


def test_dead_or_hung_worker_becomes_a_row(tmp_path, monkeypatch):
  opts, job = _isolated_runner(tmp_path, timeout_s=1.0)
  monkeypatch.setattr(runner, "WORKER", [sys.executable, "-c",
                                         "import sys; print('boom'); sys.exit(3)"])
  events = runner.execute(opts, job, "dies")
  assert [e["record"]["status"] for e in events] == ["crashed", "crashed"]
  assert "exit code 3" in events[0]["record"]["reason"]
  assert "boom" in events[0]["record"]["reason"]
  monkeypatch.setattr(runner, "WORKER", [sys.executable, "-c", "import time; time.sleep(60)"])
  events = runner.execute(opts, job, "hangs")
  assert [e["record"]["status"] for e in events] == ["timeout", "timeout"]


def test_slow_backward_keeps_the_forward(tmp_path, monkeypatch):
  """fwd streams its record; fwd+bwd hangs: fwd's result stays, fwd+bwd alone times out, with
  the stage it hung in, after its own timeout (counted from fwd's record)."""
  _fake_worker(monkeypatch, fwd="ok", fwd_bwd="hang")
  opts, job = _isolated_runner(tmp_path, timeout_s=1.5)
  seen = []
  events = runner.execute(opts, job, "slow_bwd", seen.append)
  assert _statuses(events) == {"fwd": "ok", "fwd+bwd": "timeout"}
  assert seen == events  # each record was handed on as it arrived
  reason = events[1]["record"]["reason"]
  assert "1.5 s (--mode-timeout)" in reason and "while compiling fwd+bwd" in reason
  assert events[0]["record"]["ms"]["median"] == 1.0
  assert events[1]["mode_wall_s"] >= 1.5


def test_a_mode_after_a_killed_one_gets_a_fresh_worker(tmp_path, monkeypatch):
  _fake_worker(monkeypatch, fwd="hang_once", fwd_bwd="ok")
  opts, job = _isolated_runner(tmp_path, timeout_s=1.5)
  events = runner.execute(opts, job, "slow_fwd")
  assert _statuses(events) == {"fwd": "timeout", "fwd+bwd": "ok"}
  _fake_worker(monkeypatch, fwd="ok", fwd_bwd="die")
  events = runner.execute(opts, job, "dies_in_bwd")
  assert _statuses(events) == {"fwd": "ok", "fwd+bwd": "crashed"}
  assert "boom in fwd+bwd" in events[1]["record"]["reason"]
  assert "while compiling fwd+bwd" in events[1]["record"]["reason"]


def test_failed_backward_and_good_forward_both_in_json(tmp_path):
  """End to end through real workers: a peer whose fwd+bwd fails while its fwd runs shows both,
  each with its own status, in the JSON and the table."""
  fake = _fake_tokamax(tmp_path)
  out = tmp_path / "out" / "bench.jsonl"
  env = dict(_env(str(fake)), FAKE_TOKAMAX_BWD="fail")
  proc = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--tiny", "--impls", "tokamax",
                         "--mode-timeout", "120", "--out", str(out)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())
          if r["kind"] == "moe"}
  assert rows["fwd"]["status"] == "ok" and rows["fwd"]["ms"]["median"] > 0
  assert rows["fwd"]["mode_wall_s"] > 0
  assert rows["fwd+bwd"]["status"] == "error" and "ms" not in rows["fwd+bwd"]
  assert "backward not supported" in rows["fwd+bwd"]["reason"]
  assert "error [" in proc.stdout and "backward not supported" in proc.stdout
  assert (out.parent / "bench-logs" / "tiny.tokamax.ragged_dot.log").exists()  # beside --out


@pytest.mark.parametrize("mode,factor", [("fwd", 1), ("fwd+bwd", 3)])
def test_flops(mode, factor):
  s = shapes.SHAPES["qwen3_30b"]
  assert s.flops(mode) == factor * 2 * 16384 * 8 * 3 * 2048 * 768
  custom = shapes.parse_shape("4,8,16,2,1")
  assert custom.flops(mode) == expected_flops(4, 8, 16, 2, 1, mode)


@pytest.mark.parametrize("text,error", [("1,2,3,4", "five"), ("1,2,3,4,x", "five"),
                                        ("8,8,8,2,4", "exceeds"), ("0,8,8,2,1", "int >= 1")])
def test_bad_shape(text, error):
  with pytest.raises(ValueError, match=error):
    shapes.parse_shape(text)


def test_select_shapes():
  assert [s.name for s in shapes.select("dsv3,mixtral", [], False)] == ["dsv3", "mixtral"]
  assert [s.name for s in shapes.select(None, [], False)] == list(shapes.SHAPES)
  custom = shapes.select(None, ["64,32,16,4,2"], True)
  assert [s.name for s in custom] == ["tiny", "custom_64_32_16_4_2"]
  assert (custom[1].T, custom[1].H, custom[1].I, custom[1].E, custom[1].k) == (64, 32, 16, 4, 2)
  with pytest.raises(ValueError, match="unknown shape"):
    shapes.select("qwen", [], False)


def test_timing_summary_and_budget():
  stats = timing.summarize([0.004, 0.001, 0.002, 0.003])
  assert stats["median"] == pytest.approx(2.5) and stats["min"] == pytest.approx(1.0)
  assert stats["max"] == pytest.approx(4.0) and stats["n"] == 4
  assert stats["p25"] == pytest.approx(1.75) and stats["p75"] == pytest.approx(3.25)
  assert timing.plan_reps(0.3, reps=20, min_reps=5, budget_s=10) == 20
  assert timing.plan_reps(1.0, reps=20, min_reps=5, budget_s=10) == 10
  assert timing.plan_reps(5.0, reps=20, min_reps=5, budget_s=10) == 5
  assert timing.plan_reps(10.0, reps=20, min_reps=5, budget_s=10) == 3  # 3 budgets at most
  assert timing.plan_reps(100.0, reps=20, min_reps=5, budget_s=10) == 1


class _FakeClock:
  """time.perf_counter for timing.py: advances only when a fake call runs."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


@pytest.mark.parametrize("call_s,warmup_calls,timed", [
    (0.001, 501, 20),  # fast: the first call, then 0.5 s (warmup_s) of calls; all reps
    (0.3, 4, 6),  # 235 ms-ish: the first call and 3 warm-up calls, reps cut to fit 2 s
    (20.0, 2, 1),  # a minute-long mode at worst: the first call, one warm-up, one timed call
])
def test_repeat_is_bounded_for_slow_calls(monkeypatch, call_s, warmup_calls, timed):
  clock = _FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", clock)

  def run_once(i):
    del i
    clock.now += call_s
    return call_s

  seconds, how = timing.repeat(run_once, n_sets=3, warmup=3, warmup_s=0.5, reps=20,
                               min_reps=5, budget_s=2.0, prior_s=call_s)
  assert abs(how["warmup_calls"] - warmup_calls) <= 1 and len(seconds) == timed
  assert (warmup_calls + timed) * call_s <= 3.5 * 2.0 + 3 * call_s


def test_repeat_ignores_a_slow_first_call(monkeypatch):
  """torch's first call spends seconds on one-time setup: it must not cut warm-up or reps."""
  clock = _FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", clock)

  def run_once(i):
    del i
    clock.now += 0.017
    return 0.017

  marked = []
  seconds, how = timing.repeat(run_once, n_sets=3, warmup=3, warmup_s=0.5, reps=20,
                               min_reps=5, budget_s=2.0, prior_s=2.5,
                               on_timed=lambda: marked.append(clock.now))
  assert len(seconds) == 20 and how["warmup_s"] >= 0.5
  # on_timed (a sampler's mark) runs once, after the warm-up and before the timed calls.
  assert how["timed_calls"] == 20 and len(marked) == 1
  assert marked[0] == pytest.approx((how["warmup_calls"] - 1) * 0.017)
  assert clock.now - marked[0] == pytest.approx(20 * 0.017)


def test_batched_syncs_once_per_sample(monkeypatch):
  clock = _FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", clock)
  syncs = []

  def call(i):
    clock.now += 0.001
    return i

  marked = []
  seconds, how = timing.batched(call, syncs.append, n_sets=2, warmup_s=2.0, reps=20, min_reps=5,
                                budget_s=3.0, on_timed=lambda: marked.append(clock.now))
  assert how["calls_per_sample"] == 50 and how["warmup_s"] >= 2.0
  assert len(seconds) == 20 and all(s == pytest.approx(0.001) for s in seconds)
  assert len(syncs) < (how["warmup_calls"] + 20 * 50) / 10  # far fewer syncs than calls
  assert how["timed_calls"] == 20 * 50 and len(marked) == 1
  assert marked[0] == pytest.approx(how["warmup_calls"] * 0.001)
  assert clock.now - marked[0] == pytest.approx(20 * 50 * 0.001)


def test_batched_bounds_the_calls_in_flight(monkeypatch):
  """max_in_flight=2: call j is dispatched only once call j - 2 was waited for, and each sample
  ends with a wait for its last call (and, the queue being in order, for all of them)."""
  clock = _FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", clock)
  events = []

  def call(i):
    clock.now += 0.001
    events.append(("call", sum(1 for e in events if e[0] == "call")))
    return events[-1][1]

  seconds, how = timing.batched(call, lambda j: events.append(("sync", j)), n_sets=1,
                                warmup_s=0.0, reps=2, min_reps=2, budget_s=1.0, sample_s=0.005,
                                max_in_flight=2)
  assert how["calls_per_sample"] == 5 and len(seconds) == 2
  first = how["warmup_calls"]  # the timed samples' calls: first .. first + 9
  timed = [e for e in events if e[1] >= first]
  per_sample = [("call", 0), ("call", 1), ("sync", 0), ("call", 2), ("sync", 1), ("call", 3),
                ("sync", 2), ("call", 4), ("sync", 4)]
  assert timed == [(kind, first + s * 5 + j) for s in range(2) for kind, j in per_sample]


def _record(impl, ms, check, mode="fwd", status="ok", run_id="r"):
  r = {"kind": "moe", "run_id": run_id, "date": "d", "impl": impl,
       "mode": mode, "status": status, "shape": "s", "T": 4, "H": 8, "I": 16, "E": 2, "k": 1,
       "dtype": "bf16", "skew": 0.0, "seed": 0, "flops": int(1e12)}
  if status == "ok":
    r.update(ms={"median": ms, "min": ms, "max": ms}, check=check)
  else:
    r["reason"] = "out of memory"
  return r


def test_derive_speedup_peak_and_checks():
  peak = {"kind": "peak", "run_id": "r", "status": "ok", "dtype": "bf16", "n": 10000,
          "flops": int(2e12), "ms": {"median": 2.0}}
  records = [peak,
             _record("mok_jax:cuda", 1.0, {"y": 100.0}),
             _record("mok_jax:xla", 10.0, {"y": 100.0}),
             _record("jax.ragged_dot", None, None, status="oom"),
             _record("tokamax.ragged_dot", 4.0, {"y": 100.5}),
             _record("torch._grouped_mm", 2.0, {"y": 150.0})]
  got = {r.get("impl"): r for r in report.derive(records)}
  assert got[None]["tflops"] == pytest.approx(1000.0)
  cuda = got["mok_jax:cuda"]
  assert cuda["tflops"] == pytest.approx(1000.0) and cuda["pct_of_peak"] == pytest.approx(100)
  assert cuda["best_peer"] == "torch._grouped_mm"
  assert cuda["speedup_vs_best_peer"] == pytest.approx(2.0)
  assert got["mok_jax:xla"]["check_result"] == "reference"
  assert got["tokamax.ragged_dot"]["check_result"] == "ok"
  assert got["torch._grouped_mm"]["check_result"].startswith("mismatch")
  assert "tflops" not in got["jax.ragged_dot"]
  text = report.table(report.derive(records))
  assert "out of memory [" in text and "disagree with mok_jax:xla" in text


def test_back_to_back_samples_hold_many_calls(monkeypatch):
  """A 25 ms call (dsv3's forward+backward) gets about B2B_SAMPLE_S of calls a sample, one
  synchronisation's latency spread over ten of them, and the record says how long a sample was."""
  clock = _FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", clock)

  def call(i):
    clock.now += 0.025
    return i

  got = timing.back_to_back(call, lambda out: None, {"sets": 3, "reps": 20, "min_reps": 5,
                                                     "budget_s": 3.0})
  assert got["timing_b2b"]["calls_per_sample"] == 10
  assert got["timing_b2b"]["sample_s"] == timing.B2B_SAMPLE_S
  assert got["ms_b2b"]["median"] == pytest.approx(25.0)
  text = report.table(report.derive([dict(_record("mok_jax:cuda", 26.0, {"y": 1.0}),
                                          **got)]))
  assert "samples of about 250 ms" in text


def test_back_to_back_figures_and_failure():
  """timing.back_to_back times the call as batches (calls per sample >= 1, one sync per sample);
  a call that fails there leaves a b2b status and reason, which the table shows with a note."""
  syncs = []
  got = timing.back_to_back(lambda i: i, syncs.append, {"sets": 2, "reps": 3, "min_reps": 2,
                                                        "budget_s": 0.5})
  assert got["ms_b2b"]["n"] == 3 and got["timing_b2b"]["calls_per_sample"] >= 1
  assert len(syncs) >= 3

  def boom(i):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while allocating")

  failed = timing.back_to_back(boom, syncs.append, {"sets": 1, "reps": 3, "min_reps": 2,
                                                    "budget_s": 0.5})
  assert failed["b2b_status"] == "oom" and "RESOURCE_EXHAUSTED" in failed["b2b_reason"]
  peak = {"kind": "peak", "run_id": "r", "status": "ok", "dtype": "bf16", "n": 10000,
          "flops": int(2e12), "ms": {"median": 2.0}}
  ok = dict(_record("mok_jax:cuda", 2.0, {"y": 1.0}), ms_b2b={"median": 1.0})
  bad = dict(_record("torch._grouped_mm", 4.0, {"y": 1.0}), **failed)
  derived = {r.get("impl"): r for r in report.derive([peak, ok, bad])}
  cuda = derived["mok_jax:cuda"]
  assert cuda["tflops_b2b"] == pytest.approx(2 * cuda["tflops"])
  text = report.table(list(derived.values()))
  assert "fwd, back to back: RuntimeError: RESOURCE_EXHAUSTED" in text
  assert "out of memory [1]" in text


def test_report_reads_the_results_files(tmp_path, capsys):
  """--report prints a run of results/ again, from records that carry the SM clocks and joules
  of the benches before the lab diagnostics left it: those fields are passed over."""
  records = os.path.join(REPO, "results", "h100", "h100.jsonl")
  assert '"energy_j"' in open(records).read()
  assert bench_main.main(["--report", records, "--out", str(tmp_path / "again.jsonl")]) == 0
  text = capsys.readouterr().out
  assert "MHz" not in text and "b2b J" not in text and "691.1 TFLOP/s" in text
  head = next(line for line in text.splitlines() if line.startswith("  impl"))
  assert head.split()[1:] == ["median", "ms", "TF/s", "b2b", "ms", "b2b", "TF/s", "%", "peak",
                              "vs", "peer", "mem", "GiB", "compile", "s"]
  row = next(line for line in text.splitlines() if line.startswith("  mok_jax:cuda"))
  # qwen3_30b's forward (results/h100/h100.txt): ms, TF/s; b2b ms, TF/s; % peak, vs peer, GiB
  assert row.split()[1:8] == ["2.63", "469.7", "2.55", "485.3", "68.0", "1.76x", "2.83"]


def test_ep_bytes_count_only_the_routes_that_leave_on_gpus():
  """Ragged (GPUs): a device's routes to another device's experts, the mean over devices;
  whole blocks otherwise. Ids out of range move nothing."""
  shape = shapes.Shape("s", T=2, H=8, I=8, E=4, k=2)
  experts = np.array([[0, 3], [2, -1],  # device 0 (experts 0, 1): 2 routes leave
                      [1, 2], [3, 4]])  # device 1 (experts 2, 3): 1 route leaves
  ragged = jobs.ep_bytes(shape, 2, 2, experts, ragged=True)
  assert ragged["fwd"] == 1.5 * (2 * 8 * 2 + 8)
  assert ragged["fwd+bwd"] == ragged["fwd"] + 1.5 * (2 * 8 * 2 + 4)
  assert jobs.ep_bytes(shape, 2, 2, experts, ragged=False)["fwd"] == 4 * (2 * 8 * 2 + 8)


def test_tiny_expert_parallel(tmp_path):
  """--ep 2 on a CPU (two host devices): mok_jax's backends time the expert-parallel layer,
  with the bytes a device sends; a peer without expert parallelism is a row saying so."""
  out = tmp_path / "bench.jsonl"
  proc = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--tiny", "--ep", "2",
                         "--impls", "mok_jax:ffi,jax.ragged_dot", "--out", str(out)], cwd=REPO,
                        env=_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = {(r["impl"], r["mode"]): r for r in map(json.loads, out.read_text().splitlines())
          if r["kind"] == "moe"}
  T, H, k = (rows["mok_jax:ffi", "fwd"][n] for n in ("T", "H", "k"))
  for mode in ("fwd", "fwd+bwd"):
    r = rows["mok_jax:ffi", mode]
    assert r["status"] == "ok" and r["ep"] == 2 and r["ms"]["median"] > 0, r
    # f32 on a CPU, whose blocks go whole: T k rows to the one other device
    assert r["ep_bytes"]["fwd"] == T * k * (2 * H * 4 + 8)
    assert r["ep_bytes"]["fwd+bwd"] == T * k * (2 * H * 4 + 8) + T * k * (2 * H * 4 + 4)
    peer = rows["jax.ragged_dot", mode]
    assert peer["status"] == "unavailable" and "no expert parallelism" in peer["reason"]
  assert "expert parallelism over 2 devices" in proc.stdout


def test_an_implementation_that_cannot_run_here_says_why():
  """On a CPU: the CUDA kernel and --ep beyond the devices or the experts are unavailable, with
  the reason; a peer has no expert parallelism."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  tiny = shapes.TINY[0]
  for name, ep, why in (("mok_jax:cuda", 1, "not a CUDA GPU"), ("mok_jax:xla", 64, "needs 64"),
                        ("mok_jax:ffi", 3, "does not divide the 16 experts"),
                        ("jax.ragged_dot", 2, "no expert parallelism")):
    with pytest.raises(jobs.Unavailable, match=why):
      jobs.jax_layer(name, tiny, jnp.float32, ep)
  assert callable(jobs.jax_layer("mok_jax:ffi", tiny, jnp.float32, 2))


def test_fp8_needs_what_its_kernels_take():
  """An implementation at a precision it lacks, and mok_jax's C++ FP8 target on a shape off its
  128-blocks or on f32, are unavailable with the reason."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  tiny, tiny_fp8 = shapes.TINY[0], shapes.TINY_FP8[0]
  for name, shape, dtype, why in (("jax.ragged_dot", tiny_fp8, jnp.bfloat16, "runs at bf16 only"),
                                  ("mok_jax:ffi", tiny, jnp.bfloat16, "divisible by 128"),
                                  ("mok_jax:ffi", tiny_fp8, jnp.float32, "take bfloat16")):
    with pytest.raises(jobs.Unavailable, match=why):
      jobs.jax_layer(name, shape, dtype, precision="fp8")
  assert callable(jobs.jax_layer("mok_jax:ffi", tiny_fp8, jnp.bfloat16, precision="fp8"))


def test_impls_by_precision():
  """--precision sets the names' precision and NAME@P another; an alias takes the implementation
  that runs at it (torch: torch._scaled_grouped_mm at fp8); an FP8 run adds the bf16 layer of the
  first mok_jax backend; a name at a precision it lacks is refused. --tiny at fp8 takes the
  FP8 kernels' shape, bf16 on a CPU."""
  fp8 = lambda *names: [(n, "fp8") for n in names]
  assert shapes.resolve_impls("", "gpu", "fp8") == fp8(
      "mok_jax:cuda", "mok_jax:xla", "tokamax.ragged_dot", "torch._scaled_grouped_mm") + [
          ("mok_jax:cuda", "bf16")]
  assert shapes.resolve_impls("", "cpu") == [(n, "bf16") for n in (
      "mok_jax:xla", "mok_jax:ffi", "jax.ragged_dot", "tokamax.ragged_dot", "torch._grouped_mm")]
  assert shapes.resolve_impls("torch,jax@bf16,ffi", "gpu", "fp8") == [
      ("torch._scaled_grouped_mm", "fp8"), ("jax.ragged_dot", "bf16"), ("mok_jax:ffi", "fp8"),
      ("mok_jax:ffi", "bf16")]
  assert shapes.resolve_impls("torch,cuda@fp8", "gpu") == [("torch._grouped_mm", "bf16"),
                                                           ("mok_jax:cuda", "fp8")]
  for bad in ("jax@fp8", "torch._grouped_mm@fp8", "torch._scaled_grouped_mm", "cuda@fp16"):
    with pytest.raises(ValueError, match="no implementation"):
      shapes.resolve_impls(bad, "gpu")
  assert (shapes.label("mok_jax:cuda", "bf16"), shapes.label("mok_jax:cuda", "fp8")) == (
      "mok_jax:cuda", "mok_jax:cuda@fp8")
  args = bench_main.parse_args(["--tiny", "--precision", "fp8"])
  assert args.knobs["run_precision"] == "fp8" and [s.name for s in args.chosen] == ["tiny_fp8"]
  assert bench_main.parse_args(["--tiny"]).chosen == list(shapes.TINY)
  assert (shapes.dtype_for("cpu"), shapes.dtype_for("cpu", "fp8"), shapes.dtype_for("gpu")) == (
      "f32", "bf16", "bf16")


def test_derive_fp8_takes_the_bf16_layer_as_peer_and_reference():
  """Beside mok_jax at fp8, mok_jax's bf16 layer is a peer and, bf16 before FP8, the checks'
  reference; rows are labelled NAME@fp8. Without FP8 a mok_jax row is no peer."""
  records = [dict(_record("mok_jax:cuda", 1.0, {"y": 100.4}), precision="fp8"),
             _record("mok_jax:cuda", 2.0, {"y": 100.0}),
             dict(_record("torch._scaled_grouped_mm", 1.5, {"y": 100.3}), precision="fp8"),
             dict(_record("mok_jax:xla", 9.0, {"y": 130.0}), precision="fp8")]
  got = {r["label"]: r for r in report.derive(records)}
  assert set(got) == {"mok_jax:cuda@fp8", "mok_jax:cuda", "torch._scaled_grouped_mm@fp8",
                      "mok_jax:xla@fp8"}
  cuda8 = got["mok_jax:cuda@fp8"]
  assert cuda8["best_peer"] == "torch._scaled_grouped_mm@fp8"
  assert cuda8["speedup_vs_best_peer"] == pytest.approx(1.5)
  assert got["mok_jax:cuda"]["speedup_vs_best_peer"] == pytest.approx(0.75)
  assert got["mok_jax:cuda"]["check_result"] == "reference"
  assert cuda8["check_vs"] == "mok_jax:cuda" and cuda8["check_result"] == "ok"
  assert got["mok_jax:xla@fp8"]["check_result"].startswith("mismatch")
  text = report.table(list(got.values()))
  assert "\n  mok_jax:cuda@fp8 " in text and "\n  mok_jax:cuda " in text
  assert "@fp8: e4m3 products" in text and "disagree with mok_jax:cuda:" in text
  bf16 = {r["impl"]: r for r in report.derive([_record("mok_jax:cuda", 1.0, {"y": 1.0}),
                                              _record("torch._grouped_mm", 2.0, {"y": 1.0})])}
  assert bf16["mok_jax:cuda"]["best_peer"] == "torch._grouped_mm"
  assert bf16["mok_jax:cuda"]["precision"] == "bf16" and "@fp8" not in report.table(
      list(bf16.values()))


@pytest.fixture(scope="module")
def tiny_fp8_run(tmp_path_factory):
  """--tiny --precision fp8 on the CPU: mok_jax's xla and ffi backends at fp8, the stand-in
  tokamax's quantized ragged_dot, torch._scaled_grouped_mm (no GPU here) and, added by the run,
  mok_jax:xla's bf16 layer."""
  tmp = tmp_path_factory.mktemp("bench_fp8")
  out = tmp / "bench.jsonl"
  proc = subprocess.run([sys.executable, "-m", "mok_jax.bench", "--tiny", "--precision", "fp8",
                         "--impls", "xla,ffi,tokamax,torch", "--out", str(out)], cwd=REPO,
                        env=_env(str(_fake_tokamax(tmp))), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  moe = [r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == "moe"]
  return {(r["impl"], r["precision"], r["mode"]): r for r in moe}, proc.stdout


def test_tiny_fp8_runs_beside_the_bf16_layer(tiny_fp8_run):
  """mok_jax's xla and ffi backends at fp8 run on tiny_fp8 (bf16 on the CPU) on weights quantized
  once, whose quantization's ms the shape's line shows, their checksums off the bf16 layer's,
  which is the reference, by less than 1% (the gradients through the masters); FLOPs as
  bf16's."""
  rows, stdout = tiny_fp8_run
  shape = shapes.TINY_FP8[0]
  assert {key[:2] for key in rows} == {
      ("mok_jax:xla", "fp8"), ("mok_jax:ffi", "fp8"), ("tokamax.ragged_dot", "fp8"),
      ("torch._scaled_grouped_mm", "fp8"), ("mok_jax:xla", "bf16")}
  for r in rows.values():
    assert (r["shape"], r["H"], r["I"], r["dtype"]) == ("tiny_fp8", 128, 128, "bf16")
    assert r["flops"] == expected_flops(shape.T, shape.H, shape.I, shape.E, shape.k, r["mode"])
  for mode in shapes.MODES:
    base = rows["mok_jax:xla", "bf16", mode]
    assert base["status"] == "ok" and base["check_result"] == "reference", base
    for impl in ("mok_jax:xla", "mok_jax:ffi"):
      r = rows[impl, "fp8", mode]
      assert r["status"] == "ok" and r["label"] == impl + "@fp8" and r["ms"]["median"] > 0, r
      assert r["check_vs"] == "mok_jax:xla" and r["check_result"] == "ok", r
      assert r["best_peer"] in ("mok_jax:xla", "tokamax.ragged_dot@fp8")
      assert r["quantize_ms"] > 0 and "quantize_ms" not in rows["mok_jax:xla", "bf16", mode]
      names = {"y"} if mode == "fwd" else set(timing.CHECK_NAMES)
      assert set(r["check"]) == set(base["check"]) == names
      for name, want in base["check"].items():
        assert r["check"][name] != want and r["check"][name] == pytest.approx(want, rel=1e-2)
  assert "mok_jax:xla@fp8" in stdout and "@fp8: e4m3 products" in stdout
  assert re.search(r"tiny_fp8 .*\(quantize_experts [0-9.]+ ms\)", stdout)


def test_tiny_fp8_peers(tiny_fp8_run):
  """The stand-in tokamax's quantized ragged_dot times the forward, close to the bf16 layer;
  its backward, and torch._scaled_grouped_mm without a GPU, are unavailable with the reason."""
  rows, stdout = tiny_fp8_run
  fwd = rows["tokamax.ragged_dot", "fp8", "fwd"]
  assert fwd["status"] == "ok" and fwd["check_result"] == "ok", fwd
  assert fwd["check"]["y"] != rows["mok_jax:xla", "bf16", "fwd"]["check"]["y"]
  bwd = rows["tokamax.ragged_dot", "fp8", "fwd+bwd"]
  assert bwd["status"] == "unavailable" and "forward only" in bwd["reason"]
  for mode in shapes.MODES:
    r = rows["torch._scaled_grouped_mm", "fp8", mode]
    assert r["status"] == "unavailable" and "torch" in r["reason"] and "ms" not in r
  assert "torch._scaled_grouped_mm@fp8  n/a [" in stdout


def test_ep_transport_routes_even_one_device():
  """--ep-transport other than auto runs the routed layer at --ep 1 too (the transport's cost
  beside the fused call): the fused call's bits on the ffi backend; peers have none; the
  option reaches every job."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  tiny = shapes.TINY[0]
  (w_gate, w_up, w_down), sets = inputs.jax_inputs(tiny, jnp.float32, 0, 0.0, 1)
  x, experts, weights, _ = sets[0]
  y = {t: np.asarray(jax.jit(jobs.jax_layer("mok_jax:ffi", tiny, jnp.float32, 1, t))(
      x, experts, weights, w_gate, w_up, w_down)) for t in ("auto", "collective")}
  assert y["auto"].tobytes() == y["collective"].tobytes()
  with pytest.raises(jobs.Unavailable, match="no expert parallelism"):
    jobs.jax_layer("jax.ragged_dot", tiny, jnp.float32, 1, "collective")
  args = bench_main.parse_args(["--tiny", "--ep-transport", "nvlink"])
  assert args.knobs["ep_transport"] == "nvlink"


@pytest.mark.parametrize("argv", [["--ep", "0"], ["--ep-transport", "ring"], ["--skew", "-1"],
                                  ["--reps", "0"], ["--modes", "bwd"], ["--breakdown"],
                                  ["--impls", "cpp"], ["--shapes", "qwen"],
                                  ["--precision", "fp16"], ["--impls", "jax@fp8"],
                                  ["--precision", "fp8", "--impls", "jax"]])
def test_bad_options_are_refused(argv):
  with pytest.raises(SystemExit):
    bench_main.parse_args(["--tiny", *argv])


def test_a_run_cut_short_keeps_its_records(tmp_path, monkeypatch, capsys):
  """Each record reaches --out as it comes; --report derives the figures of such a file."""
  out = tmp_path / "bench.jsonl"
  record = dict(_record("mok_jax:xla", 2.0, {"y": 1.0}), ms_b2b={"median": 1.0})

  def cut_short(opts, on_record):
    on_record(record)
    raise KeyboardInterrupt

  monkeypatch.setattr(runner, "run", cut_short)
  with pytest.raises(KeyboardInterrupt):
    bench_main.main(["--tiny", "--out", str(out)])
  assert [json.loads(line) for line in out.read_text().splitlines()] == [record]
  capsys.readouterr()
  assert bench_main.main(["--report", str(out), "--out", str(tmp_path / "again.jsonl")]) == 0
  row = next(line for line in capsys.readouterr().out.splitlines()
             if line.startswith("  mok_jax:xla"))
  assert row.split()[1:5] == ["2.00", "500.0", "1.00", "1000.0"]  # ms, TF/s; b2b ms, TF/s


def test_out_must_be_a_new_file(tmp_path, capsys):
  out = tmp_path / "bench.jsonl"
  out.write_text("{}\n")
  with pytest.raises(SystemExit):
    bench_main.parse_args(["--tiny", "--out", str(out)])
  assert "exists" in capsys.readouterr().err and out.read_text() == "{}\n"
  args = bench_main.parse_args(["--report", str(out), "--out", str(out)])
  assert args.report == str(out)


def _jax_uniform(dims, salt, width, dtype):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  with jax.default_device(jax.devices("cpu")[0]):
    return inputs.uniform(dims, dtype, jnp.uint32(salt), jnp.float32(width))


@pytest.mark.parametrize("dims,tensor_id", [((3, 5, 7), 1), ((1, 64), 100), ((4, 3, 2), 3)])
def test_the_torch_peers_hash_is_the_jax_one(dims, tensor_id):
  """torch_peer.uniform's steps (mod 2^32 in int64, torch having no uint32 arithmetic), run on
  NumPy int64 and float32 as torch runs them, give inputs.uniform's f32 values bit for bit."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  salt, width = inputs.salt(7, tensor_id), 0.3
  h = np.arange(int(np.prod(dims)), dtype=np.int64)
  h = inputs.fmix((torch_peer._mulmod32(h & inputs.MASK32, inputs.GOLDEN) + salt) & inputs.MASK32,
                  torch_peer._mulmod32)
  assert h.min() >= 0 and h.max() <= inputs.MASK32 and len(np.unique(h)) == h.size
  unit = (h >> 8).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)
  got = (unit * np.float32(width)).reshape(dims)
  want = np.asarray(_jax_uniform(dims, salt, width, jnp.float32))
  assert got.dtype == want.dtype == np.float32 and np.abs(want).max() <= width
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
def test_the_torch_peers_inputs_are_the_jax_ones():
  """On the GPU, torch_peer.uniform's bf16 tensors (in slices of the leading axis) hold
  inputs.uniform's bits: torch's checksums compare with the JAX workers'."""
  torch = pytest.importorskip("torch")
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  for dims, width in (((3, 70, 40), (3 / 70) ** 0.5), ((2049, 33), 3 ** 0.5)):
    salt = inputs.salt(0, 2)
    got = torch_peer.uniform(torch, dims, salt, width, torch.bfloat16, torch.device("cuda"))
    got = got.view(torch.int16).cpu().numpy()
    want = np.asarray(_jax_uniform(dims, salt, width, jnp.bfloat16)).view(np.int16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_the_torch_fp8_grouped_mm_against_its_dequantized_operands():
  """torch_peer.grouped_mm's fp8 (torch._scaled_grouped_mm): y and the data gradient are the
  products of e4m3 operands (a and dy by row, w and w^T by output column, amax / 448) within
  bf16's rounding, the weight gradient the bf16 a^T dy, zero for an expert without rows; y is
  not the bf16 product."""
  torch = pytest.importorskip("torch")
  if not hasattr(torch, "_scaled_grouped_mm"):
    pytest.skip(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
  gen = torch.Generator(device="cuda").manual_seed(0)
  sizes, K, N = [100, 0, 200, 84], 256, 128
  bounds = [0, *np.cumsum(sizes).tolist()]
  offs = torch.tensor(bounds[1:], dtype=torch.int32, device="cuda")
  rand = lambda *dims: torch.randn(*dims, device="cuda", generator=gen)
  a = rand(bounds[-1], K).bfloat16().requires_grad_()
  w = (rand(len(sizes), K, N) / 16).bfloat16().requires_grad_()
  dy = rand(bounds[-1], N).bfloat16()
  y = torch_peer.grouped_mm(torch, "torch._scaled_grouped_mm")(a, w, offs)
  da, dw = torch.autograd.grad(y, [a, w], dy)

  def e4m3(t, dim):  # the values the kernel multiplies, dequantized
    scale = t.detach().float().abs().amax(dim=dim, keepdim=True) / 448
    return (t.detach().float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

  def per_expert(lhs, rhs):
    return torch.cat([lhs[s:e] @ rhs[g] for g, (s, e) in enumerate(zip(bounds, bounds[1:]))])

  want_dw = torch.stack([a[s:e].detach().float().T @ dy[s:e].float()
                         for s, e in zip(bounds, bounds[1:])])
  for got, want in ((y, per_expert(e4m3(a, -1), e4m3(w, -2))),
                    (da, per_expert(e4m3(dy, -1), e4m3(w.mT, -2))), (dw, want_dw)):
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).norm() / want.norm()) < 5e-3
  assert float(dw[1].abs().max()) == 0.0
  plain = torch_peer.grouped_mm(torch, "torch._grouped_mm")(a, w, offs)
  assert float((y - plain).float().norm() / plain.float().norm()) > 1e-2


@pytest.mark.gpu
def test_the_torch_fp8_peer_times_the_layer():
  """torch_peer.run at fp8: both modes ok, each checksum within 2% of the bf16 peer's on the
  same inputs, and not equal to it."""
  pytest.importorskip("torch")
  job = {"modes": list(shapes.MODES), "shape": dataclasses.asdict(shapes.Shape("s", 256, 256,
         256, 8, 2)), "seed": 0, "skew": 0.0, "ep": 1, "sets": 2, "warmup": 1, "warmup_s": 0.0,
         "reps": 2, "min_reps": 1, "budget_s": 0.5}
  got = {}
  for impl in ("torch._grouped_mm", "torch._scaled_grouped_mm"):
    events = torch_peer.run(dict(job, impl=impl, precision=shapes.RUNS_AT[impl][0]))
    got[impl] = {e["record"]["mode"]: e["record"] for e in events if e["event"] == "record"}
  for mode in shapes.MODES:
    fp8, bf16 = got["torch._scaled_grouped_mm"][mode], got["torch._grouped_mm"][mode]
    assert fp8["status"] == bf16["status"] == "ok", (fp8, bf16)
    assert fp8["ms"]["median"] > 0 and set(fp8["check"]) == set(bf16["check"])
    for name, want in bf16["check"].items():
      assert fp8["check"][name] != want and fp8["check"][name] == pytest.approx(want, rel=2e-2)


@pytest.mark.gpu
def test_the_tokamax_fp8_peer_quantizes_its_operands():
  """On the GPU, tokamax's quantized ragged_dot (qwix.QArray operands) gives a y off the bf16
  layer's by the quantization's error (between 0.1% and 10% in norm), not its bits."""
  pytest.importorskip("tokamax")
  pytest.importorskip("qwix")
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  shape = shapes.Shape("s", 256, 256, 256, 8, 2)
  (w_gate, w_up, w_down), sets = inputs.jax_inputs(shape, jnp.bfloat16, 0, 0.0, 1)
  x, experts, weights, _ = sets[0]

  def run(precision):
    layer = jobs.jax_layer("tokamax.ragged_dot", shape, jnp.bfloat16, precision=precision)
    return np.asarray(jax.jit(layer)(x, experts, weights, w_gate, w_up, w_down), np.float32)

  try:
    y = {p: run(p) for p in shapes.PRECISIONS}
  except NotImplementedError as exc:  # the bench records the same failure as the peer's
    pytest.skip(f"tokamax's quantized kernel does not build for this GPU: {exc}"[:300])
  off = np.linalg.norm(y["fp8"] - y["bf16"]) / np.linalg.norm(y["bf16"])
  assert 1e-3 < off < 0.1, off


# The package docstring's rule: __main__ -> report, runner; jobs -> torch_peer -> inputs, timing;
# any of them -> shapes. The bound on the bench's size, every .py of it counted.
IMPORTS = {"__init__": set(), "__main__": {"report", "runner", "shapes"}, "report": {"shapes"},
           "runner": {"shapes"}, "jobs": {"inputs", "shapes", "timing", "torch_peer"},
           "torch_peer": {"inputs", "shapes", "timing"}, "inputs": set(), "timing": set(),
           "shapes": set()}
MAX_LINES = 1300


def test_the_modules_import_one_way_and_stay_small():
  files = sorted(pathlib.Path(REPO, "mok_jax", "bench").glob("*.py"))
  assert {f.stem for f in files} == set(IMPORTS)
  for f in files:
    found = set()
    for node in ast.walk(ast.parse(f.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "mok_jax.bench":
        found |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mok_jax.bench."):
        found.add(node.module.split(".")[2])
      elif isinstance(node, ast.Import):
        found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("mok_jax.bench.")}
    assert found == IMPORTS[f.stem], (f.stem, found)
  assert sum(len(f.read_text().splitlines()) for f in files) <= MAX_LINES
