"""mok_jax.nn.flax.MoE against a dense reference: outputs, gradients, auxiliary losses (against
NumPy), the selection bias, expert parallelism on 8 CPU devices, and a checkpoint round trip."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import mok_jax
from mok_jax.nn.flax import MoE, MoEBias

from cases import assert_close
from layer_reference import (BF16_RTOL, CASES, F32_RTOL, GRAD_RTOL, aux_numpy, dense_moe,
                             dense_ref, layer_options, ref_kwargs, tokens)


def params_of(moe):
  return {name: getattr(moe, name)[...] for name in moe.options.param_shapes()}


def make(case="softmax", seed=0, **kw):
  return MoE(**layer_options(case, **kw), rngs=nnx.Rngs(seed))


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_forward_gradients_and_aux(case):
  moe = make(case)
  x, ct = tokens(), tokens(seed=2)

  def loss_of(y, lb, z):
    return jnp.sum(y.reshape(ct.shape) * ct) + 0.3 * lb + 0.1 * z

  @nnx.jit
  def run(m, x):
    def loss(m, x):
      y, aux = m(x)
      return loss_of(y, aux.load_balancing_loss, aux.router_z_loss), (y, aux)
    return nnx.grad(loss, argnums=(0, 1), has_aux=True)(m, x)

  (grads, dx), (y, aux) = run(moe, x)
  want_y, want_lb, want_z, want_counts = dense_ref(moe, params_of(moe), x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert_close(y.reshape(-1, 16), want_y, F32_RTOL, "y")
  np.testing.assert_array_equal(aux.counts, want_counts)
  assert aux.counts.dtype == jnp.int32 and int(aux.counts.sum()) == 15 * moe.options.top_k

  # Aux losses against the NumPy formulas, from the layer's own routing.
  o = moe.options
  logits = x.reshape(-1, 16) @ moe.router[...]
  experts, _ = mok_jax.route(logits, o.top_k, score=o.score, renormalize=o.renormalize,
                             n_groups=o.n_groups, topk_groups=o.topk_groups)
  lb, z, counts = aux_numpy(logits, np.asarray(experts), 8, o.score)
  np.testing.assert_array_equal(aux.counts, counts)
  assert_close(aux.load_balancing_loss, lb, F32_RTOL, "load_balancing_loss")
  assert_close(aux.router_z_loss, z, F32_RTOL, "router_z_loss")
  assert_close(want_lb, lb, F32_RTOL, "reference load_balancing_loss")
  assert_close(want_z, z, F32_RTOL, "reference router_z_loss")

  def ref_loss(p, x):
    y, lb, z, _ = dense_moe(x, p, **ref_kwargs(moe))
    return loss_of(y, lb, z)

  want, want_dx = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params_of(moe), x)
  assert_close(dx, want_dx, GRAD_RTOL, "dx")
  for name, g in want.items():
    assert_close(getattr(grads, name)[...], g, GRAD_RTOL, f"d{name}")


def test_bf16_compute_dtype():
  x = tokens()
  moe = make("top1_shared_renorm", dtype=jnp.bfloat16)
  y, _ = nnx.jit(lambda m, x: m(x))(moe, x)
  assert y.dtype == jnp.bfloat16 and moe.w_gate[...].dtype == jnp.float32
  want = dense_ref(moe, params_of(moe), x)[0]
  assert_close(y.reshape(-1, 16), want, BF16_RTOL, "bf16 y")
  moe = make(param_dtype=jnp.bfloat16)
  assert moe.w_up[...].dtype == jnp.bfloat16
  # The compute dtype is promoted from f32 x and bf16 params.
  assert nnx.eval_shape(lambda m, x: m(x), moe, x)[0].dtype == jnp.float32


def test_backend_and_config_reach_moe(monkeypatch):
  seen = []

  def spy(*args, **kwargs):
    seen.append(kwargs)
    return real(*args, **{**kwargs, "backend": "xla"})

  real = mok_jax.moe
  monkeypatch.setattr(mok_jax, "moe", spy)
  config = mok_jax.Config(block_m=4)
  make(backend="ffi", config=config)(tokens())
  assert seen[0]["backend"] == "ffi" and seen[0]["config"] is config


def test_ffi_backend_expert_parallel():
  """The C++ FFI target on CPU (the CUDA kernel's twin) inside the layer's shard_map."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  mesh = jax.make_mesh((4,), ("expert",))
  kw = dict(mesh=mesh, expert_axis="expert", config=mok_jax.Config(block_m=4))
  ffi = make("sigmoid_groups_shared", backend="ffi", **kw)
  xla = make("sigmoid_groups_shared", backend="xla")
  x = tokens()
  loss = lambda m: jnp.sum(m(x)[0] ** 2)  # noqa: E731
  g_ffi, g_xla = nnx.jit(nnx.grad(loss))(ffi), nnx.jit(nnx.grad(loss))(xla)
  assert_close(ffi(x)[0], xla(x)[0], F32_RTOL, "ffi vs xla y")
  for name in xla.options.param_shapes():
    assert_close(getattr(g_ffi, name)[...], getattr(g_xla, name)[...], GRAD_RTOL, f"d{name}")


def test_selection_bias_picks_but_does_not_weigh():
  moe = make("softmax", selection_bias=True)
  assert isinstance(moe.bias, MoEBias) and np.all(moe.bias[...] == 0)
  x = tokens()
  # A large bias on experts 6, 7 puts every token on them; their weights stay the scores.
  moe.bias[...] = jnp.zeros(8).at[6:].set(10.0)
  y, aux = moe(x)
  np.testing.assert_array_equal(aux.counts, [0] * 6 + [15, 15])
  want = dense_ref(moe, params_of(moe), x, bias=moe.bias[...])[0]
  assert_close(y.reshape(-1, 16), want, F32_RTOL, "biased y")
  # The update rule: bias += rate * sign(mean(counts) - counts), in place under nnx.jit.
  moe.bias[...] = jnp.zeros(8)
  counts = jnp.array([0, 1, 3, 3, 3, 5, 9, 0])  # mean 3
  nnx.jit(lambda m, c: m.update_bias(c, 0.01))(moe, counts)
  np.testing.assert_allclose(moe.bias[...], 0.01 * np.sign(3.0 - np.asarray(counts)))
  # An optimizer over nnx.Param leaves the bias alone.
  optimizer = nnx.Optimizer(moe, optax.sgd(1.0), wrt=nnx.Param)
  before = np.asarray(moe.bias[...])
  grads = nnx.grad(lambda m: m(x)[1].load_balancing_loss)(moe)
  optimizer.update(moe, grads)
  np.testing.assert_array_equal(moe.bias[...], before)
  with pytest.raises(ValueError, match="selection_bias=False"):
    make().update_bias(counts, 0.1)


@pytest.mark.parametrize("mesh_shape, axis_type, T", [
    ((2, 4), AxisType.Explicit, 15),  # tokens over data x expert, padded from 15 to 16
    ((1, 8), AxisType.Auto, 24),  # one expert per device
])
def test_sharded_equals_unsharded(mesh_shape, axis_type, T):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
  mesh = jax.make_mesh(mesh_shape, ("data", "expert"), axis_types=(axis_type,) * 2)
  case = dict(shared_intermediate_size=6, selection_bias=True)
  sharded = make(mesh=mesh, expert_axis="expert", **case)
  plain = make(**case)
  spec = nnx.get_partition_spec(nnx.state(sharded))
  assert nnx.to_pure_dict(spec)["w_gate"] == PartitionSpec("expert", None, None)
  assert sharded.w_down[...].sharding.spec == PartitionSpec("expert", None, None)
  assert sharded.router[...].sharding.is_fully_replicated
  for name in plain.options.param_shapes():  # same init, only placed differently
    np.testing.assert_array_equal(getattr(sharded, name)[...], getattr(plain, name)[...])

  x = tokens((T, 16), seed=3)

  @nnx.jit
  def step(m, x):
    def loss(m):
      y, aux = m(x)
      return jnp.sum(y * y) + aux.load_balancing_loss + aux.router_z_loss, (y, aux)
    grads, (y, aux) = nnx.grad(loss, has_aux=True)(m)
    m.update_bias(aux.counts, 0.1)
    return y, aux, grads

  with jax.set_mesh(mesh):
    y, aux, grads = step(sharded, x)
  want_y, want_aux, want_grads = step(plain, x)
  assert_close(y, want_y, F32_RTOL, "y")
  np.testing.assert_array_equal(aux.counts, want_aux.counts)
  assert_close(aux.load_balancing_loss, want_aux.load_balancing_loss, F32_RTOL, "lb")
  assert_close(aux.router_z_loss, want_aux.router_z_loss, F32_RTOL, "z")
  for name in plain.options.param_shapes():
    assert_close(getattr(grads, name)[...], getattr(want_grads, name)[...], GRAD_RTOL,
                 f"d{name}")
  np.testing.assert_array_equal(sharded.bias[...], plain.bias[...])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_stacked_layers_scanned_over_a_mesh(axis_type):
  """Expert-parallel layers stacked by nnx.vmap and run by nnx.scan, as models scan their
  blocks: each stack keeps its experts split (the stacked axis whole), and the loss and
  gradients are those of the same layers unsplit."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  keys = jax.random.split(jax.random.key(0), 3)

  def stack(**kw):
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def build(key):
      return MoE(16, 8, 8, 2, shared_intermediate_size=6, backend="ffi", rngs=nnx.Rngs(key),
                 **kw)
    return build(keys)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
  def blocks(h, layer):
    y, aux = layer(h)
    return h + y, aux.load_balancing_loss

  @nnx.jit
  def step(layers, x):
    def loss(layers):
      h, lb = blocks(x, layers)
      return jnp.sum(h * h) + jnp.sum(lb)
    return nnx.value_and_grad(loss)(layers)

  x = tokens((4, 6, 16), seed=5)
  with jax.set_mesh(mesh):
    layers = stack(mesh=mesh, expert_axis="expert")
    assert layers.w_gate[...].sharding.spec[:2] == (None, "expert")
    spec = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layers)))
    assert spec["w_up"] == PartitionSpec(None, "expert", None, None)
    loss, grads = step(layers, x)
  plain = stack()
  for name in plain.options.param_shapes():  # same init, only placed differently
    np.testing.assert_array_equal(getattr(layers, name)[...], getattr(plain, name)[...])
  want_loss, want_grads = step(plain, x)
  assert_close(loss, want_loss, F32_RTOL, "loss")
  for name in plain.options.param_shapes():
    assert_close(getattr(grads, name)[...], getattr(want_grads, name)[...], GRAD_RTOL,
                 f"d{name}")


def test_expert_axis_must_divide_experts():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((8,), ("expert",))
  with pytest.raises(ValueError, match="num_experts=12 is not divisible by the size 8"):
    make(num_experts=12, mesh=mesh, expert_axis="expert")


INVALID = [
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(score="relu"), "score must be one of"),
    (dict(n_groups=3, topk_groups=1), "n_groups=3 must divide"),
    (dict(n_groups=4), "go together"),
    (dict(n_groups=4, topk_groups=1, top_k=3), "top_k=3 exceeds the 2 experts"),
    (dict(dtype=jnp.float16), "dtype must be None, bfloat16 or float32"),
    (dict(backend="tpu"), "backend must be one of"),
    (dict(expert_axis="expert"), "need a mesh"),
    (dict(intermediate_size=0), "intermediate_size must be an int >= 1"),
]


@pytest.mark.parametrize("kw, message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_options(kw, message):
  with pytest.raises(ValueError, match=message):
    make(**kw)


def test_wrong_hidden_size():
  with pytest.raises(ValueError, match="hidden_size=16"):
    make()(jnp.zeros((4, 12)))


def test_checkpoint_round_trip(tmp_path):
  moe = make("sigmoid_groups_shared", selection_bias=True)
  moe.bias[...] = jnp.arange(8.0) / 10
  x = tokens()
  want_y, _ = moe(x)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "moe", nnx.state(moe))
  fresh = nnx.eval_shape(lambda: make("sigmoid_groups_shared", seed=7, selection_bias=True))
  graphdef, abstract = nnx.split(fresh)
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "moe", abstract)
  moe2 = nnx.merge(graphdef, restored)
  np.testing.assert_array_equal(moe2.bias[...], moe.bias[...])
  np.testing.assert_array_equal(moe2(x)[0], want_y)


def test_importing_nn_does_not_import_frameworks():
  code = ("import sys, mok_jax.nn; "
          "assert 'flax' not in sys.modules and 'equinox' not in sys.modules, 'eager import'; "
          "mok_jax.nn.flax.MoE; assert 'flax' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)
