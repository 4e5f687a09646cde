"""Benchmark shapes (T, H, I, E, k [, Is]) and the FLOP count of the MoE layer."""

from __future__ import annotations

import dataclasses

MODES = ("fwd", "fwd+bwd")

# --breakdown: the CUDA forward's stages in launch order. The launcher leaves out those named in
# SKIP_ENV (comma-separated, read on every call; the results are then wrong: a diagnostic only),
# all but the layout, which every later stage reads.
FWD_STAGES = ("layout", "gather", "gemm1", "gemm2", "shared", "combine")
SKIP_ENV = "MOK_FWD_SKIP"
SKIP_PREFIX = "fwd-skip-"
LAYOUT_ONLY = "fwd-layout-only"

@dataclasses.dataclass(frozen=True)
class Shape:
  """One MoE layer on one device.

  T tokens, model width H, expert intermediate width I, E experts, k routes per token, and a
  shared expert of intermediate width Is (0: none).
  """

  name: str
  T: int
  H: int
  I: int
  E: int
  k: int
  Is: int = 0

  def __post_init__(self):
    for field in ("T", "H", "I", "E", "k"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"shape {self.name}: {field} must be a positive int, got {value!r}")
    if self.k > self.E:
      raise ValueError(f"shape {self.name}: k = {self.k} exceeds E = {self.E}")
    if not isinstance(self.Is, int) or self.Is < 0:
      raise ValueError(f"shape {self.name}: Is must be an int >= 0, got {self.Is!r}")

  @property
  def dims(self) -> tuple[int, int, int, int, int]:
    return (self.T, self.H, self.I, self.E, self.k)

  def flops(self, mode: str) -> int:
    """2*T*k*3*H*I for the routed experts plus 2*T*3*H*Is for the shared one, per forward;
    forward+backward counts three times that (two GEMMs of the backward per forward GEMM)."""
    forward = 2 * self.T * self.k * 3 * self.H * self.I + 2 * self.T * 3 * self.H * self.Is
    if mode == "fwd":
      return forward
    if mode == "fwd+bwd":
      return 3 * forward
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


SHAPES = {
    s.name: s for s in (
        Shape("qwen3_30b", 16384, 2048, 768, 128, 8),
        Shape("gptoss_120b", 8192, 2880, 2880, 128, 4),
        Shape("mixtral", 8192, 4096, 14336, 8, 2),
        Shape("dsv3", 4096, 7168, 2048, 256, 8),
    )
}

# Runs on a 2-core CPU in seconds (f32). E = 16 experts with 128 * 4 routes: about 32 routes
# each, fewer than a 128-row expert tile, as in the large shapes with many experts. H and I are
# multiples of 64, so on a GPU the CUDA kernel takes it too (a quick smoke run there).
TINY = (Shape("tiny", 128, 64, 64, 16, 4),)


def breakdown_modes(shape: Shape) -> list[str]:
  """A breakdown job's modes: "fwd" (the forward as it is), SKIP_PREFIX + stage for each stage
  the launcher can leave out ("shared" only with a shared expert: leaving out a stage that does
  not run would time noise), and LAYOUT_ONLY (all of those left out: the layout alone)."""
  skippable = [s for s in FWD_STAGES[1:] if s != "shared" or shape.Is]
  return ["fwd"] + [SKIP_PREFIX + s for s in skippable] + [LAYOUT_ONLY]


def breakdown_variant(mode: str) -> tuple[str | None, tuple[str, ...]]:
  """(the stage a breakdown mode times, the stages it leaves out); (None, ()) for "fwd"."""
  if mode == "fwd":
    return None, ()
  if mode == LAYOUT_ONLY:
    return "layout", FWD_STAGES[1:]
  stage = mode[len(SKIP_PREFIX):]
  if not mode.startswith(SKIP_PREFIX) or stage not in FWD_STAGES[1:]:
    raise ValueError(f"breakdown mode must be 'fwd', {LAYOUT_ONLY!r} or {SKIP_PREFIX}<stage> with "
                     f"a stage in {FWD_STAGES[1:]}, got {mode!r}")
  return stage, (stage,)


def parse_shape(text: str) -> Shape:
  """'T,H,I,E,k' -> Shape named 'custom_T_H_I_E_k'."""
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 5 or not all(p.isdigit() for p in parts):
    raise ValueError(f"--shape takes five positive integers T,H,I,E,k, got {text!r}")
  T, H, I, E, k = map(int, parts)
  return Shape(f"custom_{T}_{H}_{I}_{E}_{k}", T, H, I, E, k)


def select(names: str | None, custom: list[str], tiny: bool, shared: int) -> list[Shape]:
  """The shapes to run: --tiny, named ones, and --shape ones; all four named ones by default."""
  chosen: list[Shape] = []
  if tiny:
    chosen.extend(TINY)
  if names:
    for name in (n.strip() for n in names.split(",") if n.strip()):
      if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
      chosen.append(SHAPES[name])
  chosen.extend(parse_shape(text) for text in custom)
  if not chosen:
    chosen = list(SHAPES.values())
  if shared:
    chosen = [dataclasses.replace(s, Is=shared) for s in chosen]
  return chosen
