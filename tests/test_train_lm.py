"""examples/train_lm.py for a handful of steps on a tiny model: as a program with --ep 2 (the
script makes its own host devices), then resumed in-process from its checkpoint without expert
parallelism. Checks that the loss goes down and that the plot and checkpoints exist."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2",
        "--expert-size", "32", "--seq-len", "32", "--batch", "8", "--lr", "1e-2",
        "--eval-every", "6", "--eval-batches", "2", "--ckpt-every", "6", "--sample-len", "8",
        "--no-progress"]


def load_example():
  spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_train_lm_runs_resumes_and_learns(tmp_path):
  out = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --ep makes its own devices
  done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--steps", "12", "--ep", "2",
                         "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "experts over 2 devices" in done.stdout
  assert "unigram byte entropy" in done.stdout and "sample:" in done.stdout
  summary = json.loads((out / "summary.json").read_text())
  assert summary["units"] == "nats/byte"
  assert (out / "train_lm.png").stat().st_size > 10_000
  assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["12", "6"]

  # Resume in this process (8 devices from conftest, no expert parallelism): the sharded
  # checkpoint restores into an unsharded model and training continues from step 12.
  resumed = load_example().main([*TINY, "--steps", "18", "--out", str(out), "--resume"])
  assert resumed["start"] == 12
  assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["12", "18"]
  history = json.loads((out / "history.json").read_text())
  train = [loss for _, loss in history["train"]]
  evals = [loss for _, loss in history["eval"]]
  assert len(train) == 18 and [s for s, _ in history["eval"]] == [6, 12, 18]
  # A byte model starts near ln(256) = 5.55 nats; a few steps must take it well below.
  assert train[0] > 5.0 and max(train[-3:]) < train[0] - 1.0, train
  assert evals[-1] < evals[0] and evals[-1] == resumed["final_held_out_loss"], evals


def test_train_lm_scans_its_layers(tmp_path):
  """--scan-layers: the blocks stacked and run by nnx.scan, with the per-layer bias update."""
  summary = load_example().main([*TINY, "--layers", "2", "--scan-layers", "--bias-rate", "1e-3",
                                 "--steps", "12", "--out", str(tmp_path)])
  history = json.loads((tmp_path / "history.json").read_text())
  train = [loss for _, loss in history["train"]]
  assert train[0] > 5.0 and max(train[-3:]) < train[0] - 1.0, train
  counts = np.asarray(history["load"][-1][1])
  assert counts.shape == (2, 4) and (counts.sum(-1) == 8 * 32 * 2).all()  # B S k a layer
  assert summary["final_held_out_loss"] < 5.0


def test_train_lm_in_fp8(tmp_path):
  """--precision fp8: the experts' products block-quantized (the xla backend); it trains."""
  summary = load_example().main([*TINY, "--precision", "fp8", "--steps", "12",
                                 "--out", str(tmp_path)])
  history = json.loads((tmp_path / "history.json").read_text())
  train = [loss for _, loss in history["train"]]
  assert train[0] > 5.0 and max(train[-3:]) < train[0] - 1.0, train
  assert summary["final_held_out_loss"] < 5.0
