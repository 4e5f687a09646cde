"""tools/ab/measure.py, which the device A/B of builds runs for each build, on the CPU: it prints
the bits of y and of every gradient and the wall-clock medians (per call and back to back), and
the same bits when run again."""

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "tools" / "ab" / "measure.py"


def _run(*modes):
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(SCRIPT), "cpu", "tiny", *modes], env=env, check=True,
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
  for kind in ("span", "kernels", "b2b-span", "b2b-kernels"):
    assert sorted(f[3] for f in first if f[2] == kind) == ["fwd", "fwd+bwd"], kind


def test_measure_times_the_modes_asked():
  out = _run("fwd+bwd")
  assert {f[3] for f in out if f[2] in ("wall", "b2b")} == {"fwd+bwd"}
  assert len([f for f in out if f[2] == "bits"]) == 1


def _measure():
  sys.path.insert(0, str(SCRIPT.parent))
  try:
    import measure  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.pop(0)
  return measure


def test_short_kernel_names():
  def kind(a, b, epi, sched):
    return (f"mok::sm90::GemmKind<(cute::SM90::GMMA::Major){a}, (cute::SM90::GMMA::Major){b}, "
            f"(mok::sm90::Epilogue){epi}, (mok::sm90::Schedule){sched}>")
  short = _measure().short
  down, gate_up, weights = kind(0, 0, 3, 0), kind(0, 0, 1, 0), kind(1, 1, 0, 1)
  assert short(f"void mok::sm90::GemmChainKernel<{down}, {down}, 4>(mok::sm90::ChainParams)") == (
      "gemm0030")
  assert short(f"void mok::sm90::DualChainKernel<{gate_up}, {gate_up}, {weights}, {weights}>"
               "(mok::sm90::ChainParams, mok::sm90::ChainParams, int)") == "dual0010_1101"
  assert short("void mok::sm90::GatherKernel(uint4 const*, int const*)") == "GatherKernel"


def test_call_spans():
  measure = _measure()
  # Two calls: kernels 0-10, 12-30 (a 2 us gap) and 25-28 (overlapping); then 200-250.
  launches = [(0.0, 10.0), (12.0, 30.0), (25.0, 28.0), (200.0, 250.0)]
  assert measure.call_spans(launches) == [30.0, 50.0]
  assert measure.call_spans(launches, gap_us=1.0) == [10.0, 18.0, 50.0]
  assert measure.call_spans([]) == []



def test_ncu_call_runs_one_call():
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu")
  for mode in ("fwd", "fwd+bwd"):
    out = subprocess.run([sys.executable, str(SCRIPT.parent / "ncu_call.py"), "tiny", mode],
                         env=env, check=True, capture_output=True, text=True, timeout=300).stdout
    assert out.split() == ["tiny", f"{mode}:", "one", "call"]


def test_host_timeline_lists_host_events():
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(SCRIPT.parent / "host_timeline.py"), "tiny"],
                       env=env, check=True, capture_output=True, text=True,
                       timeout=300).stdout.splitlines()
  assert out[0] == "tiny fwd: host events, us a call (the 30 longest):"
  rows = [line.split(None, 2) for line in out[1:-1]]
  assert 0 < len(rows) <= 30 and all(float(us) >= 0 and x.startswith("x") for us, x, _ in rows)
  assert any("PjitFunction" in name for _, _, name in rows), rows
  assert out[-1] == "no GPU kernels in the trace"  # a CPU run


def test_digest_follows_every_bit_and_position():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  digest = _measure().digest
  rng = np.random.default_rng(0)
  for dtype in (jnp.bfloat16, jnp.float32):
    a = jnp.asarray(rng.standard_normal((64, 48)), dtype)
    d = digest(a)
    assert len(d) == 10 and d == digest(jnp.array(a))
    changed = {d}
    for flat, bit in ((0, 0), (1000, 7), (3071, a.dtype.itemsize * 8 - 1)):
      bits = np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).copy()
      bits.reshape(-1)[flat] ^= 1 << bit
      changed.add(digest(jnp.asarray(bits.view(np.asarray(a).dtype))))
    swapped = np.asarray(a).copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    changed.add(digest(jnp.asarray(swapped)))
    assert len(changed) == 5, dtype


def test_sync_latency_finds_its_calls():
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(SCRIPT.parent / "sync_latency.py"), "tiny"],
                       env=env, check=True, capture_output=True, text=True, timeout=300).stdout
  assert out.splitlines() == ["no GPU kernels in the 20 calls traced"]  # a CPU run
