"""What only mok_jax.nn.equinox.MoE has: `partition_specs` and `shardings`, the `trainable`
filter, and tokens explicitly split over batch and sequence (test_nn_layers.py tests what both
layers share)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from mok_jax.nn.equinox import MoE, trainable

from cases import assert_close
from layer_reference import F32_RTOL, GRAD_RTOL, layer_options, tokens


PARAMS = ("router", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def params_of(moe):
  return {name: getattr(moe, name) for name in PARAMS if getattr(moe, name) is not None}


def make(case="softmax", seed=0, **kw):
  return MoE(**layer_options(case, **kw), key=jax.random.key(seed))


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape, axis_type, data_axes", [
    ((4, 2), AxisType.Auto, ("data",)),
    ((8,), AxisType.Explicit, None),
])
def test_partition_specs_and_shardings(mesh_shape, axis_type, data_axes):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
  names = ("data", "expert")[-len(mesh_shape):]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
  moe = make("sigmoid_groups_shared", selection_bias=True, mesh=mesh, expert_axis="expert",
             data_axes=data_axes)
  specs = moe.partition_specs()
  assert specs.w_gate == PartitionSpec("expert", None, None) and specs.router == PartitionSpec()
  assert specs.bias == PartitionSpec() and specs.ws_up == PartitionSpec()
  assert moe.w_up.sharding == NamedSharding(mesh, specs.w_up)
  assert moe.shardings().w_down == NamedSharding(mesh, PartitionSpec("expert", None, None))
  with pytest.raises(ValueError, match="has no mesh"):
    make().shardings()


def test_trainable_leaves_out_the_bias():
  moe = make(selection_bias=True)
  spec = trainable([moe, jnp.ones(2), jnp.arange(2)])
  assert spec[0].bias is False and spec[0].router is True and spec[0].ws_gate is None
  assert spec[1:] == [True, False]
  params, _ = eqx.partition(moe, trainable(moe))
  assert params.bias is None and params.router is not None


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
