"""What the bench measures: the shapes (T, H, I, E, k) and their FLOPs, the modes, and the
implementations by name (jobs.py builds them)."""

from __future__ import annotations

import dataclasses

MODES = ("fwd", "fwd+bwd")
# In the table's and the chart's order; each has an alias (cuda, xla, ffi, jax, tokamax, torch).
IMPLS = ("mok_jax:cuda", "mok_jax:xla", "mok_jax:ffi", "jax.ragged_dot", "tokamax.ragged_dot",
         "torch._grouped_mm")
ALIASES = {name.split(":")[-1].split(".")[0]: name for name in IMPLS}
PEERS = tuple(name for name in IMPLS if not name.startswith("mok_jax:"))


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


def dtype_for(platform: str) -> str:
  return "bf16" if platform == "gpu" else "f32"


def parse_shape(text: str) -> Shape:
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 5 or not all(p.isdigit() for p in parts):
    raise ValueError(f"--shape takes five positive integers T,H,I,E,k, got {text!r}")
  dims = [int(p) for p in parts]
  return Shape("custom_" + "_".join(map(str, dims)), *dims)


def select(names: str | None, custom: list[str], tiny: bool) -> list[Shape]:
  """--tiny, then the named shapes, then --shape ones; all named shapes if none is given."""
  chosen = list(TINY) if tiny else []
  for name in (n.strip() for n in (names or "").split(",") if n.strip()):
    if name not in SHAPES:
      raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    chosen.append(SHAPES[name])
  return chosen + [parse_shape(text) for text in custom] or list(SHAPES.values())


def default_impls(platform: str) -> list[str]:
  """On a GPU "ffi" is the CUDA kernel too, on a CPU the C++ targets; elsewhere every backend."""
  mine = {"gpu": ["mok_jax:cuda", "mok_jax:xla"], "cpu": ["mok_jax:xla", "mok_jax:ffi"]}
  return mine.get(platform, [name for name in IMPLS if name not in PEERS]) + list(PEERS)


def resolve_impls(names: str, platform: str) -> list[str]:
  """--impls text (names or aliases; empty: the platform's defaults) -> names."""
  chosen = [ALIASES.get(n.strip(), n.strip()) for n in names.split(",") if n.strip()]
  for name in chosen:
    if name not in IMPLS:
      raise ValueError(f"unknown implementation {name!r}; known: {', '.join(IMPLS)} "
                       f"(aliases: {', '.join(ALIASES)})")
  return list(dict.fromkeys(chosen)) or default_impls(platform)
