"""Kernel knobs of `mok_jax.moe`, as one frozen (hashable, jit-static) dataclass."""

from __future__ import annotations

import dataclasses

EP_TRANSPORTS = ("auto", "collective", "nvlink")
PRECISIONS = ("bf16", "fp8", "mxfp8")


@dataclasses.dataclass(frozen=True)
class Config:
  """Knobs of `mok_jax.moe`: block_m and recompute are the FFI backends' (`ffi`, `cuda`; the
  `xla` backend ignores them), ep_transport, ep_capacity and precision every backend's.

  Attributes:
    block_m: rows of one expert tile. The routed rows of each expert start at a multiple of
      `block_m` in the expert-sorted buffers, so that a tile never spans two experts; the
      buffers therefore hold `routed_rows(T * k, E, block_m)` rows (see `mok_jax.ops`). The C++
      CPU target uses the same layout as the CUDA kernel so that CI checks it. A power of two
      in [1, 256]; the CUDA kernel takes 64 or 128 (its tiles are 128 rows; with 64 an expert
      may end in a half tile, whose two warpgroups split its columns, and the padding
      shrinks; both give the same bits there).
    recompute: trades time for memory in the backward. False: the forward keeps the
      pre-activations gu = [x @ w_gate | x @ w_up] of the routed rows and of the shared expert
      and the routed token rows xs as residuals, b (2 R I + 2 T Is + R H) bytes per layer (b =
      bytes per element of x) held from the forward until the backward. True: those residuals
      are empty (the forward does not write gu at all) and the backward first gathers xs again
      and recomputes gu from it with the forward's own gate|up GEMM, 2/3 of a forward's FLOPs
      (forward + backward do 11/9 of the save mode's work). The same bits either way. Not
      differentiated (inference), the layer's forward keeps neither whatever this knob says.
    ep_transport: how expert parallelism (`moe(..., axis_name=...)`) moves the routed rows, with
      the same layout and the same bits either way. "collective": XLA's ragged all-to-all
      (mok_jax.expert_parallel); "nvlink": the CUDA kernels' own transport, over NVLink (or PCIe
      peer-to-peer) on a `mok_jax.Workspace` (mok_jax.ep_transport, docs/expert_parallel.md),
      for the CUDA backend on the GPUs of one process that reach each other's memory, an error
      elsewhere; "auto": "nvlink" where it can run, else "collective".
    ep_capacity: None (dropless, the default) or the most routed rows that one rank sends to
      another in one call. Each rank's send and receive buffers hold P * C rows of H (P ranks,
      C = ep_capacity, or T k without it: every route of a rank to one rank). A call that needs
      more fails (an error from the device, naming the rows it needed), never drops a route.
    precision: the expert products' numerics. "bf16" (the default): operands of x's dtype, f32
      sums. "fp8": block-scaled e4m3 (mok_jax.quantize: activations in 1 x 128 blocks along
      the reduction, expert weights in 128 x 128 blocks, f32 sums; the weight gradients stay
      GEMMs of x's dtype). "mxfp8": 1 x 32 blocks with power-of-two scales. The FP8 precisions
      run on the `xla` backend so far (`auto` picks it; `ffi` and `cuda` raise).
  """

  block_m: int = 64
  recompute: bool = False
  ep_transport: str = "auto"
  ep_capacity: int | None = None
  precision: str = "bf16"

  def __post_init__(self):
    b = self.block_m
    if not isinstance(b, int) or isinstance(b, bool) or b < 1 or b > 256 or b & (b - 1):
      raise ValueError(f"Config.block_m must be a power of two in [1, 256], got {b!r}")
    if not isinstance(self.recompute, bool):
      raise ValueError(f"Config.recompute must be a bool, got {self.recompute!r}")
    if self.ep_transport not in EP_TRANSPORTS:
      raise ValueError(f"Config.ep_transport must be one of {EP_TRANSPORTS}, got "
                       f"{self.ep_transport!r}")
    c = self.ep_capacity
    if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
      raise ValueError(f"Config.ep_capacity must be None or an integer of at least 1, got {c!r}")
    if self.precision not in PRECISIONS:
      raise ValueError(f"Config.precision must be one of {PRECISIONS}, got {self.precision!r}")
