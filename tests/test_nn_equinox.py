"""mok_jax.nn.equinox.MoE against a dense reference: outputs, gradients, auxiliary losses (against
NumPy), the selection bias, expert parallelism on 8 CPU devices, and a serialisation round trip."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import mok_jax
from mok_jax.nn.equinox import MoE, trainable

from cases import assert_close
from layer_reference import (BF16_RTOL, CASES, F32_RTOL, GRAD_RTOL, aux_numpy, dense_moe,
                             dense_ref, layer_options, ref_kwargs, tokens)


PARAMS = ("router", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def params_of(moe):
  return {name: getattr(moe, name) for name in PARAMS if getattr(moe, name) is not None}


def make(case="softmax", seed=0, **kw):
  return MoE(**layer_options(case, **kw), key=jax.random.key(seed))


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_forward_gradients_and_aux(case):
  moe = make(case)
  x, ct = tokens(), tokens(seed=2)

  def loss_of(y, lb, z):
    return jnp.sum(y.reshape(ct.shape) * ct) + 0.3 * lb + 0.1 * z

  @eqx.filter_jit
  def run(m, x):
    def loss(m, x):
      y, aux = m(x)
      return loss_of(y, aux.load_balancing_loss, aux.router_z_loss), (y, aux)
    return eqx.filter_grad(loss, has_aux=True)(m, x)

  grads, (y, aux) = run(moe, x)
  want_y, want_lb, want_z, want_counts = dense_ref(moe, params_of(moe), x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert_close(y.reshape(-1, 16), want_y, F32_RTOL, "y")
  np.testing.assert_array_equal(aux.counts, want_counts)

  logits = x.reshape(-1, 16) @ moe.router
  o = moe.options
  experts, _ = mok_jax.route(logits, o.top_k, score=o.score, renormalize=o.renormalize,
                             n_groups=o.n_groups, topk_groups=o.topk_groups)
  lb, z, counts = aux_numpy(logits, np.asarray(experts), 8, o.score)
  np.testing.assert_array_equal(aux.counts, counts)
  assert_close(aux.load_balancing_loss, lb, F32_RTOL, "load_balancing_loss")
  assert_close(aux.router_z_loss, z, F32_RTOL, "router_z_loss")

  def ref_loss(p):
    y, lb, z, _ = dense_moe(x, p, **ref_kwargs(moe))
    return loss_of(y, lb, z)

  for name, g in jax.jit(jax.grad(ref_loss))(params_of(moe)).items():
    assert_close(getattr(grads, name), g, GRAD_RTOL, f"d{name}")


def test_bf16_compute_dtype():
  x = tokens()
  moe = make(dtype=jnp.bfloat16, shared_intermediate_size=4)
  y, _ = moe(x)
  assert y.dtype == jnp.bfloat16 and moe.w_up.dtype == jnp.float32
  assert_close(y.reshape(-1, 16), dense_ref(moe, params_of(moe), x)[0],
               BF16_RTOL, "bf16 y")


def test_selection_bias_and_trainable_filter():
  moe = make(selection_bias=True)
  x = tokens()
  moe = eqx.tree_at(lambda m: m.bias, moe, jnp.zeros(8).at[:2].set(10.0))
  y, aux = moe(x)
  np.testing.assert_array_equal(aux.counts, [15, 15] + [0] * 6)
  assert_close(y.reshape(-1, 16),
               dense_ref(moe, params_of(moe), x, bias=moe.bias)[0], F32_RTOL, "y")
  counts = jnp.array([4, 0, 2, 2, 2, 2, 2, 2])  # mean 2
  updated = moe.update_bias(counts, 0.5)
  np.testing.assert_allclose(updated.bias, moe.bias + 0.5 * np.sign(2.0 - np.asarray(counts)))
  # Training with the trainable() filter: the bias stays, the parameters move.
  params, static = eqx.partition(moe, trainable(moe))
  assert params.bias is None and params.router is not None
  opt = optax.adamw(1e-2, weight_decay=0.1)
  state = opt.init(params)

  def loss(params):
    return eqx.combine(params, static)(x)[1].load_balancing_loss

  updates, state = opt.update(jax.grad(loss)(params), state, params)
  moved = eqx.combine(optax.apply_updates(params, updates), static)
  np.testing.assert_array_equal(moved.bias, moe.bias)
  assert not np.array_equal(moved.router, moe.router)


@pytest.mark.parametrize("mesh_shape, axis_type, data_axes, T", [
    ((4, 2), AxisType.Auto, ("data",), 13),  # tokens over data x expert, padded from 13 to 16
    ((8,), AxisType.Explicit, None, 16),  # experts only, one per device
])
def test_sharded_equals_unsharded(mesh_shape, axis_type, data_axes, T):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
  names = ("data", "expert")[-len(mesh_shape):]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
  case = dict(shared_intermediate_size=6, selection_bias=True)
  sharded = make("sigmoid_groups_shared", mesh=mesh, expert_axis="expert", data_axes=data_axes,
                 **case)
  plain = make("sigmoid_groups_shared", **case)
  specs = sharded.partition_specs()
  assert specs.w_gate == PartitionSpec("expert", None, None) and specs.router == PartitionSpec()
  assert sharded.w_up.sharding == NamedSharding(mesh, specs.w_up)
  assert sharded.shardings().w_down == NamedSharding(mesh, PartitionSpec("expert", None, None))
  x = tokens((T, 16), seed=3)

  @eqx.filter_jit
  def step(m, x):
    def loss(m):
      y, aux = m(x)
      return jnp.sum(y * y) + aux.load_balancing_loss + aux.router_z_loss, (y, aux)
    grads, (y, aux) = eqx.filter_grad(loss, has_aux=True)(m)
    return y, aux, grads, m.update_bias(aux.counts, 0.1)

  with jax.set_mesh(mesh):
    y, aux, grads, stepped = step(sharded, x)
  want_y, want_aux, want_grads, want_stepped = step(plain, x)
  assert_close(y, want_y, F32_RTOL, "y")
  np.testing.assert_array_equal(aux.counts, want_aux.counts)
  assert_close(aux.load_balancing_loss, want_aux.load_balancing_loss, F32_RTOL, "lb")
  assert_close(aux.router_z_loss, want_aux.router_z_loss, F32_RTOL, "z")
  for name in params_of(plain):
    assert_close(getattr(grads, name), getattr(want_grads, name), GRAD_RTOL, f"d{name}")
  np.testing.assert_array_equal(stepped.bias, want_stepped.bias)
  assert stepped.w_gate.sharding.is_equivalent_to(sharded.shardings().w_gate, 3)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_stacked_layers_scanned_over_a_mesh(axis_type):
  """Expert-parallel layers stacked by eqx.filter_vmap and run by jax.lax.scan: each stack
  keeps its experts split (the stacked axis whole), and the loss and gradients are those of the
  same layers unsplit."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  keys = jax.random.split(jax.random.key(0), 3)

  def stack(**kw):
    return eqx.filter_vmap(lambda key: MoE(16, 8, 8, 2, shared_intermediate_size=6,
                                           backend="ffi", key=key, **kw))(keys)

  @eqx.filter_jit
  def step(layers, x):
    params, static = eqx.partition(layers, eqx.is_array)

    def loss(params):
      def block(h, p):
        y, aux = eqx.combine(p, static)(h)
        return h + y, aux.load_balancing_loss
      h, lb = jax.lax.scan(block, x, params)
      return jnp.sum(h * h) + jnp.sum(lb)
    return jax.value_and_grad(loss)(params)

  x = tokens((4, 6, 16), seed=5)
  with jax.set_mesh(mesh):
    layers = stack(mesh=mesh, expert_axis="expert")
    assert layers.w_gate.sharding.spec[:2] == (None, "expert")
    loss, grads = step(layers, x)
  plain = stack()
  for name in params_of(plain):  # same init, only placed differently
    np.testing.assert_array_equal(getattr(layers, name), getattr(plain, name))
  want_loss, want_grads = step(plain, x)
  assert_close(loss, want_loss, F32_RTOL, "loss")
  for name in params_of(plain):
    assert_close(getattr(grads, name), getattr(want_grads, name), GRAD_RTOL, f"d{name}")


def test_expert_axis_must_divide_experts():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by the size 4"):
    make(num_experts=6, top_k=1, mesh=mesh, expert_axis="expert")
  with pytest.raises(ValueError, match="expert_axis must name an axis"):
    make(mesh=mesh, expert_axis="experts")
  with pytest.raises(ValueError, match="data_axes"):
    make(mesh=mesh, expert_axis="expert", data_axes=("expert",))


def test_serialise_round_trip(tmp_path):
  moe = make("sigmoid_groups_shared", selection_bias=True)
  moe = moe.update_bias(jnp.arange(8), 0.25)
  path = tmp_path / "moe.eqx"
  eqx.tree_serialise_leaves(path, moe)
  like = eqx.filter_eval_shape(lambda: make("sigmoid_groups_shared", seed=9, selection_bias=True))
  restored = eqx.tree_deserialise_leaves(path, like)
  x = tokens()
  np.testing.assert_array_equal(restored.bias, moe.bias)
  np.testing.assert_array_equal(restored(x)[0], moe(x)[0])


@pytest.mark.parametrize("spec", [PartitionSpec(None, "seq"), PartitionSpec("data", "seq")])
def test_tokens_split_over_batch_and_sequence(spec):
  """x (B, S, H) explicitly split over its sequence axis (and its batch, two rows a shard):
  the layer's tokens stay on their devices (no all-gather or all-to-all), and y and the
  gradients are the unsplit layer's."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
  moe = make("sigmoid_groups_shared", shared_intermediate_size=6, backend="ffi")
  x = tokens((4, 8, 16), seed=4)

  params, static = eqx.partition(moe, eqx.is_array)

  @jax.jit
  def step(params, x):
    def loss(params):
      y, aux = eqx.combine(params, static)(x)
      return jnp.sum(y * y) + aux.load_balancing_loss, y
    return jax.grad(loss, has_aux=True)(params)

  split = jax.device_put(x, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    grads, y = step(params, split)
    hlo = step.lower(params, split).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo, "rows moved between devices"
  assert y.sharding.spec[:2] == tuple(spec)
  want_grads, want_y = step(params, x)
  assert_close(y, want_y, F32_RTOL, "y")  # XLA's CPU matmuls round by their row count
  for name in params_of(moe):
    assert_close(getattr(grads, name), getattr(want_grads, name), GRAD_RTOL, f"d{name}")
