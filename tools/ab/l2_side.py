"""What tools/ab/l2_side_probe.cu measured: the SMs in two groups by their L2-miss latencies
(the sign of the leading eigenvector of the SMs' centred latency vectors over the lines), each
line's side (the group that reaches it sooner), and whether a line's side is an XOR of its
address bits (a fit over GF(2): for set A, bits 7-18 of the offset; for set B, bits 21-32).
Usage: python3 tools/ab/l2_side.py OUT.bin (or OUT.bin.gz)"""

import gzip
import sys

import numpy as np

LINES_A = 4096


def read(path):
  with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
    sms, lines = np.frombuffer(f.read(8), np.int32)
    smid = np.frombuffer(f.read(4 * sms), np.int32)
    offsets = np.frombuffer(f.read(8 * lines), np.int64)
    miss = np.frombuffer(f.read(2 * sms * lines), np.uint16).reshape(sms, lines).astype(float)
    hit = np.frombuffer(f.read(2 * sms * lines), np.uint16).reshape(sms, lines).astype(float)
  return smid, offsets, miss, hit


def groups(lat):
  """+1 / -1 a SM: the sign of the leading eigenvector of the SMs' latency vectors, each line
  centred over the SMs."""
  c = lat - np.median(lat, axis=0, keepdims=True)
  c = c - c.mean(axis=1, keepdims=True)
  left, sv, _ = np.linalg.svd(c, full_matrices=False)
  u = left[:, 0] * sv[0]
  return np.where(u >= 0, 1, -1), u


def gf2_fit(bits, y):
  """An XOR of a subset of `bits` columns (plus a constant) equal to y, by Gaussian
  elimination over GF(2) on the rows in order: exact where y is such an XOR, else the solution
  the first independent rows give; returns (mask over the columns, constant, fraction of rows
  it matches), the fraction saying how well an XOR fits."""
  a = np.concatenate([bits, np.ones((bits.shape[0], 1), np.uint8)], axis=1) % 2
  n = a.shape[1]
  m = np.concatenate([a, y[:, None] % 2], axis=1).astype(np.uint8)
  pivots, r = [], 0
  for col in range(n):
    sel = np.nonzero(m[r:, col])[0]
    if len(sel) == 0:
      continue
    p = r + sel[0]
    m[[r, p]] = m[[p, r]]
    others = np.nonzero(m[:, col])[0]
    others = others[others != r]
    m[others] ^= m[r]
    pivots.append(col)
    r += 1
    if r == m.shape[0]:
      break
  x = np.zeros(n, np.uint8)
  for i, col in enumerate(pivots):
    x[col] = m[i, -1]
  pred = (a.astype(np.uint8) @ x) % 2
  return x[:-1], int(x[-1]), float(np.mean(pred == y % 2))


def side_report(name, offsets, miss, g, bit_range):
  d = miss[g < 0].mean(axis=0) - miss[g > 0].mean(axis=0)  # > 0: the + group is nearer
  side = (d > 0).astype(np.uint8)
  print(f"{name}: {len(d)} lines; mean latency of the - group minus the + group, clocks: "
        f"quartiles {np.percentile(d, [0, 25, 50, 75, 100]).round(1)}; + group nearer for "
        f"{side.mean():.3f} of them")
  bits = np.stack([(offsets >> b) & 1 for b in bit_range], axis=1).astype(np.uint8)
  mask, const, frac = gf2_fit(bits, side)
  used = [b for b, m in zip(bit_range, mask) if m]
  print(f"  side as an XOR of offset bits {list(bit_range)[0]}-{list(bit_range)[-1]}: bits "
        f"{used} ^ {const}, matches {frac:.3f} of the lines")
  flips = np.mean(side[1:] != side[:-1])
  print(f"  neighbouring lines on different sides: {flips:.3f}; first 64: "
        f"{''.join(map(str, side[:64]))}")
  return side, d


def main(path):
  smid, offsets, miss, hit = read(path)
  present = smid >= 0
  print(f"{len(smid)} SMs ({np.sum(~present)} without a result), {miss.shape[1]} lines")
  miss, hit = miss[present], hit[present]
  print(f"miss latency clocks: median {np.median(miss):.0f}, quartiles "
        f"{np.percentile(miss, [25, 75]).round(0)}; hit: median {np.median(hit):.0f}, "
        f"quartiles {np.percentile(hit, [25, 75]).round(0)}")
  g, u = groups(miss[:, :LINES_A])
  ids = np.nonzero(present)[0]
  print(f"SM groups: + {np.sum(g > 0)} SMs {ids[g > 0].tolist()}")
  print(f"           - {np.sum(g < 0)} SMs {ids[g < 0].tolist()}")
  print(f"  projection spread: {np.percentile(u, [0, 25, 50, 75, 100]).round(1)}")
  side_a, d_a = side_report("set A (consecutive lines)", offsets[:LINES_A], miss[:, :LINES_A], g,
                            range(7, 19))
  side_b, _ = side_report("set B (first line of each 2 MB page)", offsets[LINES_A:],
                          miss[:, LINES_A:], g, range(21, 33))
  for name, lat in (("miss", miss[:, :LINES_A]), ("hit", hit[:, :LINES_A])):
    near = np.where(side_a[None, :] == (g[:, None] > 0), lat, np.nan)
    far = np.where(side_a[None, :] != (g[:, None] > 0), lat, np.nan)
    print(f"set A {name} latency, median clocks: near {np.nanmedian(near):.0f}, "
          f"far {np.nanmedian(far):.0f}")


if __name__ == "__main__":
  main(sys.argv[1])
