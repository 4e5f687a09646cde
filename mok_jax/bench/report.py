"""Derived figures (TFLOP/s, % of the run's dense peak, speed-up over the best peer, checksum
agreement), the table and the chart. Figures are derived whenever records are reported, so that
`--report FILE` shows a file of records again (fields it does not know, such as the clocks and
joules of older records, are passed over)."""

from __future__ import annotations

import os

from mok_jax.bench.shapes import IMPLS, MODES, PEERS, label

# The frameworks round a little differently (torch rounds g and u to bf16; FP8's sums of |.|
# move by a few 1e-3): this catches wrong results, not rounding. The reference: the first of
# REFERENCE_ORDER with checksums, bf16 before FP8.
CHECK_TOL = {"bf16": 2e-2, "f32": 1e-3}
REFERENCE_ORDER = ("mok_jax:xla", *PEERS, "mok_jax:ffi", "mok_jax:cuda")
STATUS_TEXT = {"oom": "out of memory", "unavailable": "n/a"}
COLUMNS = (("  impl", 30), ("median ms", 10), ("TF/s", 8), ("b2b ms", 8), ("b2b TF/s", 8),
           ("% peak", 7), ("vs peer", 8), ("mem GiB", 8), ("compile s", 9))


def case_key(r: dict) -> tuple:
  """Records with the same key timed the same work on the same inputs."""
  return tuple(r.get(name) for name in ("shape", "T", "H", "I", "E", "k", "dtype", "skew", "ep",
                                        "seed", "mode"))


def tflops(flops: int, ms: float) -> float:
  return flops / (ms * 1e-3) / 1e12


def derive(records: list[dict]) -> list[dict]:
  """Copies with precision (older records: bf16), label, tflops(_b2b), peak_tflops, pct_of_peak,
  best_peer (mok_jax's bf16 beside its FP8 too), speedup_vs_best_peer, check_vs, check_result."""
  out = [dict(r, precision=(p := r.get("precision", "bf16")), label=label(r.get("impl"), p))
         for r in records]
  peaks, cases = {}, {}
  for r in (r for r in out if r.get("kind") == "peak" and r.get("status") == "ok"):
    r["tflops"] = peaks[r.get("dtype")] = tflops(r["flops"], r["ms"]["median"])
  for r in (r for r in out if r.get("kind") == "moe" and r.get("status") == "ok"):
    cases.setdefault(case_key(r), []).append(r)
    r["tflops"] = tflops(r["flops"], r["ms"]["median"])
    if r.get("ms_b2b"):
      r["tflops_b2b"] = tflops(r["flops"], r["ms_b2b"]["median"])
    peak = r["peak_tflops"] = peaks.get(r.get("dtype"))
    r["pct_of_peak"] = 100.0 * r["tflops"] / peak if peak else None
  for ok in cases.values():
    fp8 = any(r["impl"] not in PEERS and r["precision"] != "bf16" for r in ok)
    best = min((r for r in ok if r["impl"] in PEERS or fp8 and r["precision"] == "bf16"),
               key=lambda r: r["ms"]["median"], default=None)
    checked = [r for r in ok if isinstance(r.get("check"), dict)]
    ref = min((r for r in checked if r["impl"] in REFERENCE_ORDER), default=None, key=lambda r: (
        r["precision"] != "bf16", REFERENCE_ORDER.index(r["impl"])))
    for r in ok:
      r["best_peer"] = best and best["label"]
      r["speedup_vs_best_peer"] = best and best["ms"]["median"] / r["ms"]["median"]
      r["check_vs"], r["check_result"] = None, "reference" if r is ref else None
      if ref is not None and r is not ref and isinstance(r.get("check"), dict):
        tol = CHECK_TOL.get(r.get("dtype"), 2e-2)
        bad = [f"{name} {r['check'].get(name)} vs {want}" for name, want in ref["check"].items()
               if not _close(r["check"].get(name), want, tol)]
        r["check_vs"] = ref["label"]
        r["check_result"] = "mismatch: " + ", ".join(bad) if bad else "ok"
  return out


def _close(got, want, tol) -> bool:
  """Relative agreement; "nan" and "inf" (text in JSON) only with themselves; a sum not taken
  (a peer without that gradient) agrees."""
  if isinstance(got, (int, float)) and isinstance(want, (int, float)):
    return abs(got - want) <= tol * max(abs(want), 1e-30)
  return got is None or got == want


def _ms(ms: float) -> str:
  return f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}" if ms >= 1 else f"{ms:.4f}"


def _tf(tf: float) -> str:
  return f"{tf:.1f}" if tf >= 1 else f"{tf:.3g}"


def _header(records: list[dict]) -> list[str]:
  first = next((r for r in records if r.get("kind") == "moe"), records[0])
  versions, ep = first.get("versions") or {}, first.get("ep") or 1
  lines = [f"MoE layer benchmark (mok_jax.bench) on {first.get('device') or '?'} "
           f"({first.get('platform') or '?'}), {first.get('dtype')}, routing "
           + (f"Zipf skew {first['skew']}" if first.get("skew") else "uniform")
           + (f", expert parallelism over {ep} devices (T and TF/s per device)" if ep > 1 else ""),
           f"{first.get('date')}  run {first.get('run_id')}  commit {first.get('commit')}  "
           + ", ".join(f"{name} {version}" for name, version in versions.items() if version)]
  for r in (r for r in records if r.get("kind") == "peak"):
    how = r.get("timing") or {}
    lines.append(f"dense matmul peak: {r.get('status')} ({r.get('reason')})" if r.get("status")
                 != "ok" else f"dense {r.get('dtype')} matmul {r['n']}^3 (jnp.dot): "
                 f"{_ms(r['ms']['median'])} ms = {r['tflops']:.1f} TFLOP/s, the 100% of '% peak'"
                 + (f"; the median of {r['ms']['n']} samples of {how['calls_per_sample']} "
                    "back-to-back calls with one sync each" if how else ""))
  sample_ms = next((round(1e3 * r["timing_b2b"]["sample_s"]) for r in records
                    if (r.get("timing_b2b") or {}).get("sample_s")), "-")
  if any(r.get("precision") == "fp8" for r in records):
    lines.append("@fp8: e4m3 products; mok_jax's in blocks on weights quantized once (its "
                 "quantize_experts' ms on the shape's line), the peers' a scale a row and weight "
                 "column, the weights' quantized in the call; FLOPs and peak as bf16's")
  return lines + [
      "TF/s = FLOPs (2*T*k*3*H*I a forward, x3 fwd+bwd) / the median ms of samples of one call "
      f"and a sync; b2b: of back-to-back calls, samples of about {sample_ms} ms, one sync each",
      "vs peer = the best peer's median / this one; mem GiB = the worker's peak device memory; "
      "compile s = jit lower+compile, or torch's first call"]


def _cells(r: dict, what: str, note) -> tuple:
  """A record's cells after its impl's."""
  if r.get("status") != "ok":
    status = STATUS_TEXT.get(r.get("status"), r.get("status") or "?")
    return (f"{status} {note(r['reason'])}" if r.get("reason") else status,)
  ms, check, mem = r["ms"], r.get("check_result") or "", r.get("peak_mem_bytes")
  median = _ms(ms["median"])
  if ms.get("n", 0) < (r.get("timing") or {}).get("reps_asked", 0):
    median += f" (n={ms['n']})"  # cut by --budget-s
  if check.startswith("mismatch"):
    median += " !" + note(f"{what}: output checksums disagree with {r['check_vs']}: {check}")
  b2b = ("-", "-")
  if r.get("ms_b2b"):
    b2b = (_ms(r["ms_b2b"]["median"]), _tf(r["tflops_b2b"]))
  elif r.get("b2b_status"):
    b2b = (STATUS_TEXT.get(r["b2b_status"], r["b2b_status"]) + " "
           + note(f"{what}, back to back: {r.get('b2b_reason')}"), "-")
  speed, pct = r.get("speedup_vs_best_peer"), r.get("pct_of_peak")
  return (median, _tf(r["tflops"]), *b2b, "-" if pct is None else f"{pct:.1f}",
          f"{speed:.2f}x" if speed else "-", f"{mem / 2 ** 30:.2f}" if mem else "-",
          "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}")


def table(records: list[dict]) -> str:
  """A block per mode, a line per shape, a row per implementation; notes numbered under it."""
  if not records:
    return "(no records)"
  notes, lines = [], _header(records)

  def note(text: str) -> str:
    notes.extend([text] * (text not in notes))
    return f"[{notes.index(text) + 1}]"

  def row(cells) -> str:
    return "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()

  for mode in MODES:
    last = None
    for r in (r for r in records if r.get("kind") == "moe" and r.get("mode") == mode):
      if last is None:
        lines += ["", f"== {mode} ==", row(name for name, _ in COLUMNS)]
      if case_key(r) != last:
        last = case_key(r)
        load, quant = (next((x[key] for x in records if x.get(key) and case_key(x) == last),
                            None) for key in ("load", "quantize_ms"))
        lines.append(f"{r['shape']}  T={r['T']} H={r['H']} I={r['I']} E={r['E']} k={r['k']}"
                     + (f"  (routes per expert: max/mean {load['max_over_mean']:.2f}, "
                        f"{load['empty_experts']} empty)" if load else "")
                     + (f"  (quantize_experts {_ms(quant)} ms)" if quant else ""))
      lines.append(row((f"  {r['label']}", *_cells(r, f"{r['label']} on {r['shape']} {mode}",
                                                    note))))
  return "\n".join(lines + [""] * bool(notes) + [f"[{i + 1}] {t}" for i, t in enumerate(notes)])


def chart(records: list[dict], path: str) -> str | None:
  """TF/s bars by shape and implementation, a panel per mode, the dense peak as a line; a failed
  run labelled where its bar would be. The path, or None without matplotlib or MoE records."""
  moe = [r for r in records if r.get("kind") == "moe"]
  try:  # a Figure of its own draws without pyplot's state or a display
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  if not moe:
    return None
  shapes = list(dict.fromkeys(r["shape"] for r in moe))
  impls = sorted({r["label"] for r in moe}, key=lambda n: (IMPLS.index(n.split("@")[0]), n))
  modes = [m for m in MODES if any(r["mode"] == m for r in moe)]
  peak = next((r["tflops"] for r in records if r.get("kind") == "peak" and "tflops" in r), None)
  colors = dict(zip(IMPLS, ("C3", "C1", "C4", "C0", "C2", "C5", "C6")))  # tab10's
  fig = Figure(figsize=(max(7.0, 1.9 * len(shapes) + 3.0), 3.6 * len(modes) + 1))
  axes = fig.subplots(len(modes), 1, squeeze=False)
  width = 0.8 / len(impls)
  for ax, mode in zip(axes[:, 0], modes):
    top = max([r.get("tflops") or 0 for r in moe if r["mode"] == mode] + [peak or 0, 1e-9])
    for r in (r for r in moe if r["mode"] == mode):
      ok, color = r.get("status") == "ok", colors[r["impl"]]
      x = shapes.index(r["shape"]) + (impls.index(r["label"]) - (len(impls) - 1) / 2) * width
      ax.bar(x, r["tflops"] if ok else 0, width, color=color, hatch="//" * ("@" in r["label"]),
             edgecolor="white", label=r["label"] if r["shape"] == shapes[0] else None)
      if not ok:
        ax.text(x, top * 0.01, STATUS_TEXT.get(r["status"], r["status"]), rotation=90,
                ha="center", va="bottom", fontsize=7, color=color)
    if peak:
      ax.axhline(peak, color="black", linestyle="--", linewidth=1,
                 label=f"dense matmul {peak:.3g} TFLOP/s" if mode == modes[0] else None)
    ax.set(xlim=(-0.5, len(shapes) - 0.5), xticks=range(len(shapes)), xticklabels=shapes,
           ylabel="TFLOP/s", ylim=(0, top * 1.12), title=mode)
    ax.grid(axis="y", alpha=0.3)
  fig.suptitle(f"MoE layer on {moe[0].get('device', '?')}, {moe[0].get('dtype', '?')} "
               f"({(moe[0].get('date') or '')[:10]})", fontsize=11)
  fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8,
             frameon=False)
  fig.tight_layout(rect=(0, 0.1, 1, 0.96))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  return path
