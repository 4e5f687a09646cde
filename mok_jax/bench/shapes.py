"""Benchmark shapes (T, H, I, E, k [, Is]) and the FLOP count of the MoE layer."""

from __future__ import annotations

import dataclasses

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One MoE layer on one device: T tokens, width H, expert width I, E experts, k routes per
  token, a shared expert of width Is (0: none)."""

  name: str
  T: int
  H: int
  I: int
  E: int
  k: int
  Is: int = 0

  def __post_init__(self):
    for field, least in (("T", 1), ("H", 1), ("I", 1), ("E", 1), ("k", 1), ("Is", 0)):
      value = getattr(self, field)
      if not isinstance(value, int) or value < least:
        raise ValueError(f"shape {self.name}: {field} must be an int >= {least}, got {value!r}")
    if self.k > self.E:
      raise ValueError(f"shape {self.name}: k = {self.k} exceeds E = {self.E}")

  @property
  def dims(self) -> tuple[int, int, int, int, int]:
    return (self.T, self.H, self.I, self.E, self.k)
  def flops(self, mode: str) -> int:
    """Padding rows are not counted; the backward does two GEMMs per forward GEMM."""
    forward = 2 * self.T * self.k * 3 * self.H * self.I + 2 * self.T * 3 * self.H * self.Is
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return forward if mode == "fwd" else 3 * forward


SHAPES = {s.name: s for s in (
    Shape("qwen3_30b", 16384, 2048, 768, 128, 8),
    Shape("gptoss_120b", 8192, 2880, 2880, 128, 4),
    Shape("mixtral", 8192, 4096, 14336, 8, 2),
    Shape("dsv3", 4096, 7168, 2048, 256, 8),
)}

# Seconds on a 2-core CPU (f32). About 32 routes an expert, fewer than a 128-row tile, as in the
# large shapes with many experts; H and I multiples of 64, so the CUDA kernel takes it too.
TINY = (Shape("tiny", 128, 64, 64, 16, 4),)


def parse_shape(text: str) -> Shape:
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 5 or not all(p.isdigit() for p in parts):
    raise ValueError(f"--shape takes five positive integers T,H,I,E,k, got {text!r}")
  T, H, I, E, k = map(int, parts)
  return Shape(f"custom_{T}_{H}_{I}_{E}_{k}", T, H, I, E, k)


def select(names: str | None, custom: list[str], tiny: bool, shared: int) -> list[Shape]:
  """--tiny, then the named shapes, then --shape ones; all named shapes if none is given."""
  chosen = list(TINY) if tiny else []
  for name in (n.strip() for n in (names or "").split(",") if n.strip()):
    if name not in SHAPES:
      raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    chosen.append(SHAPES[name])
  chosen += [parse_shape(text) for text in custom]
  chosen = chosen or list(SHAPES.values())
  return [dataclasses.replace(s, Is=shared) for s in chosen] if shared else chosen
