"""Where a kernel's instructions and its stall samples sit, from its SASS.

  python tools/ab/sass.py spills DUMP   # DUMP: `cuobjdump -sass file.o`'s output
  python tools/ab/sass.py stalls CSV    # CSV: `ncu -i REP --page source --csv --print-source sass`

`spills`: per kernel, its instruction count, its k-loops (backward branches around HGMMAs) and
each local-memory spill (STL, LDL) with whether it runs inside a k-loop, where it would cost
every k-step. `stalls`: the stall samples of an ncu report with the SourceCounters section, by
reason, the share inside k-loops and the instructions with the most samples.

cuobjdump and nvdisasm are not in the build machine's CUDA; the pip index has them
(nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm: `pip download --no-deps`, unzip, nvidia/cu13/bin).
"""

import collections
import csv
import re
import sys

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"\s*Function : (\S+)")


def backward_branches(code):
  """(target, branch) address pairs of the branches that jump back: the loops. code: (address,
  instruction text) in address order; targets are absolute or relative to the first address."""
  base = code[0][0] if code else 0
  loops = []
  for address, text in code:
    if "BRA" not in text:
      continue
    target = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
    if target:
      t = int(target.group(1), 16)
      t = t if t >= base else base + t
      if t <= address:
        loops.append((t, address))
  return sorted(set(loops))


def k_loops(code):
  """The innermost loops that issue wgmma (HGMMA), as (start, end) addresses."""
  loops = [(s, e) for s, e in backward_branches(code)
           if any("HGMMA" in t for a, t in code if s <= a <= e)]
  return [(s, e) for s, e in loops
          if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]


def parse_dump(text):
  """{kernel: [(address, instruction)]} from cuobjdump -sass output."""
  kernels, name = {}, None
  for line in text.splitlines():
    f = FUNCTION.match(line)
    if f:
      name = f.group(1)
      kernels[name] = []
      continue
    m = INSTRUCTION.match(line)
    if m and name:
      kernels[name].append((int(m.group(1), 16), m.group(2).strip()))
  return kernels


def spills(text):
  """Per kernel: (name, instructions, k-loops [(start, end, instructions)], spills [(address,
  instruction, inside a k-loop)])."""
  out = []
  for name, code in parse_dump(text).items():
    loops = k_loops(code)
    found = [(a, t, any(s <= a <= e for s, e in loops)) for a, t in code
             if re.match(r"(@\S+\s+)?(STL|LDL)\b", t)]
    out.append((name, len(code), [(s, e, (e - s) // 16 + 1) for s, e in loops], found))
  return out


def stalls(rows):
  """From an ncu source CSV's rows (the header row first): (samples, {reason: samples}, share of
  samples in k-loops, [(samples, address offset, instruction, top reasons)] by samples)."""
  header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
  names = rows[header]
  col = {n: i for i, n in enumerate(names)}
  reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]

  def value(row, name):
    try:
      return float(row[col[name]].replace(",", ""))
    except (ValueError, IndexError):
      return 0.0

  body = [r for r in rows[header + 1:] if r and r[0].startswith("0x")]
  code = [(int(r[0], 16), r[1].strip()) for r in body]
  samples = [value(r, "Warp Stall Sampling (All Samples)") for r in body]
  total = sum(samples) or 1.0
  by_reason = collections.Counter()
  for r in body:
    for n in reasons:
      by_reason[n[len("stall_"):]] += value(r, n)
  loops = k_loops(code)
  in_loops = sum(s for (a, _), s in zip(code, samples) if any(b <= a <= e for b, e in loops))
  base = code[0][0] if code else 0
  top = []
  for (a, t), s, r in sorted(zip(code, samples, body), key=lambda x: -x[1]):
    why = sorted(((value(r, n), n[len("stall_"):]) for n in reasons), reverse=True)[:2]
    top.append((s, a - base, t, [w for v, w in why if v > 0]))
  return total, by_reason, in_loops / total, top


def main(argv):
  if len(argv) != 2 or argv[0] not in ("spills", "stalls"):
    raise SystemExit(__doc__)
  what, path = argv
  if what == "spills":
    for name, count, loops, found in spills(open(path).read()):
      print(f"{name[:100]}: {count} instructions, k-loops "
            + ", ".join(f"{s:#x}-{e:#x} ({n})" for s, e, n in loops))
      for a, t, hot in found:
        print(f"  {a:#07x} {t:40s} {'IN A K-LOOP' if hot else ''}")
  else:
    total, by_reason, loops, top = stalls(list(csv.reader(open(path))))
    print(f"{total:.0f} samples; in k-loops {100 * loops:.1f}%")
    print("  " + ", ".join(f"{r} {100 * v / total:.1f}%" for r, v in by_reason.most_common(10)))
    for s, a, t, why in top[:25]:
      print(f"  {100 * s / total:5.2f}%  {a:#07x}  {t[:56]:56s} {' '.join(why)}")


if __name__ == "__main__":
  main(sys.argv[1:])
