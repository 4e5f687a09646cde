"""One thin `jax.ffi.ffi_call` wrapper per FFI target, each checking its inputs at trace time.

Targets (registered under the same names for platform "cpu", the C++ reference in ffi/*_cpu.cc,
and "CUDA", the kernels):

  mok_moe_fwd      the layer forward over the experts held here; returns y and the residuals
  mok_moe_bwd      all gradients from dy and those residuals
  mok_moe_combine  the forward's combine on its own: the home rank's sum of its tokens' routes
                   under expert parallelism (mok_jax.expert_parallel)
  mok_moe_fwd_fp8  the forward with block-scaled e4m3 products (Config(precision="fp8"))
  mok_moe_bwd_fp8  its gradients, the data gradients' products block-scaled e4m3
  mok_quantize_weight  an expert weight in 128 x 128 blocks of e4m3 (quantize_experts)

The routed buffers are expert-sorted: expert e's routes occupy rows [offsets[e], offsets[e] +
count_e) in ascending (t, j) order, and offsets[e] is a multiple of block_m. Their row count is
`routed_rows(T * k, E, block_m)`, the most any routing can need, so nothing is ever dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import _mok_cpu, quantize, reference
from mok_jax.config import Config

try:
  from mok_jax import _mok_cuda
except ImportError:  # built without a CUDA compiler, or MOK_CUDA=OFF
  _mok_cuda = None

for _name, _capsule in _mok_cpu.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
_CUDA_TARGETS = frozenset(_mok_cuda.registrations()) if _mok_cuda is not None else frozenset()
if _mok_cuda is not None:
  for _name, _capsule in _mok_cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
CUDA_DTYPE = jnp.dtype(jnp.bfloat16)
CUDA_MAX_EXPERTS = 512
CUDA_DIM_MULTIPLE = 64
CUDA_BLOCK_MS = (64, 128)  # the kernel's tiles are 128 rows; 64 adds half tiles
CUDA_COMPUTE_CAPABILITY = "9.0"  # the kernels are sm_90a code: Hopper only
FP8_BLOCK = 128  # the FP8 kernels' blocks: H, I and Is are multiples of it


class MoeDims(NamedTuple):
  T: int  # tokens
  H: int  # model width
  I: int  # expert intermediate width
  E: int  # experts held here
  k: int  # routes per token
  Is: int  # shared-expert intermediate width, 0 without one


class Residuals(NamedTuple):
  """What mok_moe_fwd saves for mok_moe_bwd. R = routed_rows(T * k, E, block_m). With
  Config.recompute, gu, gu_shared and xs have zero rows: the backward recomputes them from x.
  Rows of gu and xs past offsets[E] (the rows in use) are unspecified and never read, nor are
  gu's padding rows (each expert's rows after its last route); xs's padding rows are zeros,
  which the weight gradients' reductions run over. The routes' outputs
  (y_routed) are not kept: the backward takes dweights from <dy @ w_down^T, h>."""

  pos: jax.Array  # (T, k) int32: routed row of route (t, j); -1 for an invalid id
  offsets: jax.Array  # (E + 1,) int32: first routed row of each expert; [E] = rows in use
  rows: jax.Array  # (R,) int32: route t * k + j held by each routed row; -1 for padding
  gu: jax.Array  # (R, 2I) x.dtype: pre-activation [x @ w_gate | x @ w_up] of each routed row
  gu_shared: jax.Array  # (T, 2Is) x.dtype: pre-activation of the shared expert
  xs: jax.Array  # (R, H) x.dtype: token row of each routed row, zeros for padding

  def saved(self) -> "Residuals":
    """What a custom VJP saves of these: each empty residual (gu_shared without a shared
    expert, gu and xs with recompute) as None, which moe_bwd makes again. Saved, inside
    shard_map an empty one becomes an input of the backward's manual computation that XLA folds
    to a constant, and removing that unused input crashed Shardy's canonicalizer (a segfault
    compiling the step, jax 0.11.2 on 2 GPUs)."""
    return Residuals(*(None if r.size == 0 else r for r in self))


class Grads(NamedTuple):
  x: jax.Array
  weights: jax.Array
  w_gate: jax.Array
  w_up: jax.Array
  w_down: jax.Array
  shared: tuple | None


# The targets' buffers in argument order: the one list that the C++ bindings and handlers
# (ffi/moe_args.h, ffi/moe_*_{cpu,cuda}.cc) and docs/design.md are checked against
# (tests/test_buffer_table.py). fwd_results and bwd_results declare the results by these names.
FWD_OPERANDS = ("x", "experts", "weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                "ws_down")
FWD_RESULTS = ("y", *Residuals._fields, "y_routed", "xs_scratch", "h", "h_shared", "y_shared",
               "layout")
BWD_OPERANDS = ("dy", *FWD_OPERANDS, *Residuals._fields)
BWD_RESULTS = ("dx", "dweights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down",
               "xs_rows", "dy_routed", "dgu", "dgu_shared", "h", "h_shared", "dx_shared",
               "dw_parts", "queue")
# mok_moe_bwd writes these results over these operands (bwd_aliases).
BWD_ALIASES = (("gu", "dgu"), ("gu_shared", "dgu_shared"), ("xs", "xs_rows"))
COMBINE_OPERANDS = ("rows", "pos", "weights", "extra")
COMBINE_RESULTS = ("out",)
FWD_FP8_OPERANDS = ("x", "experts", "weights", "w_gate", "w_gate_scale", "w_up", "w_up_scale",
                    "w_down", "w_down_scale", "ws_gate", "ws_gate_scale", "ws_up", "ws_up_scale",
                    "ws_down", "ws_down_scale")


class Fp8Buffers(NamedTuple):
  """What mok_moe_fwd_fp8 writes beside y (R = routed_rows(T * k, E, block_m); the scales of an
  (M, K) activation are (K / 128, fp8_scale_pitch(M)) f32: block b of row r at [b, r]). The
  layer keeps the layout and gu for mok_moe_bwd_fp8 (`Fp8Residuals`); the rest is scratch."""

  pos: jax.Array  # (T, k) int32, as Residuals.pos
  offsets: jax.Array  # (E + 1,) int32
  rows: jax.Array  # (R,) int32
  gu: jax.Array  # (R, 2I) bf16 [g | u] when kept (keep_gu), else (0, 2I)
  gu_shared: jax.Array  # (T, 2Is) bf16 when kept, else (0, 2Is)
  xq: jax.Array  # (R, H) e4m3: each routed row's token row in 1 x 128 blocks, padding zeros
  xq_scale: jax.Array  # (H / 128, pitch(R)) f32; padding rows 1
  hq: jax.Array  # (R, I) e4m3: silu(g) * u of each routed row
  hq_scale: jax.Array  # (I / 128, pitch(R)) f32
  y_routed: jax.Array  # (R, H) bf16: each route's unweighted output
  xq_shared: jax.Array  # (T, H) e4m3 (0 rows without a shared expert): every token's row
  xq_shared_scale: jax.Array  # (H / 128, pitch(T or 0)) f32
  hq_shared: jax.Array  # (T, Is) e4m3
  hq_shared_scale: jax.Array  # (Is / 128, pitch(T)) f32
  y_shared: jax.Array  # (T, H) bf16 (0 rows without a shared expert)


FWD_FP8_RESULTS = ("y", *Fp8Buffers._fields, "layout")


class Fp8Residuals(NamedTuple):
  """What mok_moe_bwd_fp8 takes of the FP8 forward (its Fp8Buffers with gu kept)."""

  pos: jax.Array
  offsets: jax.Array
  rows: jax.Array
  gu: jax.Array  # (R, 2I) bf16
  gu_shared: jax.Array  # (T, 2Is) bf16


BWD_FP8_OPERANDS = ("dy", *FWD_FP8_OPERANDS, *Fp8Residuals._fields)
BWD_FP8_RESULTS = (*BWD_RESULTS, "dyq", "dyq_scale", "dyq_shared", "dyq_shared_scale", "dguq",
                   "dguq_scale", "dguq_shared", "dguq_shared_scale")
# mok_moe_bwd_fp8 writes these results over these operands (its input_output_aliases).
BWD_FP8_ALIASES = (("gu", "dgu"), ("gu_shared", "dgu_shared"))


def routed_rows(num_routes: int, num_experts: int, block_m: int) -> int:
  """Rows of the expert-sorted buffers: every route, plus the padding that aligns each
  non-empty expert to block_m (at most block_m - 1 rows for each of min(E, routes) experts)."""
  return num_routes + min(num_experts, num_routes) * (block_m - 1)


def _shape(a):
  return tuple(np.shape(a))


def check_moe_args(x, experts, weights, w_gate, w_up, w_down, shared) -> MoeDims:
  """Checks ranks, agreeing sizes and the dtypes of x and the weight tensors."""
  if np.ndim(x) != 2:
    raise ValueError(f"moe: x must be (T, H), got shape {_shape(x)}")
  T, H = _shape(x)
  dtype = jnp.dtype(x.dtype)
  if dtype not in DTYPES:
    raise ValueError(f"moe: x has dtype {dtype}; supported: {', '.join(map(str, DTYPES))}")
  if np.ndim(experts) != 2 or _shape(experts)[0] != T or _shape(experts)[1] < 1:
    raise ValueError(f"moe: experts must be (T, k) with T = {T} (from x {_shape(x)}) and k >= 1, "
                     f"got shape {_shape(experts)}")
  k = _shape(experts)[1]
  if _shape(weights) != (T, k):
    raise ValueError(f"moe: weights must have the shape of experts ({T}, {k}), got "
                     f"{_shape(weights)}")
  if np.ndim(w_gate) != 3 or _shape(w_gate)[1] != H:
    raise ValueError(f"moe: w_gate must be (E, H, I) with H = {H} (from x {_shape(x)}), got "
                     f"{_shape(w_gate)}")
  E, _, I = _shape(w_gate)
  if E < 1 or I < 1:
    raise ValueError(f"moe: w_gate {_shape(w_gate)} must have E >= 1 and I >= 1")
  if _shape(w_up) != (E, H, I):
    raise ValueError(f"moe: w_up must be (E, H, I) = {(E, H, I)} like w_gate, got "
                     f"{_shape(w_up)}")
  if _shape(w_down) != (E, I, H):
    raise ValueError(f"moe: w_down must be (E, I, H) = {(E, I, H)}, got {_shape(w_down)}")
  named = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
  Is = 0
  if shared is not None:
    if not isinstance(shared, (tuple, list)) or len(shared) != 3:
      raise ValueError("moe: shared must be None or (ws_gate, ws_up, ws_down), got "
                       f"{type(shared).__name__}")
    ws_gate, ws_up, ws_down = shared
    if np.ndim(ws_gate) != 2 or _shape(ws_gate)[0] != H or _shape(ws_gate)[1] < 1:
      raise ValueError(f"moe: ws_gate must be (H, Is) with H = {H}, got {_shape(ws_gate)}")
    Is = _shape(ws_gate)[1]
    if _shape(ws_up) != (H, Is):
      raise ValueError(f"moe: ws_up must be (H, Is) = {(H, Is)} like ws_gate, got "
                       f"{_shape(ws_up)}")
    if _shape(ws_down) != (Is, H):
      raise ValueError(f"moe: ws_down must be (Is, H) = {(Is, H)}, got {_shape(ws_down)}")
    named.update(ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down)
  for name, a in named.items():
    if jnp.dtype(a.dtype) != dtype:
      raise ValueError(f"moe: {name} has dtype {jnp.dtype(a.dtype)}, x has {dtype}; they must "
                       "match (cast the parameters to the compute dtype first)")
  return MoeDims(T, H, I, E, k, Is)


def has_cuda_target(name: str) -> bool:
  """Whether the CUDA module is built and registers the target `name`."""
  return _mok_cuda is not None and name in _CUDA_TARGETS


def check_ffi_dtype(dtype):
  if jnp.dtype(dtype) not in DTYPES:
    raise ValueError(f"the FFI targets take {', '.join(map(str, DTYPES))}, got {dtype}")


def fp8_unsupported_reason(dtype, dims: MoeDims, config) -> str | None:
  """Why the FP8 targets (mok_moe_fwd_fp8, on CPU and CUDA alike) cannot run this call with
  config.precision (not "bf16"), or None when they can."""
  if config.precision != "fp8":
    return (f"the FP8 kernels implement Config(precision='fp8') (Hopper's e4m3 in 128-blocks); "
            f"{config.precision!r} runs on backend='xla'")
  if jnp.dtype(dtype) != CUDA_DTYPE:
    return f"the FP8 kernels take {CUDA_DTYPE} tokens and weights, got {jnp.dtype(dtype)}"
  b = FP8_BLOCK
  if dims.H % b or dims.I % b or dims.Is % b:
    return (f"the FP8 kernels need H, I and Is divisible by {b} (their blocks), got {dims.H}, "
            f"{dims.I}, {dims.Is}")
  return None


def cuda_unsupported_reason(platform, dtype, dims: MoeDims, config) -> str | None:
  """Why the CUDA kernel cannot run this call, or None when it can (with an FP8 precision, the
  FP8 forward: fp8_unsupported_reason too)."""
  if platform != "gpu":
    return f"JAX's default backend is {platform!r}, not a CUDA GPU"
  if _mok_cuda is None:
    return ("mok_jax was installed without its CUDA module (no CUDA compiler found at build "
            "time, or MOK_CUDA=OFF)")
  device_problem = cuda_device_problem(jax.local_devices())
  if device_problem:
    return device_problem
  if jnp.dtype(dtype) != CUDA_DTYPE:
    return f"the CUDA kernel takes {CUDA_DTYPE} tokens and weights, got {jnp.dtype(dtype)}"
  m = CUDA_DIM_MULTIPLE
  if dims.H % m or dims.I % m or dims.Is % m:
    return f"the CUDA kernel needs H, I and Is divisible by {m}, got {dims.H}, {dims.I}, {dims.Is}"
  if dims.E > CUDA_MAX_EXPERTS:
    return f"the CUDA kernel holds at most {CUDA_MAX_EXPERTS} experts per GPU, got {dims.E}"
  if config.block_m not in CUDA_BLOCK_MS:
    return f"the CUDA kernel needs Config.block_m in {CUDA_BLOCK_MS}, got {config.block_m}"
  if config.precision != "bf16":
    return fp8_unsupported_reason(dtype, dims, config)
  return None


def cuda_device_problem(devices) -> str | None:
  """Why the CUDA kernel cannot run on these GPUs (JAX devices of platform "gpu"), or None."""
  for d in devices:
    capability = getattr(d, "compute_capability", None)
    if capability != CUDA_COMPUTE_CAPABILITY:
      which = f" (compute capability {capability})" if capability else ""
      return (f"the CUDA kernel runs on Hopper GPUs (compute capability "
              f"{CUDA_COMPUTE_CAPABILITY}), not on {d.device_kind}{which}")
  return None


def _shared_or_empty(shared, H, dtype):
  """The shared weights, or (H, 0), (H, 0), (0, H) arrays: Is = 0 means no shared expert."""
  if shared is not None:
    return tuple(shared)
  return (jnp.zeros((H, 0), dtype), jnp.zeros((H, 0), dtype), jnp.zeros((0, H), dtype))


def _check_ffi_inputs(x, experts, weights, w_gate, w_up, w_down, shared):
  dims = check_moe_args(x, experts, weights, w_gate, w_up, w_down, shared)
  check_ffi_dtype(x.dtype)
  if experts.dtype != jnp.int32:
    raise ValueError(f"moe_fwd/moe_bwd: experts must be int32, got {experts.dtype}")
  if weights.dtype != jnp.float32:
    raise ValueError(f"moe_fwd/moe_bwd: weights must be float32, got {weights.dtype}")
  return dims


def fwd_results(dims: MoeDims, dtype, out_dtype, block_m, recompute=False) -> tuple:
  """The results mok_moe_fwd declares, in FWD_RESULTS order: y, the `Residuals`, then scratch
  that XLA frees after the call (declared results, so that the handler allocates nothing). With
  recompute gu and gu_shared have zero rows and no scratch holds them either: the forward does
  not write them; xs then has zero rows too, and xs_scratch of R rows holds the forward's."""
  T, H, I, E, k, Is = dims
  R = routed_rows(T * k, E, block_m)
  Rg, Tg = (0, 0) if recompute else (R, T)  # rows of gu and gu_shared kept as residuals
  sds = jax.ShapeDtypeStruct
  return _in_order(FWD_RESULTS, dict(
      y=sds((T, H), out_dtype),
      pos=sds((T, k), jnp.int32),
      offsets=sds((E + 1,), jnp.int32),
      rows=sds((R,), jnp.int32),
      gu=sds((Rg, 2 * I), dtype),
      gu_shared=sds((Tg, 2 * Is), dtype),
      xs=sds((Rg, H), dtype),  # the token row of each routed row
      y_routed=sds((R, H), dtype),  # the unweighted expert output of each routed row
      xs_scratch=sds((R - Rg, H), dtype),  # xs, with recompute
      h=sds((R, I), dtype),  # silu(g) * u
      h_shared=sds((T, Is), dtype),
      y_shared=sds((T if Is else 0, H), dtype),  # the shared expert's output
      layout=sds((_mok_cpu.layout_scratch_ints(T, k, E),), jnp.int32),  # layout, tile queue
  ))


def _in_order(names: tuple[str, ...], buffers: dict) -> tuple:
  assert tuple(buffers) == names, (tuple(buffers), names)
  return tuple(buffers.values())


def bwd_results(dims: MoeDims, dtype, block_m, recompute=False) -> tuple:
  """The results mok_moe_bwd declares, in BWD_RESULTS order: the eight gradients, then scratch.
  xs_rows, dgu and dgu_shared are written over the residuals xs, gu and gu_shared
  (`bwd_aliases`), or with recompute xs is gathered and gu recomputed into them."""
  T, H, I, E, k, Is = dims
  R = routed_rows(T * k, E, block_m)
  sds = jax.ShapeDtypeStruct
  return _in_order(BWD_RESULTS, dict(
      dx=sds((T, H), dtype),
      dweights=sds((T, k), jnp.float32),
      dw_gate=sds((E, H, I), dtype),
      dw_up=sds((E, H, I), dtype),
      dw_down=sds((E, I, H), dtype),
      dws_gate=sds((H, Is), dtype),
      dws_up=sds((H, Is), dtype),
      dws_down=sds((Is, H), dtype),
      # the token row of each routed row (xs), then, once the weight gradients have read it,
      # dx of each routed row (summed per token in j order) over it
      xs_rows=sds((R, H), dtype),
      dy_routed=sds((R, H), dtype),  # dy of each routed row
      dgu=sds((R, 2 * I), dtype),  # [dg | du] of each routed row, over gu
      dgu_shared=sds((T, 2 * Is), dtype),  # [dg | du] of the shared expert, over gu_shared
      h=sds((R, I), dtype),  # silu(g) * u, recomputed from gu
      h_shared=sds((T, Is), dtype),
      dx_shared=sds((T if Is else 0, H), dtype),  # dx of the shared expert
      # each routed row's <dy @ w_down^T, h> by 128 columns of I, summed into dweights
      dw_parts=sds((R, _mok_cpu.dw_part_cols(I)), jnp.float32),
      queue=sds((_mok_cpu.tile_queue_ints(T, k, E),), jnp.int32),  # tile queues of the GEMMs
  ))


def bwd_aliases(dims: MoeDims, recompute=False) -> dict:
  """mok_moe_bwd's `input_output_aliases` (BWD_ALIASES by index): without recompute, dgu takes
  gu's buffer and dgu_shared gu_shared's (each SwiGLU backward tile reads its g and u before it
  writes dg and du there), and xs_rows (dx of each routed row once the weight gradients have
  read xs) the residual xs's. Under jit, where the residuals die with the backward, XLA gives
  the backward those buffers; where one is still needed after it, XLA copies it first."""
  if recompute:
    return {}
  return _aliases(dims, BWD_OPERANDS, BWD_RESULTS, BWD_ALIASES)


def _aliases(dims: MoeDims, operands, results, pairs) -> dict:
  """input_output_aliases of a backward target: (operand, result) pairs by index, gu_shared's
  only with a shared expert (without one it is an empty buffer)."""
  return {operands.index(op): results.index(res) for op, res in pairs
          if dims.Is > 0 or op != "gu_shared"}


class Footprint(NamedTuple):
  """Device bytes of one layer's call, beyond its inputs and outputs (see `footprint`)."""

  residuals: int  # kept from the forward until the backward
  fwd_scratch: int  # live during the forward call only
  bwd_scratch: int  # live during the backward call only


def footprint(dims: MoeDims, dtype, block_m=Config.block_m, recompute=False) -> Footprint:
  """The memory the FFI targets need, with b = bytes per element of x, R = routed_rows(T k, E,
  block_m) = T k + min(E, T k) (block_m - 1), S = [Is > 0], G = b (2 R I + 2 T Is) the bytes of
  gu and gu_shared, X = b R H those of xs (each routed row's token row), and C = [recompute]:

    residuals   = 4 (T k + E + 1 + R) + (1 - C) (G + X)
    fwd scratch = b (R H + R I + T Is + S T H) + C X + 4 (ceil(T k / 1024) E + Q),
                  Q = 8 + ceil((T k + 127 E) / 64) + ceil(T / 128) (the tile queue)
    bwd scratch = b (R H + R I + T Is + S T H) + 4 Q + 4 R ceil(I / 128) + C (G + X)

  The backward's dx of each routed row (b R H) takes the buffer of xs once the weight gradients
  have read that, and its dgu (G) the buffer of gu: the residuals', or with recompute the ones
  it gathers xs and recomputes gu into.

  Recompute moves G + X from the residuals, held from the forward until the backward, into the
  backward's scratch, which that call frees (the forward then holds xs as scratch and writes no
  gu at all), and leaves the routing layout the only residual: less memory a layer for a gather
  and a GEMM more. Each route's output (b R H) is forward scratch: the backward takes dweights
  from <dy @ w_down^T, h>, not from it. The forward's y and the
  backward's gradients are not counted (any implementation has them).
  """
  T, H, I, E, k, Is = dims
  b = jnp.dtype(dtype).itemsize
  R = routed_rows(T * k, E, block_m)
  S = 1 if Is else 0
  G = b * (2 * R * I + 2 * T * Is)
  X = b * R * H
  C = 1 if recompute else 0
  chunks = -(-T * k // 1024)
  Q = 8 + -(-(T * k + 127 * E) // 64) + -(-T // 128)
  return Footprint(
      residuals=4 * (T * k + E + 1 + R) + (1 - C) * (G + X),
      fwd_scratch=b * (R * H + R * I + T * Is + S * T * H) + C * X + 4 * (chunks * E + Q),
      bwd_scratch=(b * (R * H + R * I + T * Is + S * T * H) + 4 * Q + 4 * R * -(-I // 128) +
                   C * (G + X)),
  )


def moe_fwd(x, experts, weights, w_gate, w_up, w_down, shared=None, *, out_dtype, block_m,
            recompute=False, ranks=1):
  """Target mok_moe_fwd.

  Inputs:
    x (T, H) bf16|f32; experts (T, k) int32 local ids (outside [0, E): no contribution);
    weights (T, k) f32; w_gate, w_up (E, H, I); w_down (E, I, H); shared None or
    (ws_gate (H, Is), ws_up (H, Is), ws_down (Is, H)); all weight tensors of x's dtype.
  Outputs:
    y (T, H) out_dtype (x's dtype, or f32 for a partial sum), and `Residuals` (gu, gu_shared
    and xs with zero rows when recompute).
  ranks: under expert parallelism, the ranks over which the routes of these tokens are spread
    (about T k / ranks of them to these experts): a hint for the CUDA kernel's launch choices,
    which leave every result as it is.
  """
  dims = _check_ffi_inputs(x, experts, weights, w_gate, w_up, w_down, shared)
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
    raise ValueError(f"moe_fwd: out_dtype must be x's dtype or float32, got {out_dtype}")
  results = fwd_results(dims, x.dtype, out_dtype, block_m, recompute)
  call = jax.ffi.ffi_call("mok_moe_fwd", results, vmap_method="sequential")
  y, *residuals = call(x, experts, weights, w_gate, w_up, w_down,
                       *_shared_or_empty(shared, dims.H, x.dtype), block_m=np.int64(block_m),
                       recompute=bool(recompute), ranks=_ranks(ranks))
  return y, Residuals(*residuals[:len(Residuals._fields)])


def _ranks(ranks) -> np.int64:
  """The `ranks` attribute of the targets, checked: an integer of at least 1."""
  if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or ranks < 1:
    raise ValueError(f"moe_fwd/moe_bwd: ranks must be an integer of at least 1, got {ranks!r}")
  return np.int64(ranks)


def moe_bwd(dy, x, experts, weights, w_gate, w_up, w_down, shared, residuals: Residuals, *,
            block_m, recompute=False, ranks=1) -> Grads:
  """Target mok_moe_bwd.

  Inputs:
    dy (T, H) of y's dtype; the forward's inputs; its `Residuals`, from a forward with the same
    block_m and recompute (an empty one, e.g. gu_shared without a shared expert, may be None).
  Outputs:
    `Grads`: x (T, H), weights (T, k) f32, w_gate, w_up (E, H, I), w_down (E, I, H) and the
    shared weights' gradients (None without a shared expert), all but weights in x's dtype.
  ranks: as for moe_fwd.
  """
  dims = _check_ffi_inputs(x, experts, weights, w_gate, w_up, w_down, shared)
  T, H = dims.T, dims.H
  if dy.shape != (T, H) or jnp.dtype(dy.dtype) not in (jnp.dtype(x.dtype), jnp.float32):
    raise ValueError(f"moe_bwd: dy must be ({T}, {H}) of {x.dtype} or float32, got "
                     f"{dy.shape} {dy.dtype}")
  want = fwd_results(dims, x.dtype, x.dtype, block_m, recompute)[1:1 + len(Residuals._fields)]
  for name, spec, got in zip(Residuals._fields, want, residuals):
    if got is None and 0 in spec.shape:
      continue
    if got is None or got.shape != spec.shape or got.dtype != spec.dtype:
      have = "None" if got is None else f"{got.shape} {got.dtype}"
      raise ValueError(f"moe_bwd: residual {name} must be {spec.shape} {spec.dtype}, got "
                       f"{have} (block_m={block_m}, recompute={recompute}: the forward's must "
                       "be the same)")
  residuals = [jnp.zeros(spec.shape, spec.dtype) if got is None else got
               for spec, got in zip(want, residuals)]
  results = bwd_results(dims, x.dtype, block_m, recompute)
  call = jax.ffi.ffi_call("mok_moe_bwd", results, vmap_method="sequential",
                          input_output_aliases=bwd_aliases(dims, recompute))
  dx, dweights, dw_gate, dw_up, dw_down, *dshared = call(
      dy, x, experts, weights, w_gate, w_up, w_down, *_shared_or_empty(shared, H, x.dtype),
      *residuals, block_m=np.int64(block_m), recompute=bool(recompute),
      ranks=_ranks(ranks))[:8]
  return Grads(dx, dweights, dw_gate, dw_up, dw_down, None if shared is None else tuple(dshared))


def moe_combine(rows, pos, weights=None, extra=None, *, out_dtype=None):
  """Target mok_moe_combine: out[t] = round(sum_j weights[t, j] rows[pos[t, j]] in j order +
  extra[t]), summed in f32 with the bits of mok_moe_fwd's y (and, without weights, of
  mok_moe_bwd's dx).

  Inputs:
    rows (N, H) bf16|f32; pos (T, k) int32 in [-1, N) (-1: no row); weights None (every weight
    1) or (T, k) f32; extra None or (T, H) of rows' dtype.
  Outputs:
    out (T, H) of out_dtype (rows' dtype, the default, or f32).
  """
  check_ffi_dtype(rows.dtype)
  if rows.ndim != 2 or pos.ndim != 2 or pos.dtype != jnp.int32:
    raise ValueError(f"moe_combine: rows must be (N, H) and pos (T, k) int32, got "
                     f"{_shape(rows)} and {_shape(pos)}")
  (T, k), H = pos.shape, rows.shape[1]
  if weights is not None and (weights.shape != (T, k) or weights.dtype != jnp.float32):
    raise ValueError(f"moe_combine: weights must be ({T}, {k}) float32, got {_shape(weights)}")
  if extra is not None and (extra.shape != (T, H) or extra.dtype != rows.dtype):
    raise ValueError(f"moe_combine: extra must be ({T}, {H}) {rows.dtype}, got {_shape(extra)}")
  out_dtype = jnp.dtype(rows.dtype if out_dtype is None else out_dtype)
  if out_dtype not in (jnp.dtype(rows.dtype), jnp.dtype(jnp.float32)):
    raise ValueError(f"moe_combine: out_dtype must be rows' dtype or float32, got {out_dtype}")
  weights = jnp.zeros((0, k), jnp.float32) if weights is None else weights
  extra = jnp.zeros((0, H), rows.dtype) if extra is None else extra
  call = jax.ffi.ffi_call("mok_moe_combine", jax.ShapeDtypeStruct((T, H), out_dtype),
                          vmap_method="sequential")
  return call(rows, pos, weights, extra)



def fp8_scale_pitch(rows: int) -> int:
  """Columns of an FP8 activation's scales (K / 128, pitch) for `rows` rows (a multiple of 4,
  so that each block's scales start 16-byte aligned: the kernels load them by TMA)."""
  return _mok_cpu.fp8_scale_pitch(rows)


def fwd_fp8_results(dims: MoeDims, out_dtype, block_m, keep_gu=False) -> tuple:
  """The results mok_moe_fwd_fp8 declares, in FWD_FP8_RESULTS order (gu with rows if
  keep_gu)."""
  T, H, I, E, k, Is = dims
  R = routed_rows(T * k, E, block_m)
  Ts = T if Is else 0  # rows of the shared expert's token buffers
  b = FP8_BLOCK
  sds, e4m3, f32 = jax.ShapeDtypeStruct, quantize.E4M3, jnp.float32
  return _in_order(FWD_FP8_RESULTS, dict(
      y=sds((T, H), out_dtype),
      pos=sds((T, k), jnp.int32),
      offsets=sds((E + 1,), jnp.int32),
      rows=sds((R,), jnp.int32),
      gu=sds((R if keep_gu else 0, 2 * I), jnp.bfloat16),
      gu_shared=sds((T if keep_gu else 0, 2 * Is), jnp.bfloat16),
      xq=sds((R, H), e4m3),
      xq_scale=sds((H // b, fp8_scale_pitch(R)), f32),
      hq=sds((R, I), e4m3),
      hq_scale=sds((I // b, fp8_scale_pitch(R)), f32),
      y_routed=sds((R, H), jnp.bfloat16),
      xq_shared=sds((Ts, H), e4m3),
      xq_shared_scale=sds((H // b, fp8_scale_pitch(Ts)), f32),
      hq_shared=sds((T, Is), e4m3),
      hq_shared_scale=sds((Is // b, fp8_scale_pitch(T)), f32),
      y_shared=sds((Ts, H), jnp.bfloat16),
      layout=sds((_mok_cpu.layout_scratch_ints(T, k, E),), jnp.int32),
  ))


class Fp8Weight(NamedTuple):
  """A weight (..., K, N) as the FP8 targets read it: its 128 x 128 quantization's e4m3 data
  as it is (mok_moe_bwd_fp8: the data gradients multiply by W^T, whose K-major form W is) and
  K-major (mok_moe_fwd_fp8: e4m3 wgmma reads both operands K-major), and its block scales as
  quantize.Blocks has them."""

  data: jax.Array  # (..., K, N) e4m3
  k_major: jax.Array  # (..., N, K) e4m3
  scale: jax.Array  # (..., K / 128, N / 128) f32


def fp8_weight(w) -> Fp8Weight:
  """A weight as the FP8 targets read it: from quantize_experts' QuantizedWeight (its K-major
  copy, none made here), from a weight's 128 x 128 quantize.Blocks (made K-major here: a copy
  of the e4m3 bytes), or from an array (quantized here by `quantize_weight`, the bits of
  quantize_experts, which writes the K-major copy in the same pass)."""
  if isinstance(w, quantize.QuantizedWeight):
    return Fp8Weight(w.blocks.data, w.k_major, w.blocks.scale)
  if isinstance(w, quantize.Blocks):
    return Fp8Weight(w.data, jnp.swapaxes(w.data, -1, -2), w.scale)
  blocks, k_major = quantize_weight(w)
  return Fp8Weight(blocks.data, k_major, blocks.scale)


def quantize_weight(w) -> tuple[quantize.Blocks, jax.Array]:
  """Target mok_quantize_weight: w (..., K, N) bf16 or f32 in 128 x 128 blocks by the "fp8"
  recipe, the bits of quantize.quantize, as its Blocks and their e4m3 data K-major (..., N, K),
  in one pass over w. The leading dimensions are a batch (experts, layers under vmap). On a
  platform without the target (a GPU build without the CUDA module) quantize.quantize and a
  transpose give the same arrays."""
  shape = _shape(w)
  if len(shape) < 2 or jnp.dtype(w.dtype) not in DTYPES:
    raise ValueError(f"quantize_weight: w must be (..., K, N) of {', '.join(map(str, DTYPES))}, "
                     f"got {w.dtype} {shape}")
  block = (FP8_BLOCK, FP8_BLOCK)
  results = (jax.ShapeDtypeStruct(shape, quantize.E4M3),
             jax.ShapeDtypeStruct((*shape[:-2], shape[-1], shape[-2]), quantize.E4M3),
             jax.ShapeDtypeStruct(quantize.scale_shape(shape, block), jnp.float32))

  def target(w):
    # Under shard_map a custom call's results vary over no axis; the weight's do (XLA's
    # quantizer, the other branch, keeps them).
    out = jax.ffi.ffi_call("mok_quantize_weight", results, vmap_method="broadcast_all")(w)
    return reference.vary(out, reference.varying_axes(w))

  def xla_quantizer(w):
    q = quantize.quantize(w, block, "fp8")
    return q.data, jnp.swapaxes(q.data, -1, -2), q.scale

  per_platform = {"cpu": target}
  if has_cuda_target("mok_quantize_weight"):
    per_platform["cuda"] = target
  data, k_major, scale = jax.lax.platform_dependent(w, default=xla_quantizer, **per_platform)
  return quantize.Blocks(data, scale), k_major


def _check_blocks(name, q, shape, target="moe_fwd_fp8"):
  """q is the 128 x 128 quantization (Fp8Weight) of a weight of `shape`: the K-major data for
  the forward's target, the data as it is for the backward's."""
  want = quantize.scale_shape(shape, (FP8_BLOCK, FP8_BLOCK))
  forward = target == "moe_fwd_fp8"
  data_shape = (*shape[:-2], shape[-1], shape[-2]) if forward else tuple(shape)
  data = (q.k_major if forward else q.data) if isinstance(q, Fp8Weight) else None
  if (data is None or _shape(data) != data_shape or jnp.dtype(data.dtype) != quantize.E4M3 or
      _shape(q.scale) != want or jnp.dtype(q.scale.dtype) != jnp.float32):
    got = (f"{data.dtype} {_shape(data)} and {q.scale.dtype} {_shape(q.scale)}"
           if data is not None else type(q).__name__)
    raise ValueError(f"{target}: {name} must be an Fp8Weight of e4m3 {data_shape} and f32 "
                     f"{want}, got {got}")


def _check_fp8_call(target, x, experts, weights, w_gate, w_up, w_down, shared) -> MoeDims:
  """The operands of an FP8 target (moe_fwd_fp8, moe_bwd_fp8) and the sizes of the call."""
  if np.ndim(x) != 2 or jnp.dtype(x.dtype) != CUDA_DTYPE:
    raise ValueError(f"{target}: x must be (T, H) {CUDA_DTYPE}, got {x.dtype} {_shape(x)}")
  T, H = _shape(x)
  if np.ndim(experts) != 2 or _shape(experts)[0] != T or experts.dtype != jnp.int32:
    raise ValueError(f"{target}: experts must be ({T}, k) int32, got {experts.dtype} "
                     f"{_shape(experts)}")
  k = _shape(experts)[1]
  if _shape(weights) != (T, k) or weights.dtype != jnp.float32:
    raise ValueError(f"{target}: weights must be ({T}, {k}) float32, got {weights.dtype} "
                     f"{_shape(weights)}")
  if not isinstance(w_gate, Fp8Weight) or np.ndim(w_gate.k_major) != 3:
    raise ValueError(f"{target}: w_gate must be the Fp8Weight of an (E, H, I) weight")
  E, I, _ = _shape(w_gate.k_major)
  _check_blocks("w_gate", w_gate, (E, H, I), target)
  _check_blocks("w_up", w_up, (E, H, I), target)
  _check_blocks("w_down", w_down, (E, I, H), target)
  Is = 0
  if shared is not None:
    ws_gate, ws_up, ws_down = shared
    if not isinstance(ws_gate, Fp8Weight) or np.ndim(ws_gate.k_major) != 2:
      raise ValueError(f"{target}: shared must be the Fp8Weights of (ws_gate (H, Is), "
                       "ws_up (H, Is), ws_down (Is, H))")
    Is = _shape(ws_gate.k_major)[0]
    _check_blocks("ws_gate", ws_gate, (H, Is), target)
    _check_blocks("ws_up", ws_up, (H, Is), target)
    _check_blocks("ws_down", ws_down, (Is, H), target)
  dims = MoeDims(T, H, I, E, k, Is)
  if problem := fp8_unsupported_reason(x.dtype, dims, Config(precision="fp8")):
    raise ValueError(f"{target}: {problem}")
  return dims


def _fp8_shared_or_empty(shared, H):
  """The shared expert's Fp8Weights, or those of (H, 0), (H, 0), (0, H) weights: Is = 0."""
  if shared is not None:
    return tuple(shared)
  e4m3, f32, b = quantize.E4M3, jnp.float32, FP8_BLOCK
  empty = Fp8Weight(jnp.zeros((H, 0), e4m3), jnp.zeros((0, H), e4m3),
                    jnp.zeros((H // b, 0), f32))
  return empty, empty, Fp8Weight(jnp.zeros((0, H), e4m3), jnp.zeros((H, 0), e4m3),
                                 jnp.zeros((0, H // b), f32))


def moe_fwd_fp8(x, experts, weights, w_gate, w_up, w_down, shared=None, *, out_dtype, block_m,
                ranks=1, keep_gu=False):
  """Target mok_moe_fwd_fp8: the layer forward with block-scaled e4m3 products.

  Inputs:
    x (T, H) bf16; experts (T, k) int32 local ids; weights (T, k) f32; w_gate, w_up, w_down
    the `Fp8Weight`s (`fp8_weight`) of the (E, H, I), (E, H, I), (E, I, H) expert weights;
    shared None or the Fp8Weights of (ws_gate (H, Is), ws_up (H, Is), ws_down (Is, H)). H, I
    and Is multiples of 128.
  Outputs:
    y (T, H) out_dtype (bf16, or f32 for a partial sum), and `Fp8Buffers` (gu and gu_shared
    with rows if keep_gu: what moe_bwd_fp8 takes).
  """
  dims = _check_fp8_call("moe_fwd_fp8", x, experts, weights, w_gate, w_up, w_down, shared)
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (CUDA_DTYPE, jnp.dtype(jnp.float32)):
    raise ValueError(f"moe_fwd_fp8: out_dtype must be bfloat16 or float32, got {out_dtype}")
  shared = _fp8_shared_or_empty(shared, dims.H)
  operands = [a for q in (w_gate, w_up, w_down, *shared) for a in (q.k_major, q.scale)]
  results = fwd_fp8_results(dims, out_dtype, block_m, keep_gu)
  call = jax.ffi.ffi_call("mok_moe_fwd_fp8", results, vmap_method="sequential")
  y, *buffers = call(x, experts, weights, *operands, block_m=np.int64(block_m),
                     ranks=_ranks(ranks))
  return y, Fp8Buffers(*buffers[:len(Fp8Buffers._fields)])


def bwd_fp8_results(dims: MoeDims, block_m) -> tuple:
  """The results mok_moe_bwd_fp8 declares, in BWD_FP8_RESULTS order: mok_moe_bwd's (bf16, no
  recompute), then the e4m3 rows of dy and dgu with their scales."""
  T, H, I, E, k, Is = dims
  R = routed_rows(T * k, E, block_m)
  Ts = T if Is else 0
  b = FP8_BLOCK
  sds, e4m3, f32 = jax.ShapeDtypeStruct, quantize.E4M3, jnp.float32
  fp8 = _in_order(BWD_FP8_RESULTS[len(BWD_RESULTS):], dict(
      dyq=sds((R, H), e4m3),
      dyq_scale=sds((H // b, fp8_scale_pitch(R)), f32),
      dyq_shared=sds((Ts, H), e4m3),
      dyq_shared_scale=sds((H // b, fp8_scale_pitch(Ts)), f32),
      dguq=sds((R, 2 * I), e4m3),
      dguq_scale=sds((2 * I // b, fp8_scale_pitch(R)), f32),
      dguq_shared=sds((T, 2 * Is), e4m3),
      dguq_shared_scale=sds((2 * Is // b, fp8_scale_pitch(T)), f32),
  ))
  return (*bwd_results(dims, CUDA_DTYPE, block_m), *fp8)


def moe_bwd_fp8(dy, x, experts, weights, w_gate, w_up, w_down, shared, residuals: Fp8Residuals,
                *, block_m, ranks=1) -> Grads:
  """Target mok_moe_bwd_fp8: the gradients of moe_fwd_fp8, the data gradients' products in
  block-scaled e4m3 (dy and [dg | du] in 1 x 128 blocks along their reduction, the weights'
  blocks as they are: Fp8Weight.data), the weight gradients bf16 GEMMs, as
  reference.quantized_dot specifies them.

  Inputs:
    dy (T, H) bf16; the forward's inputs (its Fp8Weights); `Fp8Residuals` of a forward with the
    same block_m and keep_gu.
  Outputs:
    `Grads`, all but weights (f32) in bf16: the weight gradients w.r.t. the weights the
    Fp8Weights quantize.
  """
  dims = _check_fp8_call("moe_bwd_fp8", x, experts, weights, w_gate, w_up, w_down, shared)
  T, H = dims.T, dims.H
  if _shape(dy) != (T, H) or jnp.dtype(dy.dtype) != CUDA_DTYPE:
    raise ValueError(f"moe_bwd_fp8: dy must be ({T}, {H}) {CUDA_DTYPE}, got {dy.dtype} "
                     f"{_shape(dy)}")
  kept = fwd_fp8_results(dims, CUDA_DTYPE, block_m, keep_gu=True)
  want = kept[1:1 + len(Fp8Residuals._fields)]
  residuals = Fp8Residuals(*residuals[:len(Fp8Residuals._fields)])
  for name, spec, got in zip(Fp8Residuals._fields, want, residuals):
    if _shape(got) != spec.shape or jnp.dtype(got.dtype) != spec.dtype:
      raise ValueError(f"moe_bwd_fp8: residual {name} must be {spec.shape} {spec.dtype}, got "
                       f"{_shape(got)} {got.dtype} (the forward's, with block_m={block_m} and "
                       "keep_gu)")
  shared_q = _fp8_shared_or_empty(shared, H)
  operands = [a for q in (w_gate, w_up, w_down, *shared_q) for a in (q.data, q.scale)]
  aliases = _aliases(dims, BWD_FP8_OPERANDS, BWD_FP8_RESULTS, BWD_FP8_ALIASES)
  call = jax.ffi.ffi_call("mok_moe_bwd_fp8", bwd_fp8_results(dims, block_m),
                          vmap_method="sequential", input_output_aliases=aliases)
  dx, dweights, dw_gate, dw_up, dw_down, *dshared = call(
      dy, x, experts, weights, *operands, *residuals, block_m=np.int64(block_m),
      ranks=_ranks(ranks))[:8]
  return Grads(dx, dweights, dw_gate, dw_up, dw_down, None if shared is None else tuple(dshared))
