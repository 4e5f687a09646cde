"""`MoE`: a Flax NNX Mixture-of-Experts layer on `mok_jax.moe`.

    moe = MoE(hidden_size=512, intermediate_size=256, num_experts=64, top_k=8,
              rngs=nnx.Rngs(0))
    y, aux = moe(x)                       # x (..., H); aux: MoEAux
    loss = task_loss + 1e-2 * aux.load_balancing_loss + 1e-3 * aux.router_z_loss

Expert parallelism: pass a `Mesh` and its expert axis. The expert stacks are created sharded
over that axis (nnx sharding metadata, so `nnx.get_partition_spec` / `nnx.get_named_sharding`
give their specs) and every call runs `mok_jax.moe` inside `jax.shard_map`:

    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    moe = MoE(..., mesh=mesh, expert_axis="expert", rngs=nnx.Rngs(0))
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mok_jax.nn import common
from mok_jax.nn.common import MoEAux, MoEOptions

__all__ = ["MoE", "MoEAux", "MoEBias"]


class MoEBias(nnx.Variable):
  """The (E,) selection bias of aux-loss-free balancing. Not an `nnx.Param`: an optimizer built
  with `wrt=nnx.Param` leaves it alone (it gets no gradient anyway); `MoE.update_bias` moves it.
  It is part of `nnx.state(model)`, so checkpoints keep it."""


class MoE(nnx.Module):
  """Router + routed SwiGLU experts (+ an optional shared expert), computed by `mok_jax.moe`.

  Parameters (global shapes; `param_dtype`):
    router (H, E); w_gate, w_up (E, H, I); w_down (E, I, H);
    with a shared expert: ws_gate, ws_up (H, Is); ws_down (Is, H);
    with selection_bias: bias (E,) f32, an `MoEBias`.

  Args:
    hidden_size, intermediate_size, num_experts, top_k, score, renormalize, n_groups,
    topk_groups, shared_intermediate_size, selection_bias, param_dtype, dtype, backend, config,
      mesh, expert_axis, data_axes: see `mok_jax.nn.common.MoEOptions`.
    router_init, kernel_init, down_init: see `mok_jax.nn.common.Initializers`.
    rngs: `nnx.Rngs` with a "params" stream.

  Calling it on x (..., H) returns (y (..., H) in the compute dtype, `MoEAux`).
  """

  def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
               score: str = "softmax", renormalize: bool = True, n_groups: int | None = None,
               topk_groups: int | None = None, shared_intermediate_size: int | None = None,
               selection_bias: bool = False,
               router_init=common.default_router_init, kernel_init=common.default_kernel_init,
               down_init=None, param_dtype=jnp.float32, dtype=None, backend: str = "auto",
               config=None, mesh=None, expert_axis: str | None = None,
               data_axes: tuple[str, ...] | None = None, rngs: nnx.Rngs):
    # locals() is the arguments by name here, before any other local is bound.
    opts, inits = common.constructor_options(locals())
    self.options = opts
    for name in opts.param_shapes():
      value = common.init_param(opts, inits, name, rngs.params())
      setattr(self, name, nnx.Param(_annotated(opts, name, value)))
    self.bias = MoEBias(jnp.zeros((num_experts,), jnp.float32)) if selection_bias else None

  def __call__(self, x) -> tuple[jnp.ndarray, MoEAux]:
    params = {name: getattr(self, name)[...] for name in self.options.param_shapes()}
    bias = None if self.bias is None else self.bias[...]
    return common.forward(self.options, x, params, bias)

  def update_bias(self, counts, rate: float):
    """bias += rate * sign(mean(counts) - counts) (`mok_jax.nn.common.update_bias`), in place.

    counts: `MoEAux.counts` of this layer from the last step."""
    if self.bias is None:
      raise ValueError("MoE.update_bias: this layer was built with selection_bias=False")
    self.bias[...] = common.update_bias(self.bias[...], counts, rate)


def _annotated(opts: MoEOptions, name: str, value):
  """value with nnx sharding metadata when the layer has a mesh.

  `nnx.with_partitioning` is used because it knows the metadata key of this Flax version (the
  key has changed between releases); the value is already placed by `common.init_param`."""
  if opts.mesh is None:
    return value
  ndim = len(opts.param_shapes()[name])
  spec = tuple(opts.param_spec(name))
  spec = spec + (None,) * (ndim - len(spec))
  return nnx.with_partitioning(lambda: value, spec, opts.mesh)()
