"""The A/B's SM clock, power and energy sampling (tools/ab/clocks.py), with a stand-in
nvidia-smi and energy poller: what a timing that it watches gets, and that the timing goes on
without nvidia-smi or NVML (test_ab_tools.py: what measure.py prints of it)."""

from __future__ import annotations

import datetime
import os
import pathlib
import stat
import sys
import textwrap
import time

import pytest

from mok_jax.bench import timing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools" / "ab"))
try:
  import clocks  # pylint: disable=import-error,wrong-import-position
finally:
  sys.path.pop(0)

# Prints its arguments to $FAKE_SMI_ARGS, then a sample every 10 ms until terminated, stamped
# as nvidia-smi stamps them; its draw is 120 W until $FAKE_SMI_BUSY exists, then 690-691.5 W.
FAKE_SMI = textwrap.dedent(f"""\
    #!{sys.executable}
    import datetime, os, sys, time
    with open(os.environ["FAKE_SMI_ARGS"], "w") as f:
      f.write(" ".join(sys.argv[1:]))
    for i in range(100000):
      now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
      busy = os.path.exists(os.environ["FAKE_SMI_BUSY"])
      print(f"{{now}}, [N/A], [N/A]" if i == 0 else
            f"{{now}}, {{1400 + 10 * (i % 3)}}, {{690 + i % 2 if busy else 120}}.5", flush=True)
      time.sleep(0.01)
    """)


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
  exe = tmp_path / "nvidia-smi"
  exe.write_text(FAKE_SMI)
  exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("FAKE_SMI_ARGS", str(tmp_path / "args"))
  (tmp_path / "busy").touch()
  monkeypatch.setenv("FAKE_SMI_BUSY", str(tmp_path / "busy"))
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
  return tmp_path / "args"


def test_parse_takes_medians_and_skips_what_is_not_a_sample():
  text = ("2026/12/04 18:40:01.100, 1980, 121.0\n2026/12/04 18:40:01.200, [N/A], [N/A]\n"
          "2026/12/04 18:40:01.300, 1500, 700.5\n1290, 690.0\n"
          "2026/12/04 18:40:01.500, 1290, 690.0\n\n")
  assert clocks.parse(text) == {"sm_mhz": 1500.0, "power_w": 690.0, "samples": 3}
  assert clocks.parse("") is None and clocks.parse("No devices were found\n") is None
  # From `since` on (time.time(); the stamps are local time).
  since = datetime.datetime(2026, 12, 4, 18, 40, 1, 250000).timestamp()
  assert clocks.parse(text, since=since)["samples"] == 2
  assert clocks.parse(text, since=since + 1.0) is None
  assert clocks.parse(text, since=since, until=since + 0.1)["samples"] == 1


@pytest.mark.parametrize("visible,index", [(None, "0"), ("", "0"), ("2", "2"), ("3, 1", "3"),
                                           ("GPU-8c1e", "GPU-8c1e")])
def test_gpu_index_is_the_jobs_first_visible_device(visible, index, monkeypatch):
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  assert clocks.gpu_index(visible) == index


def _b2b(call, gpu: dict, reps: int, budget_s: float):
  """measure.py's back-to-back timing, watched by clocks.sampling from its timed calls on."""
  with clocks.sampling(gpu, "b2b") as mark:
    return timing.batched(call, lambda out: None, n_sets=2, warmup_s=0.0, reps=reps,
                          min_reps=reps, budget_s=budget_s, max_in_flight=2, on_timed=mark)


def test_back_to_back_records_the_clock_it_ran_at(fake_smi):
  # Calls of 20 ms, samples of about 50 ms of them: the stand-in has started long before the end.
  gpu = {}
  seconds, _ = _b2b(lambda i: time.sleep(0.02), gpu, reps=8, budget_s=2.0)
  assert len(seconds) == 8
  gpu = gpu["b2b"]
  assert gpu["samples"] >= 2 and 1400 <= gpu["sm_mhz"] <= 1420
  assert 690 <= gpu["power_w"] <= 691.5
  args = fake_smi.read_text().split()
  assert args[:2] == ["-i", "3"] and "--query-gpu=timestamp,clocks.sm,power.draw" in args


def test_without_nvidia_smi_the_timing_stands_alone(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  gpu = {}
  seconds, how = _b2b(lambda i: i, gpu, reps=2, budget_s=0.2)
  assert gpu == {} and len(seconds) == 2 and how["calls_per_sample"] >= 1


def test_the_poller_prints_nothing_without_nvml(monkeypatch, capsys):
  def no_library(name):
    raise OSError(f"{name}: cannot open shared object file")

  monkeypatch.setattr(clocks.ctypes, "CDLL", no_library)
  clocks.poll_energy("0")  # returns at once: nothing to poll
  assert capsys.readouterr().out == ""


def test_energy_between_takes_the_steps_inside_and_the_draw_at_each_end():
  # 700 W in steps of 100 ms seen at t = 1.0, 1.1, ...: any block's joules are 700 W x its span,
  # whatever the phase of its ends between two steps.
  steps = [(1.0 + 0.1 * i, 5_000 + 70_000 * i) for i in range(30)]
  for t0, t1 in ((1.234, 3.456), (1.05, 1.351), (2.0, 2.9)):
    assert clocks.energy_between(steps, t0, t1) == pytest.approx(700 * (t1 - t0))
  # A draw that changes: 100 W until 2.0, then 600 W; the block [1.95, 2.55] from its steps.
  watts = [100 if 1.0 + 0.1 * i < 2.0 - 1e-9 else 600 for i in range(1, 30)]
  steps = [(1.0, 0)]
  for i, w in enumerate(watts, 1):
    steps.append((1.0 + 0.1 * i, steps[-1][1] + 100 * w))
  got = clocks.energy_between(steps, 2.0, 2.55)
  assert got == pytest.approx(600 * 0.55)
  # A poller 50 ms late to see the first step inside (2.1 s, seen at 2.15, close to the next):
  # the ends at the draw between the first and last steps stay within 7% (at the first step's
  # draw, 70 J over the 50 ms to the next, they would be off by 2.7 times).
  steps = [(1.0 + 0.1 * i, 70_000 * i) for i in range(30)]
  steps[11] = (2.15, steps[11][1])
  assert clocks.energy_between(steps, 2.05, 2.95) == pytest.approx(700 * 0.9, rel=0.07)
  # Fewer than three steps inside: no figure.
  assert clocks.energy_between(steps, 2.01, 2.15) is None
  assert clocks.energy_between([], 0.0, 10.0) is None


def test_energy_changes_yields_the_first_reading_and_each_change_until_a_read_fails(monkeypatch):
  monkeypatch.setattr(clocks.time, "sleep", lambda s: None)
  readings = iter([5, 5, 7, 7, 7, 9, None, 11])
  got = list(clocks.energy_changes(lambda: next(readings)))
  assert [mj for _, mj in got] == [5, 7, 9]
  assert all(a <= b for (a, _), (b, _) in zip(got, got[1:]))


def test_parse_steps_drops_the_first_reading_and_what_is_not_a_step():
  assert clocks.parse_steps("1.0 5\nTraceback\n\n1.1 7\n1.2 9 extra\n") == [(1.1, 7), (1.2, 9)]
  assert clocks.parse_steps("") == []


# A stand-in energy poller: 100 W, a step every 20 ms, as "monotonic-seconds mJ" lines.
FAKE_POLLER = textwrap.dedent("""\
    import time
    mj = 0
    while True:
      print(f"{time.monotonic():.6f} {mj}", flush=True)
      time.sleep(0.02)
      mj += 2000
    """)


def test_sampling_records_the_joules_from_its_mark(fake_smi, tmp_path, monkeypatch):
  poller = tmp_path / "poller.py"
  poller.write_text(FAKE_POLLER)
  monkeypatch.setattr(clocks, "poller_args", lambda visible: [sys.executable, str(poller)])
  busy = tmp_path / "busy"
  busy.unlink()  # the warm-up draws 120 W (the stand-in nvidia-smi's), the timed calls 690
  out = {}
  with clocks.sampling(out, "gpu") as mark:
    time.sleep(0.3)  # the warm-up: not counted
    busy.touch()
    time.sleep(0.05)  # a sample the stand-in may have taken before it saw the file
    mark()
    time.sleep(0.4)
  gpu = out["gpu"]
  assert gpu["samples"] >= 10 and 0.4 <= gpu["block_s"] < 0.6
  assert gpu["power_w"] >= 690 and gpu["energy_j"] == pytest.approx(100 * gpu["block_s"], rel=0.25)
  # No poller output (no NVML): no joules, the rest stands.
  monkeypatch.setattr(clocks, "poller_args", lambda visible: [sys.executable, "-c", "pass"])
  out = {}
  with clocks.sampling(out, "gpu"):
    time.sleep(0.5)
  assert "energy_j" not in out["gpu"] and out["gpu"]["samples"] >= 1
