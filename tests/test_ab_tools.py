"""tools/ab/measure.py, which the device A/B of builds runs for each build, on the CPU: it prints
the bits of y and of every gradient and the wall-clock medians (per call and back to back), and
the same bits when run again."""

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "tools" / "ab" / "measure.py"


def _run():
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(SCRIPT), "cpu", "tiny"], env=env, check=True,
                       capture_output=True, text=True, timeout=300).stdout
  return [line.split() for line in out.splitlines()]


def test_measure_prints_bits_and_walls():
  first, second = _run(), _run()
  bits = [f for f in first if f[2] == "bits"]
  assert len(bits) == 1
  names = [field.split("=")[0] for field in bits[0][3:]]
  assert names == ["y", "dx", "dweights", "dw_gate", "dw_up", "dw_down"]
  assert all(len(field.split("=")[1]) == 10 for field in bits[0][3:])
  for kind in ("wall", "b2b"):
    walls = {f[3]: float(f[4]) for f in first if f[2] == kind}
    assert set(walls) == {"fwd", "fwd+bwd"} and all(w > 0 for w in walls.values()), kind
  assert bits == [f for f in second if f[2] == "bits"]


def test_call_spans():
  sys.path.insert(0, str(SCRIPT.parent))
  try:
    import measure  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.pop(0)
  # Two calls: kernels 0-10, 12-30 (a 2 us gap) and 25-28 (overlapping); then 200-250.
  launches = [(0.0, 10.0), (12.0, 30.0), (25.0, 28.0), (200.0, 250.0)]
  assert measure.call_spans(launches) == [30.0, 50.0]
  assert measure.call_spans(launches, gap_us=1.0) == [10.0, 18.0, 50.0]
  assert measure.call_spans([]) == []

