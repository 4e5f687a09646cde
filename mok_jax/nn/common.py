"""What the Flax and Equinox MoE modules share: options and initialisers (what their
constructors take, read from their arguments by `constructor_options`), the layer's forward,
auxiliary losses, the selection-bias update and the expert-parallel `shard_map` wrapper.

The modules only hold parameters; `forward` does the work, so both compute the same thing:

    logits  = x @ router                                  (T, E), f32
    experts, weights = mok_jax.route(logits, top_k, ..., bias=bias)
    y       = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=...)

Routing and the auxiliary losses run on the global token array (under `jax.jit` with a mesh,
XLA partitions them), so the losses and counts are those of all tokens. Only `mok_jax.moe` runs
inside `jax.shard_map`, with the expert weights split over the expert axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import mok_jax
from mok_jax import sharded
from mok_jax.config import Config
from mok_jax.functional import BACKENDS, SCORES, placed_moe

COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
HIGHEST = jax.lax.Precision.HIGHEST

# The defaults of `Initializers`, called on 2-D (fan_in, fan_out) shapes like a Dense kernel.
default_router_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
default_kernel_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class MoEAux(NamedTuple):
  """Auxiliary outputs of an MoE layer, over all T tokens of the call (all ranks).

  With p[t, e] the router probability (softmax of the logits; for score="sigmoid", the sigmoid
  scores normalised to sum to 1 over e, as DeepSeek-V3's balance loss does), counts[e] the
  number of routes (t, j) to expert e, f[e] = counts[e] / (T * k) and P[e] = mean_t p[t, e]:

    load_balancing_loss = E * sum_e f[e] * P[e]      (Switch Transformer, top-k form; equals 1
                                                      for a uniform router; f has no gradient)
    router_z_loss       = mean_t logsumexp_e(logits[t, e]) ** 2      (ST-MoE)

  Attributes:
    load_balancing_loss: () f32, differentiable in the router weights.
    router_z_loss: () f32, differentiable in the router weights.
    counts: (E,) int32 routes per expert (sums to T * k), for logging and `update_bias`.
  """

  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  counts: jax.Array


@dataclasses.dataclass(frozen=True)
class MoEOptions:
  """Static options of an MoE layer (hashable: usable as a jit-static argument).

  Attributes:
    hidden_size: H, the model width.
    intermediate_size: I, the width of each expert's SwiGLU MLP.
    num_experts: E, the number of routed experts (all ranks together).
    top_k: experts per token.
    score: "softmax" or "sigmoid" router scores (see `mok_jax.route`).
    renormalize: divide each token's k weights by their sum.
    n_groups, topk_groups: DeepSeek-V3 group-limited routing, or None.
    shared_intermediate_size: Is of the shared expert that every token goes through; None or 0
      for none.
    selection_bias: hold an (E,) f32 bias that changes which experts are picked, not their
      weights (aux-loss-free balancing, updated with `update_bias`).
    param_dtype: dtype the parameters are stored in.
    dtype: compute dtype of the expert MLPs (bfloat16 or float32); None: the promotion of the
      input's dtype and param_dtype. The router always computes in float32.
    backend, config: passed to `mok_jax.moe`.
    mesh: a `jax.sharding.Mesh` for expert parallelism, or None.
    expert_axis: the mesh axis the experts are split over (required with a mesh).
    data_axes: mesh axes that shard the tokens besides expert_axis; None: every other axis of
      the mesh. Tokens are split over data_axes + (expert_axis,); their number need not divide
      evenly (the layer pads and cuts). Mesh axes may be Auto or Explicit (`jax.make_mesh`'s
      default); with Explicit axes, differentiate the layer under `jax.jit` or inside
      `jax.set_mesh(mesh)`, as JAX requires.
  """

  hidden_size: int
  intermediate_size: int
  num_experts: int
  top_k: int
  score: str = "softmax"
  renormalize: bool = True
  n_groups: int | None = None
  topk_groups: int | None = None
  shared_intermediate_size: int | None = None
  selection_bias: bool = False
  param_dtype: Any = jnp.float32
  dtype: Any = None
  backend: str = "auto"
  config: Config | None = None
  mesh: Mesh | None = None
  expert_axis: str | None = None
  data_axes: tuple[str, ...] | None = None

  def __post_init__(self):
    for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
      _check_int(name, getattr(self, name), 1)
    E = self.num_experts
    if self.top_k > E:
      raise ValueError(f"MoE: top_k={self.top_k} exceeds num_experts={E}")
    if self.score not in SCORES:
      raise ValueError(f"MoE: score must be one of {SCORES}, got {self.score!r}")
    if (self.n_groups is None) != (self.topk_groups is None):
      raise ValueError("MoE: n_groups and topk_groups go together; got "
                       f"n_groups={self.n_groups!r}, topk_groups={self.topk_groups!r}")
    if self.n_groups is not None:
      _check_int("n_groups", self.n_groups, 1)
      if E % self.n_groups:
        raise ValueError(f"MoE: n_groups={self.n_groups} must divide num_experts={E}")
      _check_int("topk_groups", self.topk_groups, 1)
      if self.topk_groups > self.n_groups:
        raise ValueError(f"MoE: topk_groups={self.topk_groups} exceeds n_groups={self.n_groups}")
      size = E // self.n_groups
      if self.top_k > self.topk_groups * size:
        raise ValueError(f"MoE: top_k={self.top_k} exceeds the {self.topk_groups * size} experts "
                         f"of topk_groups={self.topk_groups} groups of {size}")
    if self.shared_intermediate_size is not None:
      _check_int("shared_intermediate_size", self.shared_intermediate_size, 0)
    if not jnp.issubdtype(self.param_dtype, jnp.floating):
      raise ValueError(f"MoE: param_dtype must be a float dtype, got {self.param_dtype!r}")
    if self.dtype is not None and jnp.dtype(self.dtype) not in COMPUTE_DTYPES:
      raise ValueError(f"MoE: dtype must be None, bfloat16 or float32 (what mok_jax.moe takes), "
                       f"got {self.dtype!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"MoE: backend must be one of {BACKENDS}, got {self.backend!r}")
    if self.config is not None and not isinstance(self.config, Config):
      raise ValueError(f"MoE: config must be a mok_jax.Config or None, got "
                       f"{type(self.config).__name__}")
    self._check_mesh()

  def _check_mesh(self):
    mesh, axis = self.mesh, self.expert_axis
    if mesh is None:
      if axis is not None or self.data_axes is not None:
        raise ValueError("MoE: expert_axis and data_axes need a mesh; got mesh=None, "
                         f"expert_axis={axis!r}, data_axes={self.data_axes!r}")
      return
    if not isinstance(mesh, Mesh):
      raise ValueError(f"MoE: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
      raise ValueError(f"MoE: expert_axis must name an axis of the mesh {dict(mesh.shape)}, "
                       f"got {axis!r}")
    n = mesh.shape[axis]
    if self.num_experts % n:
      raise ValueError(f"MoE: num_experts={self.num_experts} is not divisible by the size "
                       f"{n} of the expert axis {axis!r}; every rank must hold the same number "
                       "of experts")
    if self.data_axes is not None:
      if isinstance(self.data_axes, str) or not isinstance(self.data_axes, tuple):
        raise ValueError(f"MoE: data_axes must be a tuple of mesh axis names or None, got "
                         f"{self.data_axes!r}")
      bad = [a for a in self.data_axes if a not in mesh.axis_names or a == axis]
      if bad or len(set(self.data_axes)) != len(self.data_axes):
        raise ValueError(f"MoE: data_axes {self.data_axes!r} must be distinct axes of the mesh "
                         f"{dict(mesh.shape)} other than the expert axis {axis!r}")
    kinds = {sharded.axis_type(mesh, a) for a in self.token_axes}
    if len(kinds) > 1:
      raise ValueError(f"MoE: the token axes {self.token_axes} mix axis types {kinds}; make "
                       "them all Auto or all Explicit")

  @property
  def has_shared(self) -> bool:
    return bool(self.shared_intermediate_size)

  @property
  def token_axes(self) -> tuple[str, ...]:
    """Mesh axes the tokens are split over inside the layer: data axes, then the expert axis."""
    if self.mesh is None:
      return ()
    data = self.data_axes
    if data is None:
      data = tuple(a for a in self.mesh.axis_names if a != self.expert_axis)
    return (*data, self.expert_axis)

  def compute_dtype(self, input_dtype):
    dtype = jnp.dtype(self.dtype or jnp.result_type(input_dtype, self.param_dtype))
    if dtype not in COMPUTE_DTYPES:
      raise ValueError(f"MoE: the compute dtype {dtype} (from input {jnp.dtype(input_dtype)} and "
                       f"param_dtype {jnp.dtype(self.param_dtype)}) must be bfloat16 or float32; "
                       "set dtype=")
    return dtype

  # --- shapes and shardings of the parameters -------------------------------------------------

  def param_shapes(self) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameters by name (global shapes; experts are split over expert_axis)."""
    H, I, E = self.hidden_size, self.intermediate_size, self.num_experts
    shapes = {"router": (H, E), "w_gate": (E, H, I), "w_up": (E, H, I), "w_down": (E, I, H)}
    if self.has_shared:
      Is = self.shared_intermediate_size
      shapes.update(ws_gate=(H, Is), ws_up=(H, Is), ws_down=(Is, H))
    return shapes

  def param_spec(self, name: str) -> PartitionSpec:
    """The PartitionSpec of a parameter: the expert stacks are split over expert_axis on their
    leading (expert) axis; everything else is replicated."""
    if self.mesh is not None and name in ("w_gate", "w_up", "w_down"):
      return PartitionSpec(self.expert_axis, None, None)
    return PartitionSpec()

  def param_sharding(self, name: str) -> NamedSharding | None:
    return None if self.mesh is None else NamedSharding(self.mesh, self.param_spec(name))


def _check_int(name, value, low):
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"MoE: {name} must be an int >= {low}, got {value!r}")


class Initializers(NamedTuple):
  """The layers' initialisers, each called as init(key, (fan_in, fan_out), dtype); the expert
  stacks call theirs once per expert.

  Attributes:
    router_init: of the router (H, E).
    kernel_init: of the gate and up matrices and, unless down_init is given, the down matrices.
    down_init: of w_down and ws_down, or None for kernel_init.
  """

  router_init: Callable = default_router_init
  kernel_init: Callable = default_kernel_init
  down_init: Callable | None = None

  def of(self, name: str) -> Callable:
    """The initialiser of a parameter by `MoEOptions.param_shapes` name."""
    if name == "router":
      return self.router_init
    if name in ("w_down", "ws_down") and self.down_init is not None:
      return self.down_init
    return self.kernel_init


def constructor_options(args: dict) -> tuple[MoEOptions, Initializers]:
  """The validated `MoEOptions` and the `Initializers` of a layer from its constructor's
  arguments by name (its `locals()` on entry; other names, such as self, rngs or key, are not
  read). Each layer writes the fields of both out as its keyword arguments, with their defaults
  here; tests/test_nn_layers.py checks that the signatures agree with these definitions."""
  options = MoEOptions(**{f.name: args[f.name] for f in dataclasses.fields(MoEOptions)})
  return options, Initializers(**{name: args[name] for name in Initializers._fields})


def init_param(opts: MoEOptions, inits: Initializers, name: str, key):
  """A parameter's initial value: 2-D inits are applied per expert for the (E, ., .) stacks;
  placed with its NamedSharding when the options have a mesh.

  Placed by a sharding constraint (Auto axes) or a reshard (Explicit ones), not device_put:
  under a vmap that stacks layers (nnx.vmap, eqx.filter_vmap) those keep the spec on the expert
  axis and leave the stacked axis whole, where device_put would split the stacked axis."""
  shape = opts.param_shapes()[name]
  init = inits.of(name)
  if len(shape) == 3:
    keys = jax.random.split(key, shape[0])
    value = jax.vmap(lambda k: init(k, shape[1:], opts.param_dtype))(keys)
  else:
    value = init(key, shape, opts.param_dtype)
  value = jnp.asarray(value, opts.param_dtype)
  sharding = opts.param_sharding(name)
  if sharding is None:
    return value
  if sharded.axis_type(opts.mesh, opts.expert_axis) == AxisType.Explicit:
    return jax.sharding.reshard(value, sharding)
  return jax.lax.with_sharding_constraint(value, sharding)


# --- the layer --------------------------------------------------------------------------------


def forward(opts: MoEOptions, x, params: dict, bias=None):
  """The MoE layer on x (..., H).

  Args:
    opts: the layer's options.
    x: (..., H) tokens; all leading axes are tokens, explicitly split over any of them or
      not (sharded.token_rows keeps each row on its device).
    params: arrays by `MoEOptions.param_shapes` name, in any float dtype.
    bias: None or the (E,) selection bias.

  Returns:
    y: (..., H) in the compute dtype; `MoEAux` of all the tokens.
  """
  H = opts.hidden_size
  if x.ndim < 1 or x.shape[-1] != H:
    raise ValueError(f"MoE: x must be (..., hidden_size={H}), got shape {x.shape}")
  x2, unflatten = sharded.token_rows(x)
  dtype = opts.compute_dtype(x.dtype)
  logits = jnp.dot(x2.astype(jnp.float32), params["router"].astype(jnp.float32),
                   precision=HIGHEST)
  experts, weights = mok_jax.route(logits, opts.top_k, score=opts.score,
                                   renormalize=opts.renormalize, n_groups=opts.n_groups,
                                   topk_groups=opts.topk_groups, bias=bias)
  aux = aux_losses(logits, experts, score=opts.score)
  cast = lambda name: params[name].astype(dtype)  # noqa: E731
  shared = (cast("ws_gate"), cast("ws_up"), cast("ws_down")) if opts.has_shared else None
  y = moe(opts, x2.astype(dtype), experts, weights, cast("w_gate"), cast("w_up"),
          cast("w_down"), shared)
  return unflatten(y), aux


def aux_losses(logits, experts, *, score="softmax") -> MoEAux:
  """`MoEAux` from router logits (T, E) and the chosen experts (T, k); formulas in MoEAux."""
  T, E = logits.shape
  k = experts.shape[-1]
  logits = logits.astype(jnp.float32)
  if score == "softmax":
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    s = jax.nn.sigmoid(logits)
    probs = s / (jnp.sum(s, axis=-1, keepdims=True) + 1e-20)
  # A one-hot sum rather than bincount: XLA fuses it into one reduction and it partitions
  # like any other reduction over a sharded token axis.
  counts = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.int32), axis=(0, 1))
  fraction = jax.lax.stop_gradient(counts.astype(jnp.float32) / max(T * k, 1))
  load_balancing = E * jnp.sum(fraction * jnp.mean(probs, axis=0))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  return MoEAux(load_balancing, z, counts)


def update_bias(bias, counts, rate):
  """DeepSeek-V3 aux-loss-free balancing: bias[e] += rate * sign(mean(counts) - counts[e]).

  Underloaded experts become more likely to be picked, overloaded ones less. Call it once per
  training step with that step's `MoEAux.counts` (rate: DeepSeek-V3 uses 1e-3). Layers stacked
  on leading axes (bias and counts (..., E)) are each balanced on their own.
  """
  counts = jax.lax.stop_gradient(counts).astype(jnp.float32)
  mean = jnp.mean(counts, axis=-1, keepdims=True)
  return bias + rate * jnp.sign(mean - counts).astype(bias.dtype)


def moe(opts: MoEOptions, x, experts, weights, w_gate, w_up, w_down, shared):
  """`mok_jax.moe` on global arrays: directly, or in `shard_map` over the options' mesh."""
  if opts.mesh is None:
    return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared,
                       config=opts.config, backend=opts.backend)
  where = sharded.Placement(opts.mesh, opts.token_axes, opts.expert_axis)
  return placed_moe(x, experts, weights, w_gate, w_up, w_down, shared, where=where,
                    config=opts.config, backend=opts.backend)
