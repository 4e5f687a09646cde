"""examples/train_lm.py on a GPU with its MoE layers on the CUDA kernel and on the XLA backend:
the same seed, batches and bf16 compute give the same loss curve, to bf16 rounding; and with
--precision fp8 (the FP8 kernels) a held-out loss within 2% of bf16's.

The two backends round at the same points but accumulate in other orders, so their first losses
agree to a few bf16 ulps of the logits; Adam then turns ulp-level gradient differences into
parameter updates of full size, and the curves drift apart a little. Both curves, their
relative differences and the step times are printed and, when MOK_TEST_ARTIFACTS names a
folder, written to train_lm_gpu.json there.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from test_train_lm import load_example

pytestmark = pytest.mark.gpu

STEPS = 30
# A small model (H and I multiples of 64, as the CUDA kernel needs): a run takes seconds on an
# H200, most of them compiling.
MODEL = ["--d-model", "128", "--layers", "2", "--heads", "4", "--experts", "8", "--top-k", "2",
         "--expert-size", "128", "--seq-len", "128", "--batch", "16"]
# --lr 1e-3 rather than the default 3e-3: the curves drift most where the loss falls fastest.
RUN = ["--steps", str(STEPS), "--lr", "1e-3", "--dtype", "bfloat16", "--eval-every", str(STEPS),
       "--eval-batches", "2", "--ckpt-every", str(STEPS), "--sample-len", "0", "--no-progress"]
# Step 1: the same parameters and batch, so only the layer's own rounding differs (the C++ CPU
# target against the XLA backend, bf16, this model: 1e-7).
FIRST_STEP_RTOL = 1e-3
# Every step: the drift described above (C++ CPU target against XLA: at most 3.2e-3 over seeds
# 0 and 1; 1.5e-2 with --lr 3e-3).
STEP_RTOL = 2e-2


def train(example, backend, out: pathlib.Path, extra) -> dict:
  summary = example.main([*MODEL, *RUN, *extra, "--backend", backend, "--out", str(out)])
  history = json.loads((out / "history.json").read_text())
  return {"train": [loss for _, loss in history["train"]], "eval": history["eval"],
          "median_step_ms": summary["median_step_ms"]}


def compare(backend, reference, tmp_path, extra) -> dict:
  example = load_example()
  runs = {name: train(example, name, tmp_path / name, extra) for name in (backend, reference)}
  got, want = (np.asarray(runs[name]["train"]) for name in (backend, reference))
  rel = np.abs(got - want) / np.abs(want)
  result = {"device": jax.devices()[0].device_kind, "argv": MODEL + RUN + extra, "runs": runs,
            "rel_diff": rel.tolist(),
            "max_rel_diff": float(rel.max()), "max_rel_diff_step": int(rel.argmax()) + 1}
  print(f"step  {backend:>8}  {reference:>8}  rel diff")
  for step, (a, b, r) in enumerate(zip(got, want, rel), 1):
    print(f"{step:4d}  {a:8.4f}  {b:8.4f}  {r:.2e}")
  print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "rel_diff")}))
  folder = os.environ.get("MOK_TEST_ARTIFACTS")
  if folder:
    os.makedirs(folder, exist_ok=True)
    name = "train_lm_gpu" + "".join(a.strip("-").replace("-", "_") for a in extra)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
      json.dump(result, f, indent=1)
  return result


@pytest.mark.parametrize("layers", ["loop", "scan"])
def test_cuda_and_xla_backends_give_the_same_loss_curve(tmp_path, layers):
  result = compare("cuda", "xla", tmp_path, ["--scan-layers"] if layers == "scan" else [])
  cuda, xla = (np.asarray(result["runs"][name]["train"]) for name in ("cuda", "xla"))
  rel = np.asarray(result["rel_diff"])
  assert len(cuda) == len(xla) == STEPS
  # A byte model starts near ln(256) = 5.55 nats; a learning run, not a flat one, is compared.
  assert xla[0] > 5.0 and xla[-5:].max() < xla[0] - 2.0, xla
  assert rel[0] <= FIRST_STEP_RTOL, (cuda[0], xla[0])
  assert rel.max() <= STEP_RTOL, (result["max_rel_diff_step"], rel.max())
  # The held-out loss after the last step: the same tolerance as the training curve.
  (_, cuda_eval), = result["runs"]["cuda"]["eval"]
  (_, xla_eval), = result["runs"]["xla"]["eval"]
  assert cuda_eval == pytest.approx(xla_eval, rel=STEP_RTOL)


# examples/train_lm.py --precision fp8 against bf16 on the CUDA kernels, the example's defaults
# otherwise: the held-out loss after the same steps within 2% (issue 65's bar). On one H100
# (2026-12-08, 300 steps, from the command line): 2.000 nats/byte against bf16's 1.988.
FP8_STEPS = 300
FP8_EVAL_RTOL = 2e-2


def test_fp8_trains_like_bf16(tmp_path):
  example = load_example()
  final = {}
  for precision in ("bf16", "fp8"):
    out = tmp_path / precision
    summary = example.main(["--backend", "cuda", "--precision", precision, "--steps",
                            str(FP8_STEPS), "--sample-len", "0", "--no-progress", "--out",
                            str(out)])
    final[precision] = summary["final_held_out_loss"]
  print(json.dumps(final))
  assert final["fp8"] == pytest.approx(final["bf16"], rel=FP8_EVAL_RTOL)
