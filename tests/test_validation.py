"""Invalid arguments of mok_jax.moe, mok_jax.route and mok_jax.Config: a ValueError at trace time
whose message names the argument (and the shapes)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from mok_jax import ops

T, H, I, E, K, IS = 4, 8, 6, 3, 2, 5
f32, bf16 = jnp.float32, jnp.bfloat16


def sds(shape, dtype=f32):
  return jax.ShapeDtypeStruct(shape, dtype)


def valid_args():
  """Abstract arguments of a valid call: validation happens while tracing, before any data."""
  return dict(x=sds((T, H)), experts=sds((T, K), jnp.int32), weights=sds((T, K)),
              w_gate=sds((E, H, I)), w_up=sds((E, H, I)), w_down=sds((E, I, H)),
              shared=(sds((H, IS)), sds((H, IS)), sds((IS, H))))


def all_bf16(**overrides):
  args = valid_args()
  args.update(x=sds((T, H), bf16), w_gate=sds((E, H, I), bf16), w_up=sds((E, H, I), bf16),
              w_down=sds((E, I, H), bf16), shared=(sds((H, IS), bf16), sds((H, IS), bf16),
                                                   sds((IS, H), bf16)))
  args.update(overrides)
  return args


def trace_moe(args, **kwargs):
  """Traces mok_jax.moe(**args, **kwargs) with every array abstract (shared ones included)."""
  return jax.eval_shape(lambda a: mok_jax.moe(**a, **kwargs), args)


# (id, overrides of valid_args(), regex the message must match)
BAD_MOE_ARGS = [
    ("x_rank1", dict(x=sds((H,))), r"x must be \(T, H\), got shape \(8,\)"),
    ("x_rank3", dict(x=sds((1, T, H))), r"x must be \(T, H\), got shape \(1, 4, 8\)"),
    ("x_float16", dict(x=sds((T, H), jnp.float16)), r"x has dtype float16; supported"),
    ("x_int", dict(x=sds((T, H), jnp.int32)), r"x has dtype int32"),
    ("experts_rank1", dict(experts=sds((T,), jnp.int32)), r"experts must be \(T, k\).*\(4,\)"),
    ("experts_T", dict(experts=sds((T + 1, K), jnp.int32)),
     r"experts must be \(T, k\) with T = 4 .*\(5, 2\)"),
    ("experts_k0", dict(experts=sds((T, 0), jnp.int32)), r"experts must be .*k >= 1"),
    ("experts_float", dict(experts=sds((T, K))), r"experts must be an integer array, got float32"),
    ("top_k_gt_E", dict(experts=sds((T, E + 1), jnp.int32), weights=sds((T, E + 1))),
     r"top_k = experts.shape\[1\] = 4 exceeds the number of experts E = 3"),
    ("weights_shape", dict(weights=sds((T, K + 1))),
     r"weights must have the shape of experts \(4, 2\), got \(4, 3\)"),
    ("weights_int", dict(weights=sds((T, K), jnp.int32)), r"weights must be a float array"),
    ("w_gate_rank2", dict(w_gate=sds((H, I))), r"w_gate must be \(E, H, I\).*\(8, 6\)"),
    ("w_gate_H", dict(w_gate=sds((E, H + 1, I))), r"w_gate must be \(E, H, I\) with H = 8"),
    ("w_up_E", dict(w_up=sds((E + 1, H, I))), r"w_up must be \(E, H, I\) = \(3, 8, 6\)"),
    ("w_up_I", dict(w_up=sds((E, H, I + 1))), r"w_up must be \(E, H, I\) = \(3, 8, 6\)"),
    ("w_down_transposed", dict(w_down=sds((E, H, I))), r"w_down must be \(E, I, H\) = \(3, 6, 8\)"),
    ("w_down_E", dict(w_down=sds((E - 1, I, H))), r"w_down must be \(E, I, H\)"),
    ("w_gate_bf16", dict(w_gate=sds((E, H, I), bf16)),
     r"w_gate has dtype bfloat16, x has float32"),
    ("w_down_f32_x_bf16", all_bf16(w_down=sds((E, I, H))),
     r"w_down has dtype float32, x has bfloat16"),
    ("w_up_int", dict(w_up=sds((E, H, I), jnp.int32)), r"w_up has dtype int32"),
    ("shared_pair", dict(shared=(sds((H, IS)), sds((H, IS)))),
     r"shared must be None or \(ws_gate, ws_up, ws_down\)"),
    ("shared_dict", dict(shared={"ws_gate": sds((H, IS))}), r"shared must be None or"),
    ("ws_gate_H", dict(shared=(sds((H + 1, IS)), sds((H, IS)), sds((IS, H)))),
     r"ws_gate must be \(H, Is\) with H = 8"),
    ("ws_up_Is", dict(shared=(sds((H, IS)), sds((H, IS + 1)), sds((IS, H)))),
     r"ws_up must be \(H, Is\) = \(8, 5\)"),
    ("ws_down_transposed", dict(shared=(sds((H, IS)), sds((H, IS)), sds((H, IS)))),
     r"ws_down must be \(Is, H\) = \(5, 8\)"),
    ("ws_gate_bf16", dict(shared=(sds((H, IS), bf16), sds((H, IS)), sds((IS, H)))),
     r"ws_gate has dtype bfloat16, x has float32"),
]


@pytest.mark.parametrize("backend", ["xla", "ffi", "auto"])
@pytest.mark.parametrize("overrides, match", [c[1:] for c in BAD_MOE_ARGS],
                         ids=[c[0] for c in BAD_MOE_ARGS])
def test_bad_moe_args(overrides, match, backend):
  args = valid_args()
  args.update(overrides)
  with pytest.raises(ValueError, match=match):
    trace_moe(args, backend=backend)


@pytest.mark.parametrize("backend", ["xla", "ffi", "auto"])
def test_valid_args_trace(backend):
  """The table's baseline is valid: each row fails for its own reason."""
  for args in (valid_args(), all_bf16()):
    out = trace_moe(args, backend=backend)
    assert out.shape == (T, H) and out.dtype == args["x"].dtype


BAD_MOE_OPTIONS = [
    ("backend_name", dict(backend="triton"), r"backend must be one of .*got 'triton'"),
    ("backend_cuda_on_cpu", dict(backend="cuda"),
     r"backend='cuda' cannot run: JAX's default backend is 'cpu', not a CUDA GPU"),
    ("config_type", dict(config={"block_m": 128}), r"config must be a mok_jax.Config, got dict"),
]


@pytest.mark.parametrize("kwargs, match", [c[1:] for c in BAD_MOE_OPTIONS],
                         ids=[c[0] for c in BAD_MOE_OPTIONS])
def test_bad_moe_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    trace_moe(valid_args(), **kwargs)


@pytest.mark.parametrize("block_m", [0, 3, 12, 512, -4, True, 2.0, "128", None])
def test_bad_config_block_m(block_m):
  with pytest.raises(ValueError, match=r"Config.block_m must be a power of two in \[1, 256\]"):
    mok_jax.Config(block_m=block_m)


def gpu(kind, capability):
  """A stand-in for a JAX GPU device: what ops.cuda_device_problem reads of one."""
  return types.SimpleNamespace(device_kind=kind, compute_capability=capability)


def test_cuda_kernel_only_on_hopper():
  h200, b200, a100 = gpu("NVIDIA H200", "9.0"), gpu("NVIDIA B200", "10.0"), gpu("A100", "8.0")
  assert ops.cuda_device_problem([h200, gpu("NVIDIA H100 80GB HBM3", "9.0")]) is None
  assert ops.cuda_device_problem([b200]) == (
      "the CUDA kernel runs on Hopper GPUs (compute capability 9.0), not on NVIDIA B200 "
      "(compute capability 10.0)")
  assert "not on A100 (compute capability 8.0)" in ops.cuda_device_problem([h200, a100])
  rocm = types.SimpleNamespace(device_kind="AMD Instinct MI300X")  # no compute_capability
  assert ops.cuda_device_problem([rocm]).endswith("not on AMD Instinct MI300X")


def test_config_is_frozen_and_hashable():
  config = mok_jax.Config(block_m=4)
  assert hash(config) == hash(mok_jax.Config(block_m=4))
  with pytest.raises(AttributeError):
    config.block_m = 8  # type: ignore[misc]


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_top_k_gt_E_under_expert_parallelism(backend):
  """E is the global count, ranks x local experts: 2 ranks x 1 expert cannot take top_k = 3."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))

  def f(x, experts, weights, w_gate, w_up, w_down):
    return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, axis_name="ep",
                       backend=backend)

  g = jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
  args = (sds((4, H)), sds((4, 3), jnp.int32), sds((4, 3)), sds((2, H, I)), sds((2, H, I)),
          sds((2, I, H)))
  with pytest.raises(ValueError, match=r"top_k .* = 3 exceeds .* E = 2 \(2 rank\(s\) x 1 local\)"):
    jax.eval_shape(g, *args)


BAD_ROUTE_ARGS = [
    ("logits_int", dict(logits=jnp.zeros((4, 8), jnp.int32)), r"logits must be a float array"),
    ("logits_scalar", dict(logits=jnp.float32(1.0)), r"logits must be a float array"),
    ("top_k_0", dict(top_k=0), r"top_k must be an int in \[1, E=8\], got 0"),
    ("top_k_gt_E", dict(top_k=9), r"top_k must be an int in \[1, E=8\], got 9"),
    ("top_k_float", dict(top_k=2.0), r"top_k must be an int"),
    ("score", dict(score="relu"), r"score must be one of \('softmax', 'sigmoid'\), got 'relu'"),
    ("bias_shape", dict(bias=jnp.zeros(9)), r"bias must have shape \(E,\) = \(8,\), got \(9,\)"),
    ("groups_alone", dict(n_groups=4), r"n_groups and topk_groups go together"),
    ("topk_groups_alone", dict(topk_groups=2), r"n_groups and topk_groups go together"),
    ("n_groups_not_dividing", dict(n_groups=3, topk_groups=1),
     r"n_groups must be a positive int dividing E=8, got 3"),
    ("n_groups_0", dict(n_groups=0, topk_groups=1), r"n_groups must be a positive int"),
    ("topk_groups_gt_n_groups", dict(n_groups=4, topk_groups=5),
     r"topk_groups must be an int in \[1, n_groups=4\], got 5"),
    ("top_k_gt_group_experts", dict(top_k=5, n_groups=4, topk_groups=2),
     r"top_k=5 exceeds the 4 experts of topk_groups=2 groups of 2"),
]


@pytest.mark.parametrize("overrides, match", [c[1:] for c in BAD_ROUTE_ARGS],
                         ids=[c[0] for c in BAD_ROUTE_ARGS])
def test_bad_route_args(overrides, match):
  kwargs = dict(logits=jnp.zeros((4, 8)), top_k=2)
  kwargs.update(overrides)
  logits, top_k = kwargs.pop("logits"), kwargs.pop("top_k")
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(functools.partial(mok_jax.route, top_k=top_k, **kwargs), logits)
