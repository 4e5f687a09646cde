"""python -m mok_jax.bench [--shapes NAMES] [--shape T,H,I,E,k] [--tiny] [--impls NAMES]
[--modes fwd,fwd+bwd] [--ep N] [--shared Is] [--skew [S]] [--out FILE.jsonl] [--report FILE]"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from mok_jax.bench import peers, report, runner, shapes
from mok_jax.bench.records import DTYPES

# The timing's knobs (timing.py): (a full run's, --tiny's).
KNOBS = {"warmup": (3, 1), "warmup_s": (0.5, 0.0), "reps": (20, 3), "min_reps": (5, 2),
         "budget_s": (3.0, 1.0), "sets": (3, 2), "peak_n": (None, 512),
         "peak_warmup_s": (2.0, 0.05)}


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m mok_jax.bench", description="Time the MoE layer "
                              "(fwd, fwd+bwd) of mok_jax's backends and its peers against a dense "
                              "matmul: a table on stdout, JSON lines in --out, a PNG chart.")
  add = p.add_argument
  add("--shapes", help=f"of {', '.join(shapes.SHAPES)} (default: all, unless --shape or --tiny)")
  add("--shape", action="append", default=[], metavar="T,H,I,E,k", help="a custom shape")
  add("--tiny", action="store_true", help="a shape for a CPU (f32), in-process, few reps")
  add("--shared", type=int, default=0, metavar="Is", help="a shared expert of width Is")
  add("--skew", type=float, nargs="?", const=1.0, default=0.0, metavar="S",
      help="Zipf expert load of exponent S (1 if none given; default 0: uniform)")
  add("--impls", default="", help=f"of {', '.join(peers.IMPLS)} or {', '.join(peers.ALIASES)} "
      "(default: the platform's mok_jax backends and the peers)")
  add("--modes", default=",".join(shapes.MODES), help="fwd, fwd+bwd or both")
  add("--ep", type=int, default=1, metavar="N", help="mok_jax's expert parallelism over N "
      "devices, E / N experts and the shape's T a device (on a CPU: N host devices)")
  add("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on a GPU, else f32")
  add("--seed", type=int, default=0)
  add("--reps", type=int, help="timed calls a mode (default 20; tiny 3)")
  add("--budget-s", type=float, help="seconds of them before --reps is cut (default 3; tiny 1)")
  add("--isolate", choices=("auto", "yes", "no"), default="auto",
      help="a fresh process per job (auto: but with --tiny)")
  add("--mode-timeout", type=float, default=90.0, help="seconds a mode may take in its worker, "
      "the first one's start included, before it is reported as timed out (default 90)")
  add("--out", help="this run's records, a file that must not exist (default runs/bench/bench-"
      "<UTC time>.jsonl); the table goes beside it as .txt, the chart as .png")
  add("--logs", help="folder of the workers' logs (default: a temp folder)")
  add("--report", metavar="JSONL", help="measure nothing: the table and chart of its records")
  args = p.parse_args(argv)
  if args.out is None:
    now = datetime.datetime.now(datetime.timezone.utc)
    args.out = os.path.join("runs", "bench", f"bench-{now:%Y%m%d-%H%M%S}.jsonl")
  elif not args.report and os.path.exists(args.out):
    p.error(f"--out {args.out} exists: each run writes a file of its own")
  args.knobs = {name: tiny if args.tiny else full for name, (full, tiny) in KNOBS.items()}
  args.knobs.update({k: v for k, v in (("reps", args.reps), ("budget_s", args.budget_s))
                     if v is not None},
                    dtype=args.dtype, seed=args.seed, skew=args.skew, ep=args.ep)
  args.modes = [m for m in args.modes.split(",") if m]
  if not args.modes or not set(args.modes) <= set(shapes.MODES):
    p.error(f"--modes takes {', '.join(shapes.MODES)}")
  if (args.skew < 0 or args.ep < 1 or args.mode_timeout <= 0 or args.knobs["reps"] < 1
      or args.knobs["budget_s"] <= 0):
    p.error("--skew must be >= 0, --ep and --reps >= 1, --budget-s and --mode-timeout > 0")
  return args, p


def _render(derived, args) -> str:
  """The table, also written beside --out (.txt) with the chart (.png)."""
  stem = os.path.splitext(args.out)[0]
  text = report.table(derived)
  os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
  with open(stem + ".txt", "w") as f:
    f.write(text + "\n")
  try:
    drawn = report.chart(derived, stem + ".png") or "not drawn (no MoE records or matplotlib)"
  except Exception as exc:  # pylint: disable=broad-except  # a chart never loses the numbers
    drawn = f"failed: {type(exc).__name__}: {exc}"
  print(f"table: {stem}.txt; chart: {drawn}", file=sys.stderr)
  return text


def main(argv=None) -> int:
  args, parser = parse_args(sys.argv[1:] if argv is None else argv)
  if args.report:
    print(_render(report.derive(report.latest(report.read_jsonl(args.report))), args))
    return 0
  try:
    chosen = shapes.select(args.shapes, args.shape, args.tiny, args.shared)
    peers.resolve(args.impls, "gpu")  # the names now, the platform's defaults later
  except ValueError as exc:
    parser.error(str(exc))
  # Records stream here while the run goes on, so that `--report` shows a run cut short.
  partial = os.path.splitext(args.out)[0] + ".partial.jsonl"
  os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
  if os.path.exists(partial):
    os.remove(partial)
  if args.ep > 1:  # read when JAX starts its backends, here or in a worker
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.ep}").strip()
  isolate = {"yes": True, "no": False, "auto": not args.tiny}[args.isolate]
  derived = report.derive(runner.run(runner.Options(
      chosen, args.impls, args.modes, args.knobs, isolate, args.mode_timeout, args.logs, partial)))
  report.write_jsonl(derived, args.out)
  os.remove(partial)
  print(f"records: {args.out}", file=sys.stderr)
  print(_render(derived, args))
  return 0 if any(r["kind"] == "moe" and r["status"] == "ok" for r in derived) else 1


if __name__ == "__main__":
  sys.exit(main())
