"""The A/B tools of tools/ab (tools/README.md), on the CPU: measure.py, which tools/ab/run.sh runs
for each build (the bits of y and of every gradient, the same when run again, and the wall-clock
medians per call and back to back), ncu_call.py, sass.py's parsers, and export.sh."""

import importlib
import os
import pathlib
import shutil
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


def _tool(name):
  """tools/ab/<name>.py as a module."""
  sys.path.insert(0, str(SCRIPT.parent))
  try:
    return importlib.import_module(name)
  finally:
    sys.path.pop(0)


def test_short_kernel_names():
  def kind(a, b, epi, sched):
    return (f"mok::sm90::GemmKind<(cute::SM90::GMMA::Major){a}, (cute::SM90::GMMA::Major){b}, "
            f"(mok::sm90::Epilogue){epi}, (mok::sm90::Schedule){sched}>")
  short = _tool("measure").short
  down, weights = kind(0, 0, 3, 0), kind(1, 1, 0, 1)
  assert short(f"void mok::sm90::GemmChainKernel<{down}, {down}, 4>(mok::sm90::ChainParams)") == (
      "gemm0030")
  assert short(f"void mok::sm90::GemmChainKernel<{weights}, {weights}, 2, 1>"
               "(mok::sm90::ChainParams)") == "gemm1101"
  assert short("void mok::sm90::GatherKernel(uint4 const*, int const*)") == "GatherKernel"


def test_call_spans():
  measure = _tool("measure")
  # Two calls: kernels 0-10, 12-30 (a 2 us gap) and 25-28 (overlapping); then 200-250.
  launches = [(0.0, 10.0), (12.0, 30.0), (25.0, 28.0), (200.0, 250.0)]
  assert measure.call_spans(launches) == [30.0, 50.0]
  assert measure.call_spans(launches, gap_us=1.0) == [10.0, 18.0, 50.0]
  assert measure.call_spans([]) == []


def test_export_writes_each_ref_as_a_source_tree(tmp_path):
  repo = tmp_path / "repo"
  (repo / "tools" / "ab").mkdir(parents=True)
  shutil.copy(SCRIPT.parent / "export.sh", repo / "tools" / "ab" / "export.sh")
  git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
  subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
  (repo / "f.txt").write_text("one\n")
  subprocess.run([*git, "add", "."], check=True)
  subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
  subprocess.run([*git, "checkout", "-q", "-b", "wip/x"], check=True)
  (repo / "f.txt").write_text("two\n")
  subprocess.run([*git, "commit", "-q", "-am", "two"], check=True)
  (repo / "runs" / "ab" / "stale").mkdir(parents=True)
  out = subprocess.run(["bash", "tools/ab/export.sh", "main", "wip/x"], cwd=repo, check=True,
                       capture_output=True, text=True).stdout.split()
  assert out[0::2] == ["main", "wip-x"]
  assert sorted(p.name for p in (repo / "runs" / "ab").iterdir()) == ["main", "wip-x"]
  assert (repo / "runs" / "ab" / "main" / "f.txt").read_text() == "one\n"
  assert (repo / "runs" / "ab" / "wip-x" / "f.txt").read_text() == "two\n"
  assert (repo / "runs" / "ab" / "main" / "tools" / "ab" / "export.sh").exists()


def test_run_sh_parses():
  subprocess.run(["bash", "-n", str(SCRIPT.parent / "run.sh")], check=True)


def test_ncu_call_runs_one_call():
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu")
  for mode in ("fwd", "fwd+bwd"):
    out = subprocess.run([sys.executable, str(SCRIPT.parent / "ncu_call.py"), "tiny", mode],
                         env=env, check=True, capture_output=True, text=True, timeout=300).stdout
    assert out.split() == ["tiny", f"{mode}:", "one", "call"]


def test_digest_follows_every_bit_and_position():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  digest = _tool("measure").digest
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


def test_pow2_keeps_sign_and_exponent_only():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  pow2 = _tool("measure").pow2
  for dtype in (jnp.bfloat16, jnp.float32):
    a = jnp.asarray([1.7, -3.2, 0.0, -0.0, 5e-3, 0.75, -1.0, 96.0], dtype)
    got = np.asarray(pow2(a), np.float32)
    np.testing.assert_array_equal(got, [1.0, -2.0, 0.0, 0.0, 2.0**-8, 0.5, -1.0, 64.0])
    assert np.signbit(got[3]), dtype
    assert pow2(a).dtype == dtype


def test_measure_with_pow2_inputs_changes_the_bits():
  env = dict(os.environ, MOK_AB_BACKEND="xla", JAX_PLATFORMS="cpu", MOK_AB_DATA="pow2")
  out = subprocess.run([sys.executable, str(SCRIPT), "cpu", "tiny", "fwd"], env=env, check=True,
                       capture_output=True, text=True, timeout=300).stdout
  pow2_bits = [line.split()[3:] for line in out.splitlines() if line.split()[2] == "bits"]
  plain_bits = [f[3:] for f in _run("fwd") if f[2] == "bits"]
  assert len(pow2_bits) == len(plain_bits) == 1
  assert all(a != b for a, b in zip(pow2_bits[0], plain_bits[0]))


def test_joules_a_call_as_printed():
  joules = _tool("measure").joules
  assert joules({"energy_j": 12.5, "block_s": 2.5, "sm_mhz": 1500.0},
                {"timed_calls": 10}) == ", 1.250 J a call (5 W)"
  assert joules({"sm_mhz": 1500.0}, {"timed_calls": 10}) == joules(None, {"timed_calls": 10}) == ""
  assert joules({"energy_j": 12.5}, {"timed_calls": 0}) == joules({"energy_j": 12.5}, {}) == ""


# A cuobjdump -sass excerpt: kernel k, whose k-loop (0x0030-0x0070) holds an LDL, and whose
# tile loop around it (0x0010-0x0090) a STL; kernel j has no loop.
DUMP = """
\t\tFunction : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x0 */
        /*0010*/                   STL [R1], R2 ;                  /* 0x0 */
        /*0020*/                   IMAD R3, R3, 0x2, RZ ;          /* 0x0 */
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4], R5 ; /* 0x0 */
        /*0040*/              @!P1 LDL R6, [R1+0x4] ;              /* 0x0 */
        /*0050*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12].tnspB, R24 ; /* 0x0 */
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ; /* 0x0 */
        /*0070*/              @!P2 BRA 0x30 ;                      /* 0x0 */
        /*0080*/                   LDL R7, [R1] ;                  /* 0x0 */
        /*0090*/              @!P3 BRA 0x10 ;                      /* 0x0 */
        /*00a0*/                   EXIT ;                          /* 0x0 */
\t\tFunction : j
        /*0000*/                   EXIT ;                          /* 0x0 */
"""


def test_sass_spills_says_which_run_in_a_k_loop():
  (k, count, loops, found), (j, count_j, loops_j, found_j) = _tool("sass").spills(DUMP)
  assert (k, count, j, count_j) == ("k", 11, "j", 1)
  assert loops == [(0x30, 0x70, 5)] and loops_j == [] and found_j == []
  assert [(a, t.split()[-3 if t.startswith("@") else 0], hot) for a, t, hot in found] == [
      (0x10, "STL", False), (0x40, "LDL", True), (0x80, "LDL", False)]


def test_sass_stalls_sums_samples_by_reason_and_loop():
  head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb",
          "stall_barrier", "stall_long_sb (Not Issued)"]
  rows = [["Kernel Name", "k"], head,
          ["0x7f00", "MOV R1, c[0x0][0x28]", "10", "0", "10", "0"],
          ["0x7f10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4], R5", "60", "55", "5", "9"],
          ["0x7f20", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12].tnspB, R24", "20", "0", "20", "0"],
          ["0x7f30", "@!P2 BRA 0x7f10", "10", "10", "0", "0"]]
  total, by_reason, in_loops, top = _tool("sass").stalls(rows)
  assert total == 100 and by_reason == {"long_sb": 65, "barrier": 35}
  assert in_loops == 0.9  # the loop 0x7f10-0x7f30
  assert [(s, a) for s, a, _, _ in top[:2]] == [(60, 0x10), (20, 0x20)]
  assert top[0][3] == ["long_sb", "barrier"]
