"""`python -m mok_jax.bench`'s command line (`--help` lists its options)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from mok_jax.bench import report, runner, shapes

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
  add("--tiny", action="store_true", help="a small shape for a CPU (f32), few reps")
  add("--precision", dest="run_precision", default="bf16", choices=shapes.PRECISIONS,
      help="mok_jax's Config.precision and the peers' (fp8: mok_jax's bf16 too; bf16 on a CPU)")
  add("--skew", type=float, nargs="?", const=1.0, default=0.0, metavar="S",
      help="Zipf expert load of exponent S (1 if none given; default 0: uniform)")
  add("--impls", default="", help=f"of {', '.join(shapes.IMPLS)} or {', '.join(shapes.ALIASES)}"
      ", NAME@bf16|fp8 at another --precision (default: the platform's mok_jax and the peers)")
  add("--modes", default=",".join(shapes.MODES), help="fwd, fwd+bwd or both")
  add("--ep", type=int, default=1, metavar="N", help="mok_jax's expert parallelism over N "
      "devices, E / N experts and the shape's T a device (on a CPU: N host devices)")
  add("--ep-transport", default="auto", choices=("auto", "collective", "nvlink"), help="its "
      "Config.ep_transport; not auto: the routed layer even at --ep 1 (the transport's cost)")
  add("--seed", type=int, default=0)
  add("--reps", type=int, help="timed calls a mode (default 20; tiny 3)")
  add("--budget-s", type=float, help="seconds of them before --reps is cut (default 3; tiny 1)")
  add("--mode-timeout", type=float, default=90.0, help="seconds a mode may take in its worker, "
      "the first one's start included, before it is reported as timed out (default 90)")
  add("--out", help="this run's records, a file that must not exist (default runs/bench/bench-"
      "<UTC time>.jsonl); beside it the chart (.png) and the workers' logs (-logs/)")
  add("--report", metavar="JSONL", help="measure nothing: the table and chart of its records")
  args = p.parse_args(argv)
  if args.out is None:
    now = datetime.datetime.now(datetime.timezone.utc)
    args.out = os.path.join("runs", "bench", f"bench-{now:%Y%m%d-%H%M%S}.jsonl")
  elif not args.report and os.path.exists(args.out):
    p.error(f"--out {args.out} exists: each run writes a file of its own")
  args.knobs = {name: tiny if args.tiny else full for name, (full, tiny) in KNOBS.items()}
  args.knobs.update({k: v for k in ("reps", "budget_s") if (v := getattr(args, k)) is not None},
                    **{k: getattr(args, k) for k in ("seed", "skew", "ep", "ep_transport",
                                                     "run_precision")})
  args.modes = [m for m in args.modes.split(",") if m]
  if not args.modes or not set(args.modes) <= set(shapes.MODES):
    p.error(f"--modes takes {', '.join(shapes.MODES)}")
  if (args.skew < 0 or args.ep < 1 or args.mode_timeout <= 0 or args.knobs["reps"] < 1
      or args.knobs["budget_s"] <= 0):
    p.error("--skew must be >= 0, --ep and --reps >= 1, --budget-s and --mode-timeout > 0")
  try:
    args.chosen = shapes.select(args.shapes, args.shape, args.tiny, args.run_precision)
    shapes.resolve_impls(args.impls, "gpu", args.run_precision)  # names now, the platform's later
  except ValueError as exc:
    p.error(str(exc))
  return args


def _render(records, out: str) -> str:
  """The table; the chart goes beside `out` (.png)."""
  try:
    drawn = (report.chart(records, os.path.splitext(out)[0] + ".png")
             or "not drawn (no MoE records or matplotlib)")
  except Exception as exc:  # pylint: disable=broad-except  # a chart never loses the numbers
    drawn = f"failed: {type(exc).__name__}: {exc}"
  print(f"chart: {drawn}", file=sys.stderr)
  return report.table(records)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.report:
    with open(args.report) as f:
      print(_render(report.derive([json.loads(line) for line in f if line.strip()]), args.out))
    return 0
  if args.ep > 1:  # read when JAX starts its backends, in each worker
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.ep}").strip()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  # The records go to --out as they come, so that a run cut short keeps them (--report derives
  # their figures); at the end the file holds them with their derived figures.
  with open(args.out, "x") as f:
    done = runner.run(runner.Options(args.chosen, args.impls, args.modes, args.knobs,
                                     args.mode_timeout, os.path.splitext(args.out)[0] + "-logs"),
                      lambda record: print(json.dumps(record), file=f, flush=True))
  derived = report.derive(done)
  with open(args.out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in derived)
  print(f"records: {args.out}", file=sys.stderr)
  print(_render(derived, args.out))
  return 0 if any(r["kind"] == "moe" and r["status"] == "ok" for r in derived) else 1


if __name__ == "__main__":
  sys.exit(main())
