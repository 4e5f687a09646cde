"""The FFI targets mok_moe_fwd / mok_moe_bwd called directly, with bad arguments: through
mok_jax.ops (ValueError at trace time) and through jax.ffi.ffi_call, past the Python checks,
with wrong shapes and corrupted layout residuals (an ffi::Error naming the argument, never a
crash or an out-of-bounds access). They run on the CPU, a GPU machine's included: the C++ CPU
targets take the f32 operands the cases use, which the CUDA ones refuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from cases import F32_RTOL, assert_close, make_case
from mok_jax import ops

T, H, I, E, K, IS, BLOCK_M = 4, 8, 6, 3, 2, 5, 4
R = ops.routed_rows(T * K, E, BLOCK_M)
f32, bf16, s32 = jnp.float32, jnp.bfloat16, jnp.int32


@pytest.fixture(autouse=True)
def _on_the_cpu():
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def sds(shape, dtype=f32):
  return jax.ShapeDtypeStruct(shape, dtype)


def small_case():
  experts = np.array([[0, 2], [2, -1], [1, 2], [0, 1]], np.int32)  # one invalid route
  return make_case(T=T, H=H, I=I, E=E, Is=IS, experts=experts, seed=4)


def fwd_operands(case=None):
  """The operands of mok_moe_fwd, in target order."""
  case = case or small_case()
  return dict(x=case.x, experts=jnp.asarray(case.experts), weights=case.weights,
              w_gate=case.w_gate, w_up=case.w_up, w_down=case.w_down, ws_gate=case.shared[0],
              ws_up=case.shared[1], ws_down=case.shared[2])


def ffi_signature(fn, *args):
  """(target, results, attributes) of the one FFI call fn(*args) makes, read from its jaxpr.

  The tests call the target directly with these, one argument broken at a time, so they follow
  whatever results (scratch included) mok_jax.ops declares."""
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "ffi_call"]
  results = [sds(a.shape, a.dtype) for a in eqn.params["result_avals"]]
  return eqn.params["target_name"], results, dict(eqn.params["attributes"])


def fwd_signature():
  def fwd(x, experts, weights, w_gate, w_up, w_down, *shared):
    return ops.moe_fwd(x, experts, weights, w_gate, w_up, w_down, shared, out_dtype=f32,
                       block_m=BLOCK_M)

  target, results, attributes = ffi_signature(fwd, *fwd_operands().values())
  assert target == "mok_moe_fwd" and attributes == {"block_m": BLOCK_M, "recompute": False,
                                                    "ranks": 1}
  return dict(zip(FWD_RESULT_NAMES, results)), results[len(FWD_RESULT_NAMES):]


# The results of mok_moe_fwd that the tests name: y and the residuals; scratch results follow.
FWD_RESULT_NAMES = ("y", "pos", "offsets", "rows", "gu", "gu_shared", "xs")


def call_fwd(operands, results=None, block_m=BLOCK_M, recompute=False, ranks=1):
  """mok_moe_fwd through jax.ffi.ffi_call, with `results` replacing the named results."""
  named, scratch = fwd_signature()
  named.update(results or {})
  call = jax.ffi.ffi_call("mok_moe_fwd", (*named.values(), *scratch))
  out = jax.jit(lambda *a: call(*a, block_m=np.int64(block_m), recompute=recompute,
                                ranks=np.int64(ranks)))(*operands.values())
  return jax.block_until_ready(out)


def test_direct_ffi_call_baseline():
  """The operands and results of the table below are right as they stand."""
  case = small_case()
  y, *_ = call_fwd(fwd_operands(case))
  assert_close(y, oracle.moe(*case.args(), case.shared), F32_RTOL, "y")


def test_direct_ranks_hint():
  """`ranks` is a hint for the launch choices: any count gives the same bits; none below 1."""
  case = small_case()
  y1, *_ = call_fwd(fwd_operands(case))
  y8, *_ = call_fwd(fwd_operands(case), ranks=8)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y8))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"mok_moe_fwd: ranks must be at least 1"):
    call_fwd(fwd_operands(case), ranks=0)


def zeros(shape, dtype=f32):
  return jnp.zeros(shape, dtype)


# (id, operand overrides, result overrides, block_m, message regex)
BAD_FWD_CALLS = [
    ("x_f16", dict(x=zeros((T, H), jnp.float16)), {}, BLOCK_M,
     r"mok_moe_fwd: x must be bf16 or f32 \(T, H\), got f16\[4, 8\]"),
    ("x_rank3", dict(x=zeros((1, T, H))), {}, BLOCK_M, r"x must be bf16 or f32 \(T, H\)"),
    ("experts_f32", dict(experts=zeros((T, K))), {}, BLOCK_M,
     r"experts must be s32\[4, 2\], got f32\[4, 2\]"),
    ("experts_T", dict(experts=zeros((T + 1, K), s32)), {}, BLOCK_M,
     r"experts must be \(T, k\) with T = 4 and k >= 1, got s32\[5, 2\]"),
    ("weights_shape", dict(weights=zeros((T, K + 1))), {}, BLOCK_M,
     r"weights must be f32\[4, 2\], got f32\[4, 3\]"),
    ("weights_bf16", dict(weights=zeros((T, K), bf16)), {}, BLOCK_M,
     r"weights must be f32\[4, 2\], got bf16\[4, 2\]"),
    ("w_gate_H", dict(w_gate=zeros((E, H + 1, I))), {}, BLOCK_M,
     r"w_gate must be \(E, H, I\) with H = 8, got f32\[3, 9, 6\]"),
    ("w_up_shape", dict(w_up=zeros((E, H, I + 1))), {}, BLOCK_M,
     r"w_up must be f32\[3, 8, 6\], got f32\[3, 8, 7\]"),
    ("w_down_bf16", dict(w_down=zeros((E, I, H), bf16)), {}, BLOCK_M,
     r"w_down must be f32\[3, 6, 8\], got bf16\[3, 6, 8\]"),
    ("ws_gate_H", dict(ws_gate=zeros((H + 1, IS))), {}, BLOCK_M,
     r"ws_gate must be \(H, Is\) with H = 8"),
    ("ws_down_shape", dict(ws_down=zeros((IS, H + 1))), {}, BLOCK_M,
     r"ws_down must be f32\[5, 8\], got f32\[5, 9\]"),
    ("block_m_3", {}, {}, 3, r"block_m must be a power of two in \[1, 256\], got 3"),
    ("block_m_0", {}, {}, 0, r"block_m must be a power of two in \[1, 256\], got 0"),
    ("block_m_512", {}, {}, 512, r"block_m must be a power of two in \[1, 256\], got 512"),
    ("y_shape", {}, dict(y=sds((T, H + 1))), BLOCK_M, r"y must be f32\[4, 8\], got f32\[4, 9\]"),
    ("y_f16", {}, dict(y=sds((T, H), jnp.float16)), BLOCK_M,
     r"y must be of x's dtype or f32, got f16\[4, 8\]"),
    ("pos_shape", {}, dict(pos=sds((T, K + 1), s32)), BLOCK_M, r"pos must be s32\[4, 2\]"),
    ("offsets_shape", {}, dict(offsets=sds((E,), s32)), BLOCK_M, r"offsets must be s32\[4\]"),
    # Too few routed rows for the worst case: the call fails instead of dropping routes.
    ("rows_short", {}, dict(rows=sds((R - 1,), s32)), BLOCK_M, rf"rows must be s32\[{R}\]"),
    ("gu_short", {}, dict(gu=sds((R - 1, 2 * I))), BLOCK_M, rf"gu must be f32\[{R}, 12\]"),
    ("gu_shared_shape", {}, dict(gu_shared=sds((T, IS))), BLOCK_M, r"gu_shared must be f32\[4, 10\]"),
    ("xs_short", {}, dict(xs=sds((R - 1, H))), BLOCK_M,
     rf"xs must be f32\[{R}, 8\], got f32\[{R - 1}, 8\] \(recompute = false\)"),
]


@pytest.mark.parametrize("operands, results, block_m, match", [c[1:] for c in BAD_FWD_CALLS],
                         ids=[c[0] for c in BAD_FWD_CALLS])
def test_bad_direct_fwd_call(operands, results, block_m, match):
  args = fwd_operands()
  args.update(operands)
  with pytest.raises(jax.errors.JaxRuntimeError, match=match):
    call_fwd(args, results, block_m)


def test_bad_direct_fwd_scratch():
  """Every scratch result that the forward declares is checked too (one row short here)."""
  named, scratch = fwd_signature()
  for i in range(len(scratch)):
    wrong = sds((scratch[i].shape[0] + 1, *scratch[i].shape[1:]), scratch[i].dtype)
    call = jax.ffi.ffi_call("mok_moe_fwd",
                            (*named.values(), *scratch[:i], wrong, *scratch[i + 1:]))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"mok_moe_fwd: \w+ must be"):
      jax.block_until_ready(jax.jit(lambda *a: call(*a, block_m=np.int64(BLOCK_M),
                                                    recompute=False, ranks=np.int64(1)))(
          *fwd_operands().values()))


def test_direct_fwd_call_of_the_other_mode():
  """Results declared for Config.recompute=False, called with recompute=True: gu is a residual
  there, so the handler names it and the mode."""
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=rf"mok_moe_fwd: gu must be f32\[0, 12\], got f32\[{R}, 12\] "
                           r"\(recompute = true\)"):
    call_fwd(fwd_operands(), recompute=True)


def forward_residuals(case):
  operands = fwd_operands(case)
  args = [operands[k] for k in ("x", "experts", "weights", "w_gate", "w_up", "w_down")]
  return jax.jit(lambda *a: ops.moe_fwd(*a, case.shared, out_dtype=f32, block_m=BLOCK_M))(*args)


def bwd(case, residuals, dy=None):
  args = (case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down)
  dy = case.dy if dy is None else dy
  out = jax.jit(lambda dy, *a, res: ops.moe_bwd(dy, *a, case.shared, res, block_m=BLOCK_M))(
      dy, *args, res=residuals)
  return jax.block_until_ready(out)


def corrupt(res, name, index, value):
  return res._replace(**{name: getattr(res, name).at[index].set(value)})


# (id, residual, index, value, what the message blames). small_case's routes: experts
# [[0, 2], [2, -1], [1, 2], [0, 1]], so route 3 (t=1, j=1) is invalid.
BAD_RESIDUALS = [
    ("pos_past_end", "pos", (0, 0), R, "pos"),
    ("pos_int32_max", "pos", (2, 1), 2**31 - 1, "pos"),
    ("pos_below_minus_1", "pos", (1, 1), -2, "pos"),
    ("offsets_first", "offsets", 0, 1, "offsets"),
    ("offsets_past_end", "offsets", E, R + 1, "offsets"),
    ("offsets_decreasing", "offsets", 2, -4, "offsets"),
    ("rows_past_end", "rows", 0, T * K, "rows"),
    ("rows_below_minus_1", "rows", 1, -7, "rows"),
    ("rows_invalid_route", "rows", 0, 3, "rows"),
]


@pytest.mark.parametrize("name, index, value, blamed", [c[1:] for c in BAD_RESIDUALS],
                         ids=[c[0] for c in BAD_RESIDUALS])
def test_corrupted_layout_residuals(name, index, value, blamed):
  case = small_case()
  _, res = forward_residuals(case)
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=rf"mok_moe_bwd: residual {blamed} is not the forward's layout"):
    bwd(case, corrupt(res, name, index, value))


def test_backward_checks_shapes():
  case = small_case()
  _, res = forward_residuals(case)
  with pytest.raises(ValueError, match=r"moe_bwd: dy must be \(4, 8\) of float32"):
    bwd(case, res, dy=jnp.zeros((T, H + 1)))
  with pytest.raises(ValueError, match=r"moe_bwd: residual pos must be \(4, 2\) int32"):
    bwd(case, res._replace(pos=jnp.zeros((T, K + 1), s32)))
  with pytest.raises(ValueError, match=rf"moe_bwd: residual gu must be \({R}, 12\) float32"):
    bwd(case, res._replace(gu=res.gu.astype(bf16)))
  with pytest.raises(ValueError, match=rf"moe_bwd: residual gu must be \({R}, 12\) float32, "
                                       r"got None"):
    bwd(case, res._replace(gu=None))


def test_backward_takes_none_for_an_empty_residual():
  """Without a shared expert gu_shared is empty: None in its place gives the same gradients."""
  case = small_case()._replace(shared=None)
  args = (case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down)
  _, res = jax.jit(lambda *a: ops.moe_fwd(*a, None, out_dtype=f32, block_m=BLOCK_M))(*args)
  assert res.gu_shared.size == 0
  want, got = bwd(case, res), bwd(case, res._replace(gu_shared=None))
  for name, a, b in zip(want._fields, want, got):
    if a is not None:
      assert np.array_equal(np.asarray(a), np.asarray(b)), name


def test_bad_direct_bwd_call():
  """Past the Python checks: the C++ handler names the bad operand or result."""
  case = small_case()
  _, res = forward_residuals(case)
  operands = [case.dy, *fwd_operands(case).values(), *res]

  def bwd_(dy, x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *res):
    return ops.moe_bwd(dy, x, experts, weights, w_gate, w_up, w_down, (ws_gate, ws_up, ws_down),
                       ops.Residuals(*res), block_m=BLOCK_M)

  target, results, _ = ffi_signature(bwd_, *operands)
  assert target == "mok_moe_bwd"

  def call(operands, results, block_m=BLOCK_M, recompute=False, ranks=1):
    f = jax.ffi.ffi_call("mok_moe_bwd", results)
    return jax.block_until_ready(
        jax.jit(lambda *a: f(*a, block_m=np.int64(block_m), recompute=recompute,
                             ranks=np.int64(ranks)))(*operands))

  grads = call(operands, results)  # the baseline is valid
  want = oracle.moe_grads(case.dy, *case.args(), case.shared)
  assert_close(grads[0], want.x, F32_RTOL, "dx")
  assert_close(grads[4], want.w_down, F32_RTOL, "dw_down")
  bad_dy = [operands[0].astype(jnp.float16), *operands[1:]]
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"dy must be of x's dtype or f32"):
    call(bad_dy, results)
  # dx, dweights, then every scratch result after the 8 gradients.
  for i, name in [(0, "dx"), (1, "dweights"), *((i, r"\w+") for i in range(8, len(results)))]:
    wrong = sds((results[i].shape[0] + 1, *results[i].shape[1:]), results[i].dtype)
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"mok_moe_bwd: {name} must be"):
      call(operands, [*results[:i], wrong, *results[i + 1:]])
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"mok_moe_bwd: dweights must be f32"):
    call(operands, [results[0], sds((T, K), bf16), *results[2:]])
  # Residuals of another block_m: their row count does not match.
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"mok_moe_bwd: rows must be s32"):
    call(operands, results, block_m=8)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"mok_moe_bwd: ranks must be at least 1"):
    call(operands, results, ranks=0)
  # Residuals of a forward that saved gu, for a backward told to recompute it.
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=rf"mok_moe_bwd: gu must be f32\[0, 12\], got f32\[{R}, 12\] "
                           r"\(recompute = true\)"):
    call(operands, results, recompute=True)


BAD_OPS_ARGS = [
    ("experts_f32", dict(experts=jnp.zeros((T, K))), r"moe_fwd/moe_bwd: experts must be int32"),
    ("weights_bf16", dict(weights=jnp.zeros((T, K), bf16)),
     r"moe_fwd/moe_bwd: weights must be float32"),
    ("x_f16", dict(x=jnp.zeros((T, H), jnp.float16)), r"moe: x has dtype float16"),
    ("out_dtype", dict(out_dtype=bf16), r"moe_fwd: out_dtype must be x's dtype or float32"),
    ("ranks_0", dict(ranks=0), r"moe_fwd/moe_bwd: ranks must be an integer of at least 1"),
    ("ranks_float", dict(ranks=2.0), r"moe_fwd/moe_bwd: ranks must be an integer of at least 1"),
]


@pytest.mark.parametrize("overrides, match", [c[1:] for c in BAD_OPS_ARGS],
                         ids=[c[0] for c in BAD_OPS_ARGS])
def test_bad_ops_moe_fwd_args(overrides, match):
  case = small_case()
  kwargs = dict(x=case.x, experts=jnp.asarray(case.experts), weights=case.weights,
                w_gate=case.w_gate, w_up=case.w_up, w_down=case.w_down, shared=case.shared,
                out_dtype=f32, block_m=BLOCK_M)
  kwargs.update(overrides)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: ops.moe_fwd(**kwargs))


def test_valid_calls_after_errors():
  """The errors above left the process and the targets intact."""
  case = small_case()
  y, *_ = call_fwd(fwd_operands(case))
  assert_close(y, oracle.moe(*case.args(), case.shared), F32_RTOL, "y")
  _, res = forward_residuals(case)
  grads = bwd(case, res)
  want = oracle.moe_grads(case.dy, *case.args(), case.shared)
  assert_close(grads.w_down, want.w_down, F32_RTOL, "dw_down")
