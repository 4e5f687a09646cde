"""The checks that the CPU and CUDA handlers of a target share (ffi/moe_args.cc: CheckFwdCall,
CheckBwdCall, CheckFp8Call) and what the CUDA kernels add to them.

mok_jax.ops checks what both platforms take and leaves the kernels' limits to mok_jax.moe, so
block_m = 32 and f32 tokens reach the handlers: the CPU targets run them, the CUDA targets
refuse them by name. Past ops (jax.ffi.ffi_call), a bad result gets the same message on both
platforms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import ops, quantize
from test_ffi_errors import ffi_signature

T, H, I, E, K, IS = 4, 128, 128, 2, 2, 128  # H, I, Is: whole FP8 blocks
FP8_BLOCK = (128, 128)
PLATFORMS = [pytest.param("cpu"), pytest.param("gpu", marks=pytest.mark.gpu)]
WEIGHT_GRADS = ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")
bf16, f32 = jnp.bfloat16, jnp.float32


def inputs(platform, dtype=bf16):
  """(x, experts, weights, w_gate, w_up, w_down, shared) on the platform's first device."""
  rng = np.random.default_rng(0)

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape) / 8, dtype)

  args = (normal(T, H), jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32),
          jnp.asarray(rng.uniform(0, 1, (T, K)), f32), normal(E, H, I), normal(E, H, I),
          normal(E, I, H), (normal(H, IS), normal(H, IS), normal(IS, H)))
  return jax.device_put(args, jax.devices(platform)[0])


def fwd(args, block_m):
  return jax.block_until_ready(
      jax.jit(lambda *a: ops.moe_fwd(*a, out_dtype=a[0].dtype, block_m=block_m))(*args))


def bwd(args, residuals, block_m):
  """The gradients of sum(y) (dy = 1) from the forward's residuals of the same block_m."""
  return jax.block_until_ready(jax.jit(
      lambda res, *a: ops.moe_bwd(jnp.ones_like(a[0]), *a, res, block_m=block_m))(
          residuals, *args))


def fwd_fp8(args, block_m):
  def f(x, experts, weights, ws, shared):
    return ops.moe_fwd_fp8(x, experts, weights, *map(ops.fp8_weight, ws),
                           tuple(map(ops.fp8_weight, shared)),
                           out_dtype=bf16, block_m=block_m)

  x, experts, weights, *ws, shared = args
  return jax.block_until_ready(jax.jit(f)(x, experts, weights, ws, shared))


def bwd_fp8(args, buffers, block_m):
  """The FP8 gradients of sum(y) from an FP8 forward's buffers (gu kept) of the same block_m."""
  def f(buffers, x, experts, weights, ws, shared):
    return ops.moe_bwd_fp8(jnp.ones_like(x), x, experts, weights, *map(ops.fp8_weight, ws),
                           tuple(map(ops.fp8_weight, shared)), buffers, block_m=block_m)

  x, experts, weights, *ws, shared = args
  return jax.block_until_ready(jax.jit(f)(buffers, x, experts, weights, ws, shared))


def fp8_buffers(args, block_m):
  """The FP8 forward's buffers with gu kept."""
  def f(x, experts, weights, ws, shared):
    return ops.moe_fwd_fp8(x, experts, weights, *map(ops.fp8_weight, ws),
                           tuple(map(ops.fp8_weight, shared)), out_dtype=bf16,
                           block_m=block_m, keep_gu=True)[1]

  x, experts, weights, *ws, shared = args
  return jax.jit(f)(x, experts, weights, ws, shared)


def cpu_residuals(block_m, platform):
  """The CPU forward's residuals for block_m, moved to the platform's device."""
  return jax.device_put(fwd(inputs("cpu"), block_m)[1], jax.devices(platform)[0])


def test_cpu_targets_take_block_m_32():
  """The CPU reference takes every power of two up to 256: y and every gradient have the bits
  of block_m = 64 (the routed rows move, the sums over them keep their order)."""
  args = inputs("cpu")
  y32, res32 = fwd(args, 32)
  y64, res64 = fwd(args, 64)
  assert res32.rows.shape != res64.rows.shape
  np.testing.assert_array_equal(np.asarray(y32, np.float32), np.asarray(y64, np.float32))
  for a, b in zip(jax.tree.leaves(bwd(args, res32, 32)), jax.tree.leaves(bwd(args, res64, 64))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(fwd_fp8(args, 32)[0], np.float32),
                                np.asarray(fwd_fp8(args, 64)[0], np.float32))
  for a, b in zip(jax.tree.leaves(bwd_fp8(args, fp8_buffers(args, 32), 32)),
                  jax.tree.leaves(bwd_fp8(args, fp8_buffers(args, 64), 64))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
def test_cuda_targets_refuse_block_m_32():
  args = inputs("gpu")
  calls = {"mok_moe_fwd": lambda: fwd(args, 32),
           "mok_moe_bwd": lambda: bwd(args, cpu_residuals(32, "gpu"), 32),
           "mok_moe_fwd_fp8": lambda: fwd_fp8(args, 32),
           "mok_moe_bwd_fp8": lambda: bwd_fp8(args, jax.device_put(
               fp8_buffers(inputs("cpu"), 32), jax.devices("gpu")[0]), 32)}
  for target, call in calls.items():
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"{target}: the CUDA kernel needs block_m = 64 or 128, got 32"):
      call()


@pytest.mark.gpu
def test_cuda_targets_refuse_f32_tokens():
  args = inputs("gpu", f32)
  residuals = jax.device_put(fwd(inputs("cpu", f32), 64)[1], jax.devices("gpu")[0])
  for target, call in {"mok_moe_fwd": lambda: fwd(args, 64),
                       "mok_moe_bwd": lambda: bwd(args, residuals, 64)}.items():
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"{target}: the CUDA kernel takes bf16 tokens, got f32\[4, 128\]"):
      call()


def call_with_result(fn, operands, index, shape):
  """The one FFI call of fn(*operands), made directly with result `index` of `shape` instead."""
  target, results, attributes = ffi_signature(fn, *operands)
  results[index] = jax.ShapeDtypeStruct(shape, results[index].dtype)
  call = jax.ffi.ffi_call(target, results)
  return jax.block_until_ready(
      jax.jit(lambda *a: call(*a, **attributes))(*jax.tree.leaves(operands)))


def bf16_of(shape):
  return rf"bf16\[{', '.join(map(str, shape))}\]"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_bad_results_have_one_message(platform):
  """y one column wide, and each weight gradient one expert or row long, as the CPU target and
  the CUDA target name them: in the same words."""
  args = inputs(platform)
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=rf"mok_moe_fwd: y must be {bf16_of((T, H))}, got {bf16_of((T, H + 1))}"):
    call_with_result(lambda *a: ops.moe_fwd(*a, out_dtype=bf16, block_m=64), args, 0,
                     (T, H + 1))
  residuals = cpu_residuals(64, platform)
  dy = jax.device_put(jnp.ones((T, H), bf16), jax.devices(platform)[0])
  shapes = [(E, H, I), (E, H, I), (E, I, H), (H, IS), (H, IS), (IS, H)]
  for index, (name, shape) in enumerate(zip(WEIGHT_GRADS, shapes), start=2):
    wrong = (shape[0] + 1, *shape[1:])
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"mok_moe_bwd: {name} must be {bf16_of(shape)}, got "
                             rf"{bf16_of(wrong)}"):
      call_with_result(lambda *a: ops.moe_bwd(*a, block_m=64), (dy, *args, residuals), index,
                       wrong)
