"""mok_jax.nn.flax.MoE and mok_jax.nn.equinox.MoE, one test for both: the constructors'
arguments against common's definitions, the initialisers, outputs, gradients, auxiliary losses
(against NumPy), the compute dtype, the selection bias, expert parallelism on 8 CPU devices (the
XLA and the FFI backend), layers stacked for a scan, invalid options and meshes, a checkpoint
round trip, and the lazy framework import. Each framework's own idioms (transforms, bias updates,
optimizers, checkpoints) sit in a small adapter; a framework that is not installed is skipped.
What only one framework has is tested in test_nn_flax.py and test_nn_equinox.py."""

import dataclasses
import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import mok_jax
from mok_jax.nn import common

from cases import assert_close
from layer_reference import (BF16_RTOL, CASES, F32_RTOL, GRAD_RTOL, aux_numpy, dense_moe,
                             dense_ref, layer_options, ref_kwargs, tokens)

EXPERT_SPEC = PartitionSpec("expert", None, None)


class Flax:
  """Flax NNX: a module is a mutable graph node; nnx transforms, in-place bias updates, an
  `nnx.Optimizer` over `nnx.Param`, orbax checkpoints of `nnx.state`."""

  randomness = "rngs"

  def __init__(self):
    from flax import nnx
    from mok_jax.nn.flax import MoE

    self.nnx, self.MoE = nnx, MoE
    self.jit, self.grad = nnx.jit, nnx.grad

  def make(self, case="softmax", seed=0, **kw):
    return self.MoE(**layer_options(case, **kw), rngs=self.nnx.Rngs(seed))

  def params(self, tree, names):
    """Arrays by name of a module or of its gradients."""
    return {name: getattr(tree, name)[...] for name in names}

  def bias(self, moe):
    return moe.bias[...]

  def set_bias(self, moe, value):
    moe.bias[...] = value
    return moe

  def update_bias(self, moe, counts, rate):
    moe.update_bias(counts, rate)
    return moe

  def specs(self, moe):
    """The PartitionSpecs the framework declares for the parameters (nnx sharding metadata)."""
    return self.nnx.to_pure_dict(self.nnx.get_partition_spec(self.nnx.state(moe)))

  def optimizer_step(self, moe, loss):
    """One step of an optimizer over the trainable parameters on loss(moe); the moved module."""
    optimizer = self.nnx.Optimizer(moe, optax.sgd(1.0), wrt=self.nnx.Param)
    optimizer.update(moe, self.nnx.grad(loss)(moe))
    return moe

  def stack(self, keys, **kw):
    @self.nnx.vmap(in_axes=0, out_axes=0, transform_metadata={self.nnx.PARTITION_NAME: None})
    def build(key):
      return self.MoE(16, 8, 8, 2, shared_intermediate_size=6, backend="ffi",
                      rngs=self.nnx.Rngs(key), **kw)
    return build(keys)

  def scan_loss_and_grads(self, layers, x):
    """sum(h * h) + sum of the load-balancing losses of the stacked layers run by nnx.scan as
    residual blocks, and its gradients."""
    nnx = self.nnx

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

    return step(layers, x)

  def save(self, moe, path):
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(path, self.nnx.state(moe))

  def restore(self, path, build):
    """The module saved at path, restored into the structure of build()."""
    import orbax.checkpoint as ocp
    graphdef, abstract = self.nnx.split(self.nnx.eval_shape(build))
    with ocp.StandardCheckpointer() as ckpt:
      return self.nnx.merge(graphdef, ckpt.restore(path, abstract))


class Equinox:
  """Equinox: a module is an immutable pytree; filtered transforms, update_bias returning a
  copy, an optax optimizer over `trainable(model)`, leaves serialised with `tree_serialise`."""

  randomness = "key"

  def __init__(self):
    import equinox as eqx
    from mok_jax.nn.equinox import MoE, trainable

    self.eqx, self.MoE, self.trainable = eqx, MoE, trainable
    self.jit, self.grad = eqx.filter_jit, eqx.filter_grad

  def make(self, case="softmax", seed=0, **kw):
    return self.MoE(**layer_options(case, **kw), key=jax.random.key(seed))

  def params(self, tree, names):
    return {name: getattr(tree, name) for name in names}

  def bias(self, moe):
    return moe.bias

  def set_bias(self, moe, value):
    return self.eqx.tree_at(lambda m: m.bias, moe, value)

  def update_bias(self, moe, counts, rate):
    return moe.update_bias(counts, rate)

  def specs(self, moe):
    specs = moe.partition_specs()
    return {name: getattr(specs, name) for name in moe.options.param_shapes()}

  def optimizer_step(self, moe, loss):
    eqx = self.eqx
    params, static = eqx.partition(moe, self.trainable(moe))
    opt = optax.adamw(1e-2, weight_decay=0.1)
    grads = jax.grad(lambda p: loss(eqx.combine(p, static)))(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    return eqx.combine(optax.apply_updates(params, updates), static)

  def stack(self, keys, **kw):
    return self.eqx.filter_vmap(lambda key: self.MoE(16, 8, 8, 2, shared_intermediate_size=6,
                                                     backend="ffi", key=key, **kw))(keys)

  def scan_loss_and_grads(self, layers, x):
    """As Flax.scan_loss_and_grads, with jax.lax.scan over the stacked arrays."""
    eqx = self.eqx

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

    return step(layers, x)

  def save(self, moe, path):
    self.eqx.tree_serialise_leaves(path, moe)

  def restore(self, path, build):
    return self.eqx.tree_deserialise_leaves(path, self.eqx.filter_eval_shape(build))


@pytest.fixture(params=[Flax, Equinox], ids=["flax", "equinox"])
def fw(request):
  pytest.importorskip(request.param.__name__.lower())
  return request.param()


def needs_devices(n):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices (tests/conftest.py sets XLA_FLAGS)")


# --- tests ----------------------------------------------------------------------------------


def test_constructor_signature(fw):
  """Each layer writes out the fields of `common.MoEOptions` and `common.Initializers` as its
  constructor's arguments (for help() and IDEs): the sizes, then keyword-only options with the
  defaults of those definitions, then the framework's randomness (`rngs` or `key`), nothing
  else; and every option reaches the layer's MoEOptions."""
  params = dict(inspect.signature(fw.MoE.__init__).parameters)
  assert params.pop("self").kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
  randomness = params.pop(fw.randomness)
  assert randomness.kind == randomness.KEYWORD_ONLY and randomness.default is randomness.empty
  fields = dataclasses.fields(common.MoEOptions)
  sizes = [f.name for f in fields if f.default is dataclasses.MISSING]
  assert sizes == ["hidden_size", "intermediate_size", "num_experts", "top_k"]
  assert [name for name, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD] == sizes
  assert all(p.kind == p.KEYWORD_ONLY for name, p in params.items() if name not in sizes)
  want = {f.name: f.default for f in fields if f.name not in sizes}
  want.update(common.Initializers._field_defaults)
  assert {name: p.default for name, p in params.items() if name not in sizes} == want
  with pytest.raises(TypeError):
    fw.make(initialiser=None)
  # Every option reaches the layer's MoEOptions.
  options = dict(score="sigmoid", renormalize=False, n_groups=4, topk_groups=2,
                 shared_intermediate_size=6, selection_bias=True, param_dtype=jnp.bfloat16,
                 dtype=jnp.float32, backend="xla", config=mok_jax.Config(block_m=4),
                 mesh=jax.make_mesh((1,), ("expert",)), expert_axis="expert", data_axes=())
  moe = fw.make(top_k=3, **options)
  assert moe.options == common.MoEOptions(16, 8, 8, 3, **options)


def test_initialisers_reach_their_parameters(fw):
  """router_init makes the router, down_init w_down (per expert) and ws_down, kernel_init the
  rest; each called as init(key, (fan_in, fan_out), dtype)."""
  def constant(c):
    def init(key, shape, dtype):
      assert len(shape) == 2 and jnp.dtype(dtype) == jnp.bfloat16
      return jnp.full(shape, c, dtype)
    return init

  moe = fw.make("top1_shared_renorm", param_dtype=jnp.bfloat16, router_init=constant(1),
                kernel_init=constant(2), down_init=constant(3))
  params = fw.params(moe, moe.options.param_shapes())
  want = dict(router=1, w_gate=2, w_up=2, ws_gate=2, ws_up=2, w_down=3, ws_down=3)
  assert params.keys() == want.keys()
  for name, value in params.items():
    assert value.shape == moe.options.param_shapes()[name] and value.dtype == jnp.bfloat16
    np.testing.assert_array_equal(value, np.full(value.shape, want[name]), err_msg=name)
  # Without down_init, kernel_init makes the down matrices too.
  moe = fw.make("top1_shared_renorm", param_dtype=jnp.bfloat16, kernel_init=constant(2))
  np.testing.assert_array_equal(fw.params(moe, ["w_down"])["w_down"], np.full((8, 8, 16), 2))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_gradients_and_aux(fw, case):
  moe = fw.make(case)
  x, ct = tokens(), tokens(seed=2)
  names = moe.options.param_shapes()

  def loss_of(y, lb, z):
    return jnp.sum(y.reshape(ct.shape) * ct) + 0.3 * lb + 0.1 * z

  def loss(mx):
    y, aux = mx[0](mx[1])
    return loss_of(y, aux.load_balancing_loss, aux.router_z_loss), (y, aux)

  (grads, dx), (y, aux) = fw.jit(fw.grad(loss, has_aux=True))((moe, x))
  params = fw.params(moe, names)
  want_y, want_lb, want_z, want_counts = dense_ref(moe, params, x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert_close(y.reshape(-1, 16), want_y, F32_RTOL, "y")
  np.testing.assert_array_equal(aux.counts, want_counts)
  assert aux.counts.dtype == jnp.int32 and int(aux.counts.sum()) == 15 * moe.options.top_k

  # Aux losses against the NumPy formulas, from the layer's own routing.
  o = moe.options
  logits = x.reshape(-1, 16) @ params["router"]
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

  want, want_dx = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x)
  assert_close(dx, want_dx, GRAD_RTOL, "dx")
  for name, g in fw.params(grads, names).items():
    assert_close(g, want[name], GRAD_RTOL, f"d{name}")


@pytest.mark.parametrize("case, kw", [("softmax", dict(shared_intermediate_size=4)),
                                      ("top1_shared_renorm", dict())])
def test_bf16_compute_dtype(fw, case, kw):
  x = tokens()
  call = fw.jit(lambda m, x: m(x))
  moe = fw.make(case, dtype=jnp.bfloat16, **kw)
  y, _ = call(moe, x)
  params = fw.params(moe, moe.options.param_shapes())
  assert y.dtype == jnp.bfloat16
  assert all(p.dtype == jnp.float32 for p in params.values())  # stored in param_dtype
  assert_close(y.reshape(-1, 16), dense_ref(moe, params, x)[0], BF16_RTOL, "bf16 y")
  moe = fw.make(param_dtype=jnp.bfloat16)
  assert fw.params(moe, ["w_up"])["w_up"].dtype == jnp.bfloat16
  # The compute dtype is promoted from f32 x and bf16 params.
  assert call(moe, x)[0].dtype == jnp.float32


def test_selection_bias_picks_but_does_not_weigh(fw):
  moe = fw.make(selection_bias=True)
  np.testing.assert_array_equal(fw.bias(moe), np.zeros(8))
  names = moe.options.param_shapes()
  x = tokens()
  # A large bias on two experts puts every token on them; their weights stay the scores.
  for hot in ([0, 1], [6, 7]):
    moe = fw.set_bias(moe, jnp.zeros(8).at[jnp.array(hot)].set(10.0))
    y, aux = moe(x)
    np.testing.assert_array_equal(aux.counts, [15 if e in hot else 0 for e in range(8)])
    want = dense_ref(moe, fw.params(moe, names), x, bias=fw.bias(moe))[0]
    assert_close(y.reshape(-1, 16), want, F32_RTOL, f"y biased to {hot}")
  # The update rule: bias += rate * sign(mean(counts) - counts), under jit.
  update = fw.jit(fw.update_bias)
  for bias, counts, rate in [(np.zeros(8), [0, 1, 3, 3, 3, 5, 9, 0], 0.01),  # mean 3
                             (np.arange(8.0), [4, 0, 2, 2, 2, 2, 2, 2], 0.5)]:  # mean 2
    moe = update(fw.set_bias(moe, jnp.asarray(bias, jnp.float32)), jnp.array(counts), rate)
    np.testing.assert_allclose(fw.bias(moe),
                               bias + rate * np.sign(np.mean(counts) - np.asarray(counts)))
  # An optimizer over the trainable parameters moves them and leaves the bias alone.
  before = fw.params(moe, names)
  before_bias = np.asarray(fw.bias(moe))
  moved = fw.optimizer_step(moe, lambda m: m(x)[1].load_balancing_loss)
  np.testing.assert_array_equal(fw.bias(moved), before_bias)
  assert not np.array_equal(fw.params(moved, ["router"])["router"], before["router"])
  with pytest.raises(ValueError, match="selection_bias=False"):
    fw.make().update_bias(jnp.ones(8), 0.1)


@pytest.mark.parametrize("mesh_shape, axis_type, data_axes, T, case", [
    ((4, 2), AxisType.Auto, ("data",), 13, "sigmoid_groups_shared"),  # padded from 13 to 16
    ((8,), AxisType.Explicit, None, 16, "sigmoid_groups_shared"),  # experts only, one a device
    ((2, 4), AxisType.Explicit, None, 15, "softmax"),  # tokens over data x expert, padded to 16
    ((1, 8), AxisType.Auto, None, 24, "softmax"),  # one expert per device
])
def test_sharded_equals_unsharded(fw, mesh_shape, axis_type, data_axes, T, case):
  needs_devices(8)
  names = ("data", "expert")[-len(mesh_shape):]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
  kw = dict(shared_intermediate_size=6, selection_bias=True)
  sharded = fw.make(case, mesh=mesh, expert_axis="expert", data_axes=data_axes, **kw)
  plain = fw.make(case, **kw)
  names = plain.options.param_shapes()
  assert fw.specs(sharded)["w_gate"] == EXPERT_SPEC
  values = fw.params(sharded, names)
  assert values["w_down"].sharding.spec == EXPERT_SPEC
  assert values["router"].sharding.is_fully_replicated
  for name, value in fw.params(plain, names).items():  # same init, only placed differently
    np.testing.assert_array_equal(values[name], value)
  x = tokens((T, 16), seed=3)

  @fw.jit
  def step(m, x):
    def loss(m):
      y, aux = m(x)
      return jnp.sum(y * y) + aux.load_balancing_loss + aux.router_z_loss, (y, aux)
    grads, (y, aux) = fw.grad(loss, has_aux=True)(m)
    return y, aux, grads, fw.update_bias(m, aux.counts, 0.1)

  with jax.set_mesh(mesh):
    y, aux, grads, stepped = step(sharded, x)
  want_y, want_aux, want_grads, want_stepped = step(plain, x)
  assert_close(y, want_y, F32_RTOL, "y")
  np.testing.assert_array_equal(aux.counts, want_aux.counts)
  assert_close(aux.load_balancing_loss, want_aux.load_balancing_loss, F32_RTOL, "lb")
  assert_close(aux.router_z_loss, want_aux.router_z_loss, F32_RTOL, "z")
  want = fw.params(want_grads, names)
  for name, g in fw.params(grads, names).items():
    assert_close(g, want[name], GRAD_RTOL, f"d{name}")
  np.testing.assert_array_equal(fw.bias(stepped), fw.bias(want_stepped))
  w_gate = fw.params(stepped, ["w_gate"])["w_gate"]
  assert w_gate.sharding.is_equivalent_to(NamedSharding(mesh, EXPERT_SPEC), 3)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_stacked_layers_scanned_over_a_mesh(fw, axis_type):
  """Expert-parallel layers stacked by the framework's vmap and run by its scan, as models scan
  their blocks: each stack keeps its experts split (the stacked axis whole), and the loss and
  gradients are those of the same layers unsplit."""
  needs_devices(8)
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  keys = jax.random.split(jax.random.key(0), 3)
  x = tokens((4, 6, 16), seed=5)
  with jax.set_mesh(mesh):
    layers = fw.stack(keys, mesh=mesh, expert_axis="expert")
    names = layers.options.param_shapes()
    split = fw.params(layers, names)
    for name in ("w_gate", "w_up", "w_down"):
      assert split[name].sharding.spec[:2] == (None, "expert"), name
    loss, grads = fw.scan_loss_and_grads(layers, x)
  plain = fw.stack(keys)
  for name, value in fw.params(plain, names).items():  # same init, only placed differently
    np.testing.assert_array_equal(split[name], value)
  want_loss, want_grads = fw.scan_loss_and_grads(plain, x)
  assert_close(loss, want_loss, F32_RTOL, "loss")
  want = fw.params(want_grads, names)
  for name, g in fw.params(grads, names).items():
    assert_close(g, want[name], GRAD_RTOL, f"d{name}")


def test_expert_axis_must_divide_experts(fw):
  needs_devices(8)
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by the size 4"):
    fw.make(num_experts=6, top_k=1, mesh=mesh, expert_axis="expert")
  with pytest.raises(ValueError, match="expert_axis must name an axis"):
    fw.make(mesh=mesh, expert_axis="experts")
  with pytest.raises(ValueError, match="data_axes"):
    fw.make(mesh=mesh, expert_axis="expert", data_axes=("expert",))
  with pytest.raises(ValueError, match="num_experts=12 is not divisible by the size 8"):
    fw.make(num_experts=12, mesh=jax.make_mesh((8,), ("expert",)), expert_axis="expert")


def test_checkpoint_round_trip(fw, tmp_path):
  moe = fw.make("sigmoid_groups_shared", selection_bias=True)
  moe = fw.set_bias(moe, jnp.arange(8.0) / 10)
  x = tokens()
  want_y, _ = moe(x)
  fw.save(moe, tmp_path / "moe")
  restored = fw.restore(tmp_path / "moe",
                        lambda: fw.make("sigmoid_groups_shared", seed=7, selection_bias=True))
  np.testing.assert_array_equal(fw.bias(restored), fw.bias(moe))
  np.testing.assert_array_equal(restored(x)[0], want_y)


def test_backend_and_config_reach_moe(fw, monkeypatch):
  seen = []

  def spy(*args, **kwargs):
    seen.append(kwargs)
    return real(*args, **{**kwargs, "backend": "xla"})

  real = mok_jax.moe
  monkeypatch.setattr(mok_jax, "moe", spy)
  config = mok_jax.Config(block_m=4)
  fw.make(backend="ffi", config=config)(tokens())
  assert seen[0]["backend"] == "ffi" and seen[0]["config"] is config


def test_ffi_backend_expert_parallel(fw):
  """The C++ FFI target on CPU (the CUDA kernel's twin) inside the layer's shard_map."""
  needs_devices(4)
  mesh = jax.make_mesh((4,), ("expert",))
  kw = dict(mesh=mesh, expert_axis="expert", config=mok_jax.Config(block_m=4))
  ffi = fw.make("sigmoid_groups_shared", backend="ffi", **kw)
  xla = fw.make("sigmoid_groups_shared", backend="xla")
  x = tokens()
  loss = lambda m: jnp.sum(m(x)[0] ** 2)  # noqa: E731
  g_ffi, g_xla = fw.jit(fw.grad(loss))(ffi), fw.jit(fw.grad(loss))(xla)
  assert_close(ffi(x)[0], xla(x)[0], F32_RTOL, "ffi vs xla y")
  names = xla.options.param_shapes()
  want = fw.params(g_xla, names)
  for name, g in fw.params(g_ffi, names).items():
    assert_close(g, want[name], GRAD_RTOL, f"d{name}")


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
def test_invalid_options(fw, kw, message):
  with pytest.raises(ValueError, match=message):
    fw.make(**kw)


def test_wrong_hidden_size(fw):
  with pytest.raises(ValueError, match="hidden_size=16"):
    fw.make()(jnp.zeros((4, 12)))


def test_importing_nn_does_not_import_frameworks(fw):
  """`import mok_jax.nn` imports neither framework; the first use of a layer imports its own."""
  name = type(fw).__name__.lower()
  code = ("import sys, mok_jax.nn; "
          "assert 'flax' not in sys.modules and 'equinox' not in sys.modules, 'eager import'; "
          f"mok_jax.nn.{name}.MoE; assert '{name}' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)
