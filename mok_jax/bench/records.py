"""What the JAX and the PyTorch jobs (jobs.py, torch_peer.py) share: the dtype names, the
records of a failed mode, stage events and the back-to-back timing of a call."""

from __future__ import annotations

import math

from mok_jax.bench import clocks, peers, timing

DTYPES = ("auto", "bf16", "f32")


def resolve_dtype(name: str, platform: str) -> str:
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
  if name == "auto":
    return "bf16" if platform == "gpu" else "f32"
  return name


def finite_or_text(value: float):
  """JSON has no NaN or inf: keep those as text so that the file stays standard JSON."""
  return value if math.isfinite(value) else str(value)


def failed(modes, status: str, reason: str, **extra) -> list[dict]:
  return [dict(mode=mode, status=status, reason=reason, **extra) for mode in modes]


def stage(mode: str, text: str) -> dict:
  return {"event": "stage", "mode": mode, "stage": text}


# Seconds of calls in one back-to-back sample: enough calls that one synchronisation's latency
# (0.4-0.7 ms with JAX) is spread over many of them.
#
# At the dense peak's 50 ms a sample would hold only one or two forward+backward calls of
# mixtral and dsv3 (22.5-40 ms each on an H200), whose b2b figure would then still pay a
# synchronisation every call or two; at 250 ms every shape's mok_jax and torch modes get 6-86
# calls a sample.
B2B_SAMPLE_S = 0.25


def back_to_back(call, sync, job: dict) -> dict:
  """The MoE mode's call timed as the dense peak is (timing.batched: back-to-back calls, one
  synchronisation per sample of many), after its one-synchronised-call-at-a-time timing:
  {"ms_b2b", "timing_b2b"}, or {"b2b_status", "b2b_reason"} if it failed (the mode's own
  figures stand). Every implementation gets both; the per-call figure includes the framework's
  dispatch and synchronisation latency, which layers running back to back in a training step
  do not pay one by one. sync(out) must wait for that call alone (and those before it): at most
  two calls are in flight, so that the forward's back-to-back calls hold two forwards' buffers,
  under what the forward+backward mode, which runs after it in the same process and reports
  the process's peak, needs itself."""
  # Half the mode's budget and at least 3 samples: it comes on top of the mode's own timing,
  # under the same --mode-timeout, and a slow call's two figures differ little.
  # gpu_b2b: the SM clock and power meanwhile (clocks.py), which a power limit lowers.
  found = {}
  try:
    with clocks.sampling(found, "gpu_b2b") as mark:
      seconds, how = timing.batched(call, sync, n_sets=job["sets"], warmup_s=0.0,
                                    reps=job["reps"], min_reps=min(3, job["min_reps"]),
                                    budget_s=job["budget_s"] / 2, sample_s=B2B_SAMPLE_S,
                                    max_in_flight=2, on_timed=mark)
  except Exception as exc:  # pylint: disable=broad-except
    return {"b2b_status": peers.failure_status(exc), "b2b_reason": peers.describe_exception(exc)}
  return {"ms_b2b": timing.summarize(seconds), "timing_b2b": how, **found}
