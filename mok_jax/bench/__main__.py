"""python -m mok_jax.bench [--shapes qwen3_30b,dsv3] [--shape T,H,I,E,k] [--tiny] [--skew [S]]
[--shared Is] [--impls ...] [--ep N] [--breakdown] [--out FILE.jsonl]; --help lists every
option."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from mok_jax.bench import report, runner, shapes
from mok_jax.bench.records import DTYPES
from mok_jax.bench.peers import ALIASES, IMPLS, resolve
from mok_jax.bench.shapes import FWD_STAGES, MODES, SKIP_ENV



def default_out() -> str:
  """runs/bench/bench-<UTC time>.jsonl: a file of its own for every run."""
  now = datetime.datetime.now(datetime.timezone.utc)
  return os.path.join("runs", "bench", f"bench-{now:%Y%m%d-%H%M%S}.jsonl")

# (full run, --tiny) defaults of the knobs that --tiny changes.
DEFAULTS = {"warmup": (3, 1), "warmup_s": (0.5, 0.0), "reps": (20, 3), "min_reps": (5, 2),
            "budget_s": (3.0, 1.0), "sets": (3, 2), "peak_n": (None, 512),
            "peak_warmup_s": (2.0, 0.05)}


def parse_args(argv):
  p = argparse.ArgumentParser(
      prog="python -m mok_jax.bench",
      description="Time the MoE layer (forward, forward+backward) for mok_jax's backends and "
      "its peers; print a table, write JSON lines to --out, draw a PNG chart.")
  p.add_argument("--shapes", default=None,
                 help=f"comma-separated named shapes: {', '.join(shapes.SHAPES)} (default: all "
                 "four, unless --shape or --tiny is given)")
  p.add_argument("--shape", action="append", default=[], metavar="T,H,I,E,k",
                 help="a custom shape (repeatable)")
  p.add_argument("--tiny", action="store_true",
                 help="a small shape that runs on a CPU in seconds (f32 there), in-process, "
                 "few repetitions")
  p.add_argument("--shared", type=int, default=0, metavar="Is",
                 help="add a shared expert of intermediate width Is to every shape")
  p.add_argument("--skew", type=float, nargs="?", const=1.0, default=0.0, metavar="S",
                 help="Zipf-skewed expert load with exponent S (1.0 if no value); default 0, "
                 "uniform")
  p.add_argument("--impls", default="",
                 help=f"comma-separated implementations ({', '.join(IMPLS)}; aliases "
                 f"{', '.join(ALIASES)}); default: the mok_jax backends of the platform and "
                 "every peer")
  p.add_argument("--modes", default=None, help="fwd, fwd+bwd or both (default)")
  p.add_argument("--ep", type=int, default=1, metavar="N",
                 help="expert parallelism over N devices (mok_jax's implementations only): "
                 "each device holds E / N experts and T tokens (the shape's T is per device), "
                 "and the table's TF/s are per device; on a CPU N host devices are made")
  p.add_argument("--breakdown", action="store_true",
                 help="instead of comparing implementations: time the CUDA forward as it is, "
                 f"with each of {', '.join(FWD_STAGES[1:])} left out ({SKIP_ENV}=<stage>, read "
                 "by the launcher on every call; the results are then wrong) and with all of "
                 f"them left out ({FWD_STAGES[0]} alone), and print the time of each stage; not "
                 "with --impls or --modes")
  p.add_argument("--dtype", choices=DTYPES, default="auto",
                 help="auto: bf16 on a GPU, f32 on a CPU")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--warmup", type=int, default=None,
                 help="untimed calls per mode after its first (checksummed) one (default 3; "
                 "tiny 1); fewer when they would take more than half of --budget-s")
  p.add_argument("--warmup-s", type=float, default=None,
                 help="and at least this many seconds of untimed calls per mode, so that the "
                 "clocks have ramped up after the compile (default 0.5; tiny 0)")
  p.add_argument("--reps", type=int, default=None, help="timed calls (default 20; tiny 3)")
  p.add_argument("--min-reps", type=int, default=None,
                 help="timed calls kept when --budget-s cuts them (default 5; tiny 2), unless "
                 "they would take more than 3x --budget-s (then as many as fit, at least 1)")
  p.add_argument("--budget-s", type=float, default=None,
                 help="seconds of timed calls per mode before cutting --reps (default 3; tiny "
                 "1); with the warm-up, a mode's timing takes at most about 3.5x this plus "
                 "three calls, however slow a call is")
  p.add_argument("--sets", type=int, default=None,
                 help="input sets (tokens, routing, dy) the calls rotate through (default 3)")
  p.add_argument("--peak-n", type=int, default=None,
                 help="size n of the dense n^3 matmul peak (default 8192 on a GPU, 1024 on a "
                 "CPU; tiny 512)")
  p.add_argument("--peak-warmup-s", type=float, default=None,
                 help="seconds of back-to-back dense matmuls before the peak is timed "
                 "(default 2; tiny 0.05)")
  p.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                 help="a fresh process per job (yes), or all in this one (no); auto: no with "
                 "--tiny, else yes")
  p.add_argument("--mode-timeout", "--job-timeout", dest="mode_timeout", type=float,
                 default=90.0,
                 help="seconds a mode (fwd, fwd+bwd, the peak) may take in its worker, "
                 "compile and the worker's start-up for the first mode included, before the "
                 "worker is killed and that mode alone is reported as timed out (the modes "
                 "already done keep their results, those after it get a fresh worker); "
                 "default 90")
  p.add_argument("--out", default=None,
                 help="JSON lines file of this run's records, which must not exist yet (default "
                 "runs/bench/bench-<UTC time>.jsonl); the table goes next to it as .txt, the "
                 "chart as .png")
  p.add_argument("--png", default=None, help="chart path (default: --out with .png)")
  p.add_argument("--logs", default=None, help="folder for the workers' logs (default: a temp "
                 "folder)")
  p.add_argument("--report", metavar="JSONL", default=None,
                 help="measure nothing: print the table and draw the chart of the newest "
                 "records in this file (for runs split over several commands)")
  args = p.parse_args(argv)
  if args.out is None:
    args.out = default_out()
  elif not args.report and os.path.exists(args.out):
    p.error(f"--out {args.out} exists: each run writes a file of its own (name another)")
  for name, (full, tiny) in DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, tiny if args.tiny else full)
  if args.breakdown and (args.impls or args.modes):
    p.error("--breakdown times the CUDA forward only: --impls and --modes do not apply")
  args.modes = [m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()]
  for mode in args.modes:
    if mode not in MODES:
      p.error(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
  if args.skew < 0:
    p.error("--skew must be >= 0")
  if args.ep < 1 or (args.ep > 1 and args.breakdown):
    p.error("--ep must be >= 1, and 1 with --breakdown")
  if min(args.reps, args.min_reps, args.sets, args.peak_n or 1) < 1 or args.warmup < 0:
    p.error("--reps, --min-reps, --sets and --peak-n must be >= 1, --warmup >= 0")
  if min(args.warmup_s, args.peak_warmup_s) < 0 or args.budget_s <= 0 or args.mode_timeout <= 0:
    p.error("--warmup-s and --peak-warmup-s must be >= 0, --budget-s and --mode-timeout > 0")
  return args, p


def _paths(args):
  stem = os.path.splitext(args.out)[0]
  return stem + ".txt", args.png or stem + ".png", stem + ".partial.jsonl"


def _render(derived, args) -> str:
  """Writes the table (.txt) and the chart (.png) of derived records; returns the table."""
  text_path, png_path, _ = _paths(args)
  text = report.table(derived)
  os.makedirs(os.path.dirname(os.path.abspath(text_path)), exist_ok=True)
  with open(text_path, "w") as f:
    f.write(text + "\n")
  try:
    drawn = report.chart(derived, png_path) or "not drawn (no MoE records, or no matplotlib)"
  except Exception as exc:  # pylint: disable=broad-except  # a chart never loses the numbers
    drawn = "not drawn (failed)"
    print(f"chart failed: {type(exc).__name__}: {exc}", file=sys.stderr)
  print(f"table: {text_path}; chart: {drawn}", file=sys.stderr)
  return text


def main(argv=None) -> int:
  args, parser = parse_args(sys.argv[1:] if argv is None else argv)
  # Records stream to the .partial.jsonl file while a run goes on; if the run is cut short,
  # `--report` on that file shows what it measured.
  if args.report:
    derived = report.derive(report.latest(report.read_jsonl(args.report)))
    print(_render(derived, args))
    return 0
  try:
    chosen = shapes.select(args.shapes, args.shape, args.tiny, args.shared)
    resolve(args.impls, "gpu")  # names are checked now, the platform's defaults later
  except ValueError as exc:
    parser.error(str(exc))
  _, _, partial = _paths(args)
  os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
  if os.path.exists(partial):
    os.remove(partial)
  if args.ep > 1:  # read when JAX starts its backends, here or in a job's process
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.ep}").strip()
  isolate = {"yes": True, "no": False, "auto": not args.tiny}[args.isolate]
  opts = runner.Options(
      shapes=chosen, impls=args.impls, modes=args.modes, dtype=args.dtype, seed=args.seed,
      skew=args.skew, sets=args.sets, warmup=args.warmup, warmup_s=args.warmup_s,
      reps=args.reps, min_reps=args.min_reps, budget_s=args.budget_s, peak_n=args.peak_n,
      peak_warmup_s=args.peak_warmup_s, isolate=isolate, mode_timeout_s=args.mode_timeout,
      log_dir=args.logs, partial_path=partial, breakdown=args.breakdown, ep=args.ep)
  records = runner.Runner(opts).run()
  derived = report.derive(records)
  report.write_jsonl(derived, args.out)
  os.remove(partial)
  print(f"records: {args.out}", file=sys.stderr)
  print(_render(derived, args))
  ok = any(r.get("kind") in ("moe", "breakdown") and r.get("status") == "ok" for r in derived)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
