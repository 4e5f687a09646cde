"""Derived figures (TFLOP/s, % of the measured peak, speed-up over the best peer, checksum
agreement; for --breakdown, the time of each stage of the CUDA forward), the text table, the
JSON lines and the PNG chart.

Derived figures are computed from the raw ones whenever records are reported, so that a file of
records from several runs (or a run cut short) can be reported again with `--report FILE`.
"""

from __future__ import annotations

import json
import math
import os

from mok_jax.bench.peers import IMPLS
from mok_jax.bench.shapes import FWD_STAGES, MODES, SKIP_ENV

# Relative tolerance on the sum |.| checksums of one implementation against the reference. The
# layer's rounding points differ a little between frameworks (torch rounds g and u to bf16),
# so this catches wrong results, not rounding.
CHECK_TOL = {"bf16": 2e-2, "f32": 1e-3}
REFERENCE_ORDER = ("mok_jax:xla", "jax.ragged_dot", "tokamax.ragged_dot", "torch._grouped_mm")
STATUS_TEXT = {"oom": "out of memory", "error": "error", "unavailable": "n/a",
               "timeout": "timeout", "crashed": "crashed"}
GIB = 1024 ** 3


def read_jsonl(path: str) -> list[dict]:
  records = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        records.append(json.loads(line))
  return records


def write_jsonl(records: list[dict], path: str):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "x") as f:  # a run's own file, never appended to
    for record in records:
      f.write(json.dumps(record) + "\n")


def case_key(r: dict) -> tuple:
  """Records with the same key timed the same work on the same inputs."""
  return (r.get("shape"), r.get("T"), r.get("H"), r.get("I"), r.get("E"), r.get("k"),
          r.get("Is"), r.get("dtype"), r.get("skew"), r.get("ep", 1), r.get("seed"),
          r.get("mode"))


def latest(records: list[dict]) -> list[dict]:
  """The newest record of each (case, implementation), and the newest peak of each device and
  dtype, in first-seen order: for reporting a file that several runs appended to."""
  keep: dict[tuple, dict] = {}
  for r in records:
    if r.get("kind") == "peak":
      key = ("peak", r.get("device"), r.get("dtype"))
    else:  # a breakdown's "fwd" is not the same record as the comparison's
      key = (r.get("kind"), case_key(r), r.get("impl"))
    if key not in keep or (r.get("date") or "") >= (keep[key].get("date") or ""):
      keep.pop(key, None)
      keep[key] = r
  return list(keep.values())


def tflops(flops: int, ms: float) -> float:
  return flops / (ms * 1e-3) / 1e12


def joules_a_call(gpu: dict | None, how: dict | None) -> float | None:
  """The GPU's joules a call over one sampled timing: the energy that clocks.sampling read over
  the timed calls (energy_j, from timing's on_timed) over their count (timing's timed_calls), or
  None where either is missing (no NVML, or a record from a bench that did not read it)."""
  energy, calls = (gpu or {}).get("energy_j"), (how or {}).get("timed_calls")
  return energy / calls if energy is not None and calls else None


def derive(records: list[dict]) -> list[dict]:
  """Copies of the records with tflops, pct_of_peak, best_peer, speedup_vs_best_peer, check,
  and joules a call one at a time and back to back (j_per_call, j_per_call_b2b) where measured;
  breakdown records with full_ms, stage_ms and stage_pct (see _derive_breakdown)."""
  out = [dict(r) for r in records]
  peaks_by_run, peaks_by_dtype = {}, {}
  for r in out:
    if r.get("kind") == "peak" and r.get("status") == "ok":
      r["tflops"] = tflops(r["flops"], r["ms"]["median"])
      peaks_by_run[(r.get("run_id"), r.get("dtype"))] = r["tflops"]
      peaks_by_dtype[r.get("dtype")] = r["tflops"]
  cases: dict[tuple, list[dict]] = {}
  for r in out:
    if r.get("kind") != "moe":
      continue
    cases.setdefault(case_key(r), []).append(r)
    if r.get("status") == "ok":
      r["tflops"] = tflops(r["flops"], r["ms"]["median"])
      if r.get("ms_b2b"):
        r["tflops_b2b"] = tflops(r["flops"], r["ms_b2b"]["median"])
      for suffix in ("", "_b2b"):
        joules = joules_a_call(r.get("gpu" + suffix), r.get("timing" + suffix))
        if joules is not None:
          r["j_per_call" + suffix] = joules
      peak = peaks_by_run.get((r.get("run_id"), r.get("dtype")),
                              peaks_by_dtype.get(r.get("dtype")))
      r["peak_tflops"] = peak
      r["pct_of_peak"] = 100.0 * r["tflops"] / peak if peak else None
  for rows in cases.values():
    ok = [r for r in rows if r.get("status") == "ok"]
    peers_ok = [r for r in ok if r.get("group") == "peer"]
    best = min(peers_ok, key=lambda r: r["ms"]["median"]) if peers_ok else None
    for r in ok:
      r["best_peer"] = best["impl"] if best else None
      r["speedup_vs_best_peer"] = best["ms"]["median"] / r["ms"]["median"] if best else None
    _check(ok)
  _derive_breakdown(out)
  return out


def _derive_breakdown(records: list[dict]):
  """The full forward of a breakdown (stage None) gets tflops; every other variant of the same
  run and case gets full_ms (the full forward's median), stage_ms, the time of its stage (full_ms
  minus its median when it leaves its stage out; its median when it runs its stage alone, as
  the layout, which cannot be left out), and stage_pct, 100 * stage_ms / full_ms."""
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    if r.get("kind") == "breakdown" and r.get("status") == "ok":
      groups.setdefault((r.get("run_id"), r.get("impl"), case_key(r)[:-1]), []).append(r)
  for rows in groups.values():
    full = next((r for r in rows if r.get("stage") is None), None)
    if full is None:
      continue
    full_ms = full["ms"]["median"]
    full["tflops"] = tflops(full["flops"], full_ms)
    for r in rows:
      if r is full:
        continue
      left_out = r["stage"] in r.get("skip", ())
      r["full_ms"] = full_ms
      r["stage_ms"] = full_ms - r["ms"]["median"] if left_out else r["ms"]["median"]
      r["stage_pct"] = 100.0 * r["stage_ms"] / full_ms


def _check(ok: list[dict]):
  by_impl = {r["impl"]: r for r in ok if isinstance(r.get("check"), dict)}
  ref = next((by_impl[name] for name in REFERENCE_ORDER if name in by_impl), None)
  for r in ok:
    if r is ref:
      r["check_vs"], r["check_result"] = None, "reference"
      continue
    if ref is None or r["impl"] not in by_impl:
      r["check_vs"], r["check_result"] = None, None
      continue
    tol = CHECK_TOL.get(r.get("dtype"), 2e-2)
    bad = []
    for name, want in ref["check"].items():
      got = r["check"].get(name)
      if got is None:
        continue
      if not (isinstance(got, (int, float)) and isinstance(want, (int, float))):
        if got != want:
          bad.append(f"{name} {got} vs {want}")
        continue
      rel = abs(got - want) / max(abs(want), 1e-30)
      if rel > tol:
        bad.append(f"{name} off by {rel:.2g}")
    r["check_vs"] = ref["impl"]
    r["check_result"] = "ok" if not bad else "mismatch: " + ", ".join(bad)


# -- the table -----------------------------------------------------------------------------------


def _fmt_ms(ms: float) -> str:
  if ms >= 100:
    return f"{ms:.1f}"
  if ms >= 1:
    return f"{ms:.2f}"
  return f"{ms:.4f}"


def _fmt_gpu(gpu: dict | None) -> str:
  """The SM clock and power that clocks.sampling recorded (after ", at "), or nothing."""
  if not gpu:
    return ""
  return (f", at SM clock {gpu['sm_mhz']:.0f} MHz ({gpu['sm_mhz_min']:.0f}-"
          f"{gpu['sm_mhz_max']:.0f}), {gpu['power_w']:.0f} W")


def _fmt_tf(tf: float) -> str:
  return f"{tf:.1f}" if tf >= 1 else f"{tf:.3g}"


class _Notes:
  """Numbered footnotes, one per distinct text."""

  def __init__(self):
    self.texts: list[str] = []

  def ref(self, text: str) -> str:
    if text not in self.texts:
      self.texts.append(text)
    return f"[{self.texts.index(text) + 1}]"


def _title(first: dict) -> list[str]:
  versions = first.get("versions") or {}
  shown = ", ".join(f"{name} {versions[name]}" for name in
                    ("jax", "jaxlib", "jax-cuda13-plugin", "tokamax", "torch")
                    if versions.get(name))
  skew = first.get("skew") or 0
  ep = first.get("ep") or 1
  parallel = (f", expert parallelism over {ep} devices (T and TF/s per device; ep_bytes in the "
              "records: what a device sends to the others a call)" if ep > 1 else "")
  return [
      f"MoE layer benchmark (mok_jax.bench) on {first.get('device') or '?'} "
      f"({first.get('platform') or '?'}), {first.get('dtype')}, "
      f"routing {'Zipf skew ' + str(skew) if skew else 'uniform'}{parallel}",
      f"{first.get('date')}  run {first.get('run_id')}  commit {first.get('commit')}  "
      f"{shown}",
  ]


def _header(records: list[dict]) -> list[str]:
  lines = _title(next((r for r in records if r.get("kind") == "moe"), records[0]))
  for r in records:
    if r.get("kind") == "peak":
      if r.get("status") == "ok":
        lines.append(f"dense {r.get('dtype')} matmul {r['n']}^3 (jnp.dot, jit): "
                     f"{_fmt_ms(r['ms']['median'])} ms = {r['tflops']:.1f} TFLOP/s, the 100% "
                     "of '% peak'" + _fmt_gpu(r.get("gpu")))
        how = r.get("timing")
        if how:
          lines.append(
              f"  how: {r.get('inputs', 'random')} inputs ({r.get('sets', '?')} pairs in turn); "
              f"{how['warmup_s']:.1f} s of back-to-back warm-up calls; then the median of "
              f"{r['ms']['n']} samples,")
          lines.append(
              f"  each {how['calls_per_sample']} back-to-back calls with one sync at its end "
              f"(min-max {_fmt_ms(r['ms']['min'])}-{_fmt_ms(r['ms']['max'])} ms a call)")
      else:
        lines.append(f"dense matmul peak: {STATUS_TEXT.get(r.get('status'), r.get('status'))}"
                     f" ({r.get('reason')})")
  lines.append("TF/s = FLOPs / median; FLOPs = 2*T*k*3*H*I (+ 2*T*3*H*Is shared) per forward, "
               "x3 for fwd+bwd")
  if any(r.get("kind") == "moe" and r.get("timing") for r in records):
    lines.append("MoE timing: a sample is one call and a sync (JAX: host clock around the call "
                 "and block_until_ready; PyTorch: CUDA events),")
    lines.append("  after --warmup calls and --warmup-s seconds of warm-up (at most half of "
                 "--budget-s); (n=..): fewer samples than --reps, cut by --budget-s")
  if any(r.get("kind") == "moe" and r.get("ms_b2b") for r in records):
    # A record without timing_b2b's sample_s comes from a bench whose samples were 50 ms.
    sample_ms = sorted({round(1e3 * (r.get("timing_b2b") or {}).get("sample_s", 0.05))
                        for r in records if r.get("kind") == "moe" and r.get("ms_b2b")})
    lines.append("b2b: the same call timed back to back as the dense matmul is (median ms a call "
                 "of samples of about")
    lines.append(f"  {' or '.join(map(str, sample_ms))} ms of calls, one sync each), without a "
                 "sync's latency between two calls; b2b MHz: the median SM clock")
    lines.append("  of the timed calls (nvidia-smi every 0.1 s; a GPU at its power limit clocks "
                 "lower; in records of older benches,")
    lines.append("  warm-up included); b2b J: the GPU's joules a call over them (NVML's energy "
                 "counter; at the power limit a call's")
    lines.append("  time follows it)")
  lines.append("vs peer = the best peer's median / this median; compile s = jit lower+compile "
               "(JAX), first call (eager PyTorch)")
  return lines


def table(records: list[dict]) -> str:
  """The text table of derived records: one block per mode, a line per shape and a row per
  implementation under it; reasons for failures and notes numbered under the table. Breakdown
  records get their own table (breakdown_table), after this one when there are both."""
  moe = [r for r in records if r.get("kind") == "moe"]
  breakdown = [r for r in records if r.get("kind") == "breakdown"]
  if breakdown:
    text = breakdown_table(breakdown)
    if not moe:
      return text
    return table([r for r in records if r.get("kind") != "breakdown"]) + "\n\n" + text
  if not moe:
    return "\n".join(_header(records) + ["(no MoE records)"])
  notes = _Notes()
  widths = (24, 10, 25, 8, 8, 8, 7, 7, 7, 8, 8, 9)
  head = ("  impl", "median ms", "min-max ms", "TF/s", "b2b ms", "b2b TF/s", "b2b MHz", "b2b J",
          "% peak", "vs peer", "mem GiB", "compile s")
  lines = _header(records)
  for mode in MODES:
    rows = [r for r in moe if r.get("mode") == mode]
    if not rows:
      continue
    lines += ["", f"== {mode} ==", "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    last_case = None
    for r in rows:
      if case_key(r) != last_case:
        last_case = case_key(r)
        load = r.get("load") or {}
        lines.append(f"{r['shape']}  T={r['T']} H={r['H']} I={r['I']} E={r['E']} k={r['k']}"
                     + (f" Is={r['Is']}" if r.get("Is") else "")
                     + (f"  (routes per expert: max/mean {load['max_over_mean']:.2f}, "
                        f"{load['empty_experts']} empty)" if load else ""))
      impl = "  " + r["impl"]
      if r.get("note"):
        impl += " " + notes.ref(f"{r['impl']}: {r['note']}")
      if r.get("status") == "ok":
        ms = r["ms"]
        check = r.get("check_result")
        median = _fmt_ms(ms["median"])
        if check and check.startswith("mismatch"):
          median += " !" + notes.ref(f"{r['impl']} on {r['shape']} {mode}: output checksums "
                                     f"disagree with {r.get('check_vs')}: {check}")
        speed = r.get("speedup_vs_best_peer")
        mem = r.get("peak_mem_bytes")
        spread = f"{_fmt_ms(ms['min'])}-{_fmt_ms(ms['max'])}"
        asked = (r.get("timing") or {}).get("reps_asked")
        if asked and ms.get("n", asked) < asked:
          spread += f" (n={ms['n']})"
        b2b = ("-", "-", "-", "-")
        if r.get("ms_b2b"):
          clock = (r.get("gpu_b2b") or {}).get("sm_mhz")
          joules = r.get("j_per_call_b2b")
          b2b = (_fmt_ms(r["ms_b2b"]["median"]), _fmt_tf(r["tflops_b2b"]),
                 f"{clock:.0f}" if clock else "-", f"{joules:.3g}" if joules else "-")
        elif r.get("b2b_status"):
          why = f"{r['impl']} on {r['shape']} {mode}, back to back: {r.get('b2b_reason')}"
          b2b = (STATUS_TEXT.get(r["b2b_status"], r["b2b_status"]) + " " + notes.ref(why),
                 "-", "-", "-")
        cells = (median, spread, _fmt_tf(r["tflops"]), *b2b,
                 f"{r['pct_of_peak']:.1f}" if r.get("pct_of_peak") is not None else "-",
                 f"{speed:.2f}x" if speed else "-",
                 f"{mem / GIB:.2f}" if mem else "-",
                 f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-")
      else:
        status = STATUS_TEXT.get(r.get("status"), r.get("status") or "?")
        reason = r.get("reason") or ""
        cells = (f"{status} {notes.ref(reason)}" if reason else status,) + ("",) * 10
      lines.append("  ".join(str(c).ljust(w) for c, w in zip((impl,) + cells, widths)).rstrip())
  if notes.texts:
    lines.append("")
    lines.extend(f"[{i + 1}] {text}" for i, text in enumerate(notes.texts))
  mem_scopes = {r.get("mem_scope") for r in moe if r.get("peak_mem_bytes")}
  if mem_scopes:
    lines.append("")
    lines.append("mem GiB: peak device memory of the run, inputs included"
                 + (" (a fresh process per shape and implementation; fwd+bwd runs after fwd "
                    "in it, so its peak covers both, unless fwd's worker was killed or died and "
                    "fwd+bwd got a fresh one)" if "worker" in mem_scopes else
                    " (process-wide high-water mark: JAX cannot reset it)"))
  return "\n".join(lines)


def breakdown_table(records: list[dict]) -> str:
  """The stage breakdown of derived breakdown records: a row per shape with the median of the
  full forward and the time of each stage (ms and % of the full forward); failures and their
  reasons numbered under the table."""
  notes = _Notes()

  def failure(r):
    status = STATUS_TEXT.get(r.get("status"), r.get("status") or "?")
    return f"{status} {notes.ref(r['reason'])}" if r.get("reason") else status

  cases: dict[tuple, dict] = {}
  for r in records:
    cases.setdefault((case_key(r)[:-1], r.get("impl")), {})[r.get("stage")] = r
  head = ["shape", "full ms", "TF/s", *FWD_STAGES, "sum"]
  body = []
  for variants in cases.values():
    full, some = variants.get(None), next(iter(variants.values()))
    cells = [f"{some['shape']} T={some['T']} H={some['H']} I={some['I']} E={some['E']} "
             f"k={some['k']}" + (f" Is={some['Is']}" if some.get("Is") else "")]
    ok = full is not None and full.get("status") == "ok"
    if ok:
      cells += [_fmt_ms(full["ms"]["median"]), _fmt_tf(full["tflops"])]
    else:
      cells += [failure(full) if full else "-", ""]
    timed = []
    for stage in FWD_STAGES:
      r = variants.get(stage)
      if r is None:
        cells.append("-")
      elif r.get("status") != "ok":
        cells.append(failure(r))
      elif r.get("stage_ms") is None:  # no full forward in this run: the variant's own median
        cells.append(f"({_fmt_ms(r['ms']['median'])} ms)")
      else:
        timed.append(r["stage_ms"])
        cells.append(f"{r['stage_ms']:.3f} {r['stage_pct']:.1f}%")
    cells.append(f"{sum(timed):.3f} {100.0 * sum(timed) / full['ms']['median']:.1f}%"
                 if ok and timed else "-")
    body.append(cells)
  widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
  lines = _title(records[0]) + [
      f"== forward stage breakdown ({records[0].get('impl')}): the time of each stage ==",
      f"{', '.join(FWD_STAGES[1:])}: full ms - ms with {SKIP_ENV}=<stage> (the launcher",
      "  then leaves that stage out: wrong results, a diagnostic only); layout, which every other",
      "  stage reads: ms with all of those left out. Each also as % of full ms; sum: of the",
      "  stages, which need not make full ms (overlapping work counts in two stages, launch gaps",
      "  in none).",
      "times: medians of samples of back-to-back calls with one sync each (the device's time per",
      "  call, as for the dense peak); a fresh jit per variant",
      "",
  ]
  lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body]
  if notes.texts:
    lines.append("")
    lines.extend(f"[{i + 1}] {text}" for i, text in enumerate(notes.texts))
  return "\n".join(lines)


# -- the chart -----------------------------------------------------------------------------------


def chart(records: list[dict], path: str) -> str | None:
  """Bar chart of TF/s per shape and implementation, one panel per mode, the dense peak as a
  line; failed runs are labelled where their bar would be. Returns the path, or None when
  matplotlib is missing or there are no MoE records (a --breakdown run)."""
  moe = [r for r in records if r.get("kind") == "moe"]
  if not moe:
    return None
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  shapes = list(dict.fromkeys(r["shape"] for r in moe))
  impls = [name for name in IMPLS if any(r["impl"] == name for r in moe)]
  modes = [m for m in MODES if any(r["mode"] == m for r in moe)]
  peak = next((r.get("tflops") for r in records if r.get("kind") == "peak"
               and r.get("status") == "ok"), None)
  colors = dict(zip(IMPLS, ("#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#2ca02c", "#8c564b")))
  fig, axes = plt.subplots(len(modes), 1, figsize=(max(7.0, 1.9 * len(shapes) + 3.0),
                                                   3.6 * len(modes)), squeeze=False)
  width = 0.8 / max(len(impls), 1)
  for ax, mode in zip(axes[:, 0], modes):
    top = max([r.get("tflops") or 0 for r in moe if r["mode"] == mode] + [peak or 0, 1e-9])
    for j, impl in enumerate(impls):
      for i, shape in enumerate(shapes):
        r = next((r for r in moe if r["shape"] == shape and r["impl"] == impl
                  and r["mode"] == mode), None)
        if r is None:
          continue
        x = i + (j - (len(impls) - 1) / 2) * width
        if r.get("status") == "ok":
          ax.bar(x, r["tflops"], width, color=colors.get(impl), label=IMPLS[impl].label
                 if i == 0 else None)
        else:
          label = {"oom": "OOM", "unavailable": "n/a"}.get(r.get("status"), r.get("status"))
          ax.bar(x, 0, width, color=colors.get(impl), label=IMPLS[impl].label
                 if i == 0 else None)
          ax.text(x, top * 0.01, label, rotation=90, ha="center", va="bottom", fontsize=7,
                  color=colors.get(impl))
    if peak:
      ax.axhline(peak, color="black", linestyle="--", linewidth=1)
      ax.text(len(shapes) - 0.52, peak, f"dense matmul {peak:.3g} TFLOP/s", va="bottom",
              ha="right", fontsize=8)
    ax.set_xlim(-0.5, len(shapes) - 0.5)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes)
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(0, top * 1.12)
    ax.set_title(mode, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
  first = moe[0] if moe else {}
  fig.suptitle(f"MoE layer on {first.get('device', '?')}, {first.get('dtype', '?')} "
               f"({(first.get('date') or '')[:10]})", fontsize=11)
  handles, labels = axes[0, 0].get_legend_handles_labels()
  if handles:
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8,
               frameon=False)
  height = fig.get_size_inches()[1]
  legend_rows = math.ceil(len(impls) / 3)
  fig.tight_layout(rect=(0, (0.15 + 0.2 * legend_rows) / height, 1, 1 - 0.4 / height))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
