"""`MoE`: an Equinox Mixture-of-Experts layer on `mok_jax.moe`.

    moe = MoE(hidden_size=512, intermediate_size=256, num_experts=64, top_k=8,
              key=jax.random.key(0))
    y, aux = moe(x)                       # x (..., H); aux: MoEAux
    loss = task_loss + 1e-2 * aux.load_balancing_loss + 1e-3 * aux.router_z_loss

Call it on the whole batch, x (B, S, H), rather than under `jax.vmap(moe)` when training: it
puts all tokens through one `mok_jax.moe` call, where a differentiated vmap makes one call per
example (README, Usage).

Expert parallelism: pass a `Mesh` and its expert axis. The expert stacks are placed sharded over
that axis, `moe.partition_specs()` gives the PartitionSpec of every leaf (for `jax.device_put`,
`eqx.filter_shard`, jit shardings or checkpoint restore), and every call runs `mok_jax.moe`
inside `jax.shard_map`.

The selection bias (selection_bias=True) gets no gradient; keep it out of the optimizer with
`trainable(model)` as the filter spec of `eqx.partition`, and move it with `MoE.update_bias`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mok_jax.nn import common
from mok_jax.nn.common import MoEAux, MoEOptions

__all__ = ["MoE", "MoEAux", "trainable"]


class MoE(eqx.Module):
  """Router + routed SwiGLU experts (+ an optional shared expert), computed by `mok_jax.moe`.

  Fields (global shapes; `param_dtype`):
    router (H, E); w_gate, w_up (E, H, I); w_down (E, I, H);
    ws_gate, ws_up (H, Is), ws_down (Is, H) with a shared expert, else None;
    bias (E,) f32 with selection_bias, else None;
    options: the static `MoEOptions`.

  Args: as `mok_jax.nn.flax.MoE` (`mok_jax.nn.common.MoEOptions` and `Initializers`), with
  `key` (a PRNG key) in place of `rngs`.

  Calling it on x (..., H) returns (y (..., H) in the compute dtype, `MoEAux`).
  """

  router: jax.Array
  w_gate: jax.Array
  w_up: jax.Array
  w_down: jax.Array
  ws_gate: jax.Array | None
  ws_up: jax.Array | None
  ws_down: jax.Array | None
  bias: jax.Array | None
  options: MoEOptions = eqx.field(static=True)

  def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
               score: str = "softmax", renormalize: bool = True, n_groups: int | None = None,
               topk_groups: int | None = None, shared_intermediate_size: int | None = None,
               selection_bias: bool = False,
               router_init=common.default_router_init, kernel_init=common.default_kernel_init,
               down_init=None, param_dtype=jnp.float32, dtype=None, backend: str = "auto",
               config=None, mesh=None, expert_axis: str | None = None,
               data_axes: tuple[str, ...] | None = None, key):
    # locals() is the arguments by name here, before any other local is bound.
    opts, inits = common.constructor_options(locals())
    self.options = opts
    names = list(opts.param_shapes())
    for name, k in zip(names, jax.random.split(key, len(names))):
      setattr(self, name, common.init_param(opts, inits, name, k))
    if not opts.has_shared:
      self.ws_gate = self.ws_up = self.ws_down = None
    self.bias = jnp.zeros((num_experts,), jnp.float32) if selection_bias else None
    if self.bias is not None and mesh is not None:
      self.bias = jax.device_put(self.bias, NamedSharding(mesh, PartitionSpec()))

  def __call__(self, x) -> tuple[jax.Array, MoEAux]:
    params = {name: getattr(self, name) for name in self.options.param_shapes()}
    return common.forward(self.options, x, params, self.bias)

  def update_bias(self, counts, rate: float) -> MoE:
    """A copy with bias += rate * sign(mean(counts) - counts) (`common.update_bias`).

    counts: `MoEAux.counts` of this layer from the last step."""
    if self.bias is None:
      raise ValueError("MoE.update_bias: this layer was built with selection_bias=False")
    return eqx.tree_at(lambda m: m.bias, self, common.update_bias(self.bias, counts, rate))

  def partition_specs(self) -> MoE:
    """This module with a `PartitionSpec` in place of every array: the expert stacks split over
    the expert axis on their leading axis, everything else replicated (P())."""
    return _map_params(self, lambda name, _: self.options.param_spec(name))

  def shardings(self) -> MoE:
    """`partition_specs` as NamedShardings over the options' mesh (which must be set)."""
    mesh = self.options.mesh
    if mesh is None:
      raise ValueError("MoE.shardings: this layer has no mesh")
    return jax.tree.map(lambda s: NamedSharding(mesh, s), self.partition_specs(),
                        is_leaf=lambda s: isinstance(s, PartitionSpec))


def _map_params(module: MoE, fn) -> MoE:
  """The module with fn(name, value) in place of each array field (None fields stay None)."""
  names = [*module.options.param_shapes(), "bias"]
  names = [n for n in names if getattr(module, n) is not None]
  return eqx.tree_at(lambda m: [getattr(m, n) for n in names], module,
                     [fn(n, getattr(module, n)) for n in names])


def trainable(tree):
  """A filter spec for `eqx.partition`: True at inexact arrays, except the selection bias of
  every `MoE` in the tree (it gets no gradient; `MoE.update_bias` moves it)."""

  def spec(node):
    if isinstance(node, MoE):
      return _map_params(node, lambda name, v: name != "bias" and eqx.is_inexact_array(v))
    return eqx.is_inexact_array(node)

  return jax.tree.map(spec, tree, is_leaf=lambda n: isinstance(n, MoE))
