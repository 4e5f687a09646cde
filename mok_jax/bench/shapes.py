"""What the bench measures: the shapes (T, H, I, E, k) and their FLOPs, the modes, and the
implementations by name (jobs.py builds them)."""

from __future__ import annotations

import dataclasses

MODES = ("fwd", "fwd+bwd")
PRECISIONS = ("bf16", "fp8")
# The table's and the chart's order; aliases cuda, xla, ffi, jax, tokamax, torch (by precision).
IMPLS = ("mok_jax:cuda", "mok_jax:xla", "mok_jax:ffi", "jax.ragged_dot", "tokamax.ragged_dot",
         "torch._grouped_mm", "torch._scaled_grouped_mm")
_alias = lambda name: name.split(":")[-1].split(".")[0]
ALIASES = {_alias(name): tuple(n for n in IMPLS if _alias(n) == _alias(name)) for name in IMPLS}
PEERS = tuple(name for name in IMPLS if not name.startswith("mok_jax:"))
# What each runs at: mok_jax by its Config.precision, tokamax.ragged_dot's fp8 on qwix.QArrays.
RUNS_AT = {**dict.fromkeys(IMPLS, PRECISIONS), "jax.ragged_dot": ("bf16",),
           "torch._grouped_mm": ("bf16",), "torch._scaled_grouped_mm": ("fp8",)}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One MoE layer on one device, without a shared expert: T tokens, width H, expert width I, E
  experts, k routes per token."""

  name: str
  T: int
  H: int
  I: int
  E: int
  k: int

  def __post_init__(self):
    for field in ("T", "H", "I", "E", "k"):
      if not isinstance(value := getattr(self, field), int) or value < 1:
        raise ValueError(f"shape {self.name}: {field} must be an int >= 1, got {value!r}")
    if self.k > self.E:
      raise ValueError(f"shape {self.name}: k = {self.k} exceeds E = {self.E}")

  def flops(self, mode: str) -> int:
    """Padding rows are not counted; the backward does two GEMMs per forward GEMM."""
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return 2 * self.T * self.k * 3 * self.H * self.I * (1 if mode == "fwd" else 3)


SHAPES = {s.name: s for s in (
    Shape("qwen3_30b", 16384, 2048, 768, 128, 8),
    Shape("gptoss_120b", 8192, 2880, 2880, 128, 4),
    Shape("mixtral", 8192, 4096, 14336, 8, 2),
    Shape("dsv3", 4096, 7168, 2048, 256, 8),
)}
# Seconds on a 2-core CPU (f32). About 32 routes an expert, fewer than a 128-row tile, as in the
# large shapes with many experts; H and I multiples of 64, so the CUDA kernel takes it too.
TINY = (Shape("tiny", 128, 64, 64, 16, 4),)
TINY_FP8 = (Shape("tiny_fp8", 128, 128, 128, 16, 4),)  # FP8's 128-blocks: H and I of 128


def dtype_for(platform: str, precision: str = "bf16") -> str:  # precision: --precision
  return "bf16" if platform == "gpu" or precision != "bf16" else "f32"  # FP8 quantizes bf16


def label(impl: str, precision: str) -> str:
  """An implementation at a precision, as --impls takes it and the table shows it."""
  return impl if precision == "bf16" else f"{impl}@{precision}"


def parse_shape(text: str) -> Shape:
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 5 or not all(p.isdigit() for p in parts):
    raise ValueError(f"--shape takes five positive integers T,H,I,E,k, got {text!r}")
  dims = [int(p) for p in parts]
  return Shape("custom_" + "_".join(map(str, dims)), *dims)


def select(names: str | None, custom: list[str], tiny: bool, precision: str = "bf16"):
  """--tiny (TINY_FP8 at fp8), the named shapes, the --shape ones; all named if none is given."""
  chosen = list(TINY if precision == "bf16" else TINY_FP8) if tiny else []
  for name in (n.strip() for n in (names or "").split(",") if n.strip()):
    if name not in SHAPES:
      raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    chosen.append(SHAPES[name])
  return chosen + [parse_shape(text) for text in custom] or list(SHAPES.values())


def resolve_impls(names: str, platform: str, precision: str = "bf16") -> list[tuple[str, str]]:
  """--impls text (names or aliases at --precision, or NAME@P at P) -> (name, precision); empty:
  the platform's mok_jax backends (on a GPU "ffi" is the CUDA kernel too, on a CPU the C++
  targets) and the peers at it. At fp8 the first mok_jax backend's bf16 layer comes last."""
  chosen = []
  for text in filter(None, map(str.strip, names.split(","))):
    name, _, at = text.partition("@")
    runs = [n for n in ALIASES.get(name, (name,)) if (at or precision) in RUNS_AT.get(n, ())]
    if not runs:
      raise ValueError(f"no implementation {text!r} at {at or precision}; known: " + ", ".join(
          f"{n} ({'/'.join(RUNS_AT[n])})" for n in IMPLS) + f"; aliases: {', '.join(ALIASES)}")
    chosen.append((runs[0], at or precision))
  if not chosen:
    mine = {"gpu": ["mok_jax:cuda", "mok_jax:xla"], "cpu": ["mok_jax:xla", "mok_jax:ffi"]}
    chosen = [(name, precision) for name in mine.get(platform, [n for n in IMPLS if n not in PEERS])
              + [n for n in PEERS if precision in RUNS_AT[n]]]
  first = [name for name, _ in chosen if name not in PEERS][:1] if precision != "bf16" else []
  return list(dict.fromkeys(chosen + [(name, "bf16") for name in first]))
