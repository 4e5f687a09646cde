"""What only mok_jax.nn.flax.MoE has: the `MoEBias` variable and the nnx sharding metadata of
stacked layers (test_nn_layers.py tests what both layers share)."""

import jax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from mok_jax.nn.flax import MoE, MoEBias

from layer_reference import layer_options


def make(case="softmax", seed=0, **kw):
  return MoE(**layer_options(case, **kw), rngs=nnx.Rngs(seed))


# --- tests ----------------------------------------------------------------------------------


def test_bias_is_a_variable_but_not_a_param():
  moe = make(selection_bias=True)
  assert isinstance(moe.bias, MoEBias) and not isinstance(moe.bias, nnx.Param)
  assert "bias" in nnx.state(moe) and "bias" not in nnx.state(moe, nnx.Param)
  assert make().bias is None


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_stacked_layers_keep_partition_metadata(axis_type):
  """nnx.vmap with transform_metadata={nnx.PARTITION_NAME: None} stacks the layers' nnx
  sharding metadata with the stacked axis whole."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)

  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
  def stack(key):
    return MoE(16, 8, 8, 2, shared_intermediate_size=6, mesh=mesh, expert_axis="expert",
               rngs=nnx.Rngs(key))

  with jax.set_mesh(mesh):
    layers = stack(jax.random.split(jax.random.key(0), 3))
  spec = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layers)))
  assert spec["w_up"] == PartitionSpec(None, "expert", None, None)
  assert spec["w_down"] == PartitionSpec(None, "expert", None, None)
  assert spec["router"] == PartitionSpec(None, None, None)
  assert spec["ws_down"] == PartitionSpec(None, None, None)
