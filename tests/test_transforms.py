"""The FFI backends under every transform that training applies: `lax.scan` over stacked layers
(also scanned and rematerialised by Flax NNX, stacked by Equinox), `jax.checkpoint` policies,
`vmap` of `grad` and `grad` of `vmap`, donated buffers, two layers in one program. Each gives
the loss and gradients of backend="xla" in the same program. The CPU target (f32) runs in CI;
the CUDA target (bf16) is marked `gpu`.

Also here: the CUDA backward reads nothing that neither it nor the forward's residuals define.
Its padding rows of gu and the rows past offsets[E] of gu and xs are poisoned with NaN between
the forward and the backward, and the device's free memory is filled with NaN before each
call; the gradients must keep their bits."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import ops
from cases import BF16, F32, GRAD_RTOL, assert_close, bits, make_case


class Shape(NamedTuple):
  L: int  # layers
  T: int
  H: int
  I: int
  E: int
  k: int
  Is: int


# The CUDA shape is the one a scan made NaN (4 layers, T=512, H=I=256, E=16, k=4), with a shared
# expert.
CUDA_SHAPE = Shape(4, 512, 256, 256, 16, 4, 128)
CPU_SHAPE = Shape(3, 32, 16, 8, 4, 2, 8)
TARGETS = [pytest.param("ffi", F32, CPU_SHAPE, id="ffi-f32"),
           pytest.param("cuda", BF16, CUDA_SHAPE, marks=pytest.mark.gpu, id="cuda-bf16")]
# Through L layers the bf16 differences of the two backends stay within one layer's tolerance
# on these shapes (the gradients are compared relative to their largest magnitude).
MODEL_RTOL = GRAD_RTOL


def init_params(s: Shape, dtype, seed=0) -> dict:
  rng = np.random.default_rng(seed)

  def normal(*shape, fan_in):
    return jnp.asarray(rng.standard_normal((s.L, *shape)) / np.sqrt(fan_in), dtype)

  return dict(router=normal(s.H, s.E, fan_in=s.H), w_gate=normal(s.E, s.H, s.I, fan_in=s.H),
              w_up=normal(s.E, s.H, s.I, fan_in=s.H), w_down=normal(s.E, s.I, s.H, fan_in=s.I),
              ws_gate=normal(s.H, s.Is, fan_in=s.H), ws_up=normal(s.H, s.Is, fan_in=s.H),
              ws_down=normal(s.Is, s.H, fan_in=s.Is))


def tokens(s: Shape, dtype, batch=(), seed=1):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((*batch, s.T, s.H)), dtype)


def layer(h, p, *, k, backend, config=None):
  experts, weights = mok_jax.route(h.astype(jnp.float32) @ p["router"].astype(jnp.float32), k)
  y = mok_jax.moe(h, experts, weights, p["w_gate"], p["w_up"], p["w_down"],
                  shared=(p["ws_gate"], p["ws_up"], p["ws_down"]), config=config,
                  backend=backend)
  return h + y


def loss_of(h):
  return jnp.mean(jnp.square(h.astype(jnp.float32)))


def scan_loss(params, x, *, k, backend, config=None, policy=None):
  """Layers stacked on a leading axis, run by lax.scan; each under jax.checkpoint(policy) if
  a policy is given."""
  step = functools.partial(layer, k=k, backend=backend, config=config)
  if policy is not None:
    step = jax.checkpoint(step, policy=policy)
  h, _ = jax.lax.scan(lambda h, p: (step(h, p), None), x, params)
  return loss_of(h)


def assert_same_model(got, want, what):
  """(loss, gradient pytree) of two backends: the loss to MODEL_RTOL, every gradient finite and
  close relative to its largest magnitude."""
  (loss, grads), (want_loss, want_grads) = got, want
  dtype = jnp.dtype(jax.tree.leaves(want_grads)[0].dtype)
  rtol = MODEL_RTOL[dtype]
  assert np.asarray(loss) == pytest.approx(np.asarray(want_loss), rel=rtol), f"{what}: loss"
  flat, want_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(want_grads)
  assert [p for p, _ in flat] == [p for p, _ in want_flat], what
  for (path, g), (_, w) in zip(flat, want_flat):
    name = f"{what}: d{jax.tree_util.keystr(path)}"
    g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g32).all(), f"{name}: {np.sum(~np.isfinite(g32))} non-finite"
    assert np.any(w32 != 0), f"{name}: no gradient reaches it"
    assert_close(g32, w32, rtol, name)


def both_backends(fn, backend, *args):
  """fn(backend) jitted and applied to args, for `backend` and for "xla"."""
  return [jax.jit(fn(b))(*args) for b in (backend, "xla")]


CONFIGS = [mok_jax.Config(), mok_jax.Config(block_m=128), mok_jax.Config(recompute=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_scan_over_layers(backend, dtype, s, config):
  params, x = init_params(s, dtype), tokens(s, dtype)
  fn = lambda b: jax.value_and_grad(
      functools.partial(scan_loss, k=s.k, backend=b, config=config), argnums=(0, 1))
  got, want = both_backends(fn, backend, params, x)
  assert_same_model(got, want, f"{backend} scan {config}")


POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_checkpointed_scan(backend, dtype, s, policy):
  params, x = init_params(s, dtype), tokens(s, dtype)
  fn = lambda b: jax.value_and_grad(
      functools.partial(scan_loss, k=s.k, backend=b, policy=POLICIES[policy]))
  got, want = both_backends(fn, backend, params, x)
  assert_same_model(got, want, f"{backend} checkpoint({policy})")


def one_layer(s: Shape, dtype):
  return jax.tree.map(lambda a: a[0], init_params(s, dtype))


# backend="xla" cannot be vmapped with unbatched expert weights (jax.lax.ragged_dot's batching
# rule, README): its side of the vmap tests maps the batch with lax.map instead.
def batched(f, backend):
  return jax.vmap(f) if backend != "xla" else lambda xs: jax.lax.map(f, xs)


@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_vmap_of_grad(backend, dtype, s):
  """Per-example gradients: each batch element its own call and its own weight gradients."""
  p, xs = one_layer(s, dtype), tokens(s, dtype, batch=(2,))
  fn = lambda b: lambda p, xs: batched(lambda x: jax.value_and_grad(
      lambda p, x: loss_of(layer(x, p, k=s.k, backend=b)), argnums=(0, 1))(p, x), b)(xs)
  got, want = both_backends(fn, backend, p, xs)
  assert_same_model(got, want, f"{backend} vmap(grad)")


@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_grad_of_vmap(backend, dtype, s):
  p, xs = one_layer(s, dtype), tokens(s, dtype, batch=(2,))
  fn = lambda b: jax.value_and_grad(
      lambda p, xs: jnp.sum(batched(lambda x: loss_of(layer(x, p, k=s.k, backend=b)), b)(xs)),
      argnums=(0, 1))
  got, want = both_backends(fn, backend, p, xs)
  assert_same_model(got, want, f"{backend} grad(vmap)")


def sgd_step(params, x, *, k, backend):
  loss, grads = jax.value_and_grad(functools.partial(scan_loss, k=k, backend=backend))(params, x)
  return loss, jax.tree.map(lambda p, g: p - 1e-3 * jnp.sign(g).astype(p.dtype), params, grads)


@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_donated_train_steps(backend, dtype, s):
  """Three SGD steps of a scanned model whose parameters are donated to each step (XLA reuses
  their buffers for the new ones): the losses and parameters of backend="xla"."""
  x = tokens(s, dtype)
  result = {}
  for b in (backend, "xla"):
    step = jax.jit(functools.partial(sgd_step, k=s.k, backend=b), donate_argnums=0)
    params, losses = init_params(s, dtype), []
    for _ in range(3):
      loss, params = step(params, x)
      losses.append(float(loss))
    result[b] = (losses, params)
  (losses, params), (want_losses, want_params) = result[backend], result["xla"]
  rtol = MODEL_RTOL[jnp.dtype(dtype)]
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
  assert losses == pytest.approx(want_losses, rel=rtol)
  for name in want_params:
    assert_close(np.asarray(params[name], np.float32), np.asarray(want_params[name], np.float32),
                 rtol, f"{backend} donated: {name}")


@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_two_layers_in_one_program(backend, dtype, s):
  """Two layers of different shapes (experts, width, block_m) in one program, the second on
  the first's output: they share nothing but the stream."""
  p1 = one_layer(s, dtype)
  s2 = s._replace(E=2 * s.E, I=s.I // 2)
  p2 = jax.tree.map(lambda a: a[0], init_params(s2, dtype, seed=3))
  x = tokens(s, dtype)

  def fn(b):
    def loss(p1, p2, x):
      h = layer(x, p1, k=s.k, backend=b)
      return loss_of(layer(h, p2, k=s2.k, backend=b, config=mok_jax.Config(block_m=128)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))

  got, want = both_backends(fn, backend, p1, p2, x)
  assert_same_model(got, want, f"{backend} two layers")


@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_flax_nnx_scan_and_remat(backend, dtype, s):
  from flax import nnx
  from mok_jax.nn.flax import MoE

  def run(b):
    @nnx.vmap(in_axes=0, out_axes=0)
    def build(key):
      return MoE(s.H, s.I, s.E, s.k, shared_intermediate_size=s.Is, param_dtype=dtype,
                 backend=b, rngs=nnx.Rngs(key))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def blocks(h, block):
      y, _ = block(h)
      return h + y

    @nnx.jit
    def step(layers, x):
      return nnx.value_and_grad(lambda layers: loss_of(blocks(x, layers)))(layers)

    layers = build(jax.random.split(jax.random.key(0), s.L))
    loss, grads = step(layers, tokens(s, dtype))
    return loss, nnx.to_pure_dict(nnx.state(grads, nnx.Param))

  assert_same_model(run(backend), run("xla"), f"{backend} nnx.scan(nnx.remat)")


@pytest.mark.parametrize("backend,dtype,s", TARGETS)
def test_equinox_filter_vmap_stack_scanned(backend, dtype, s):
  import equinox as eqx
  from mok_jax.nn.equinox import MoE

  def run(b):
    keys = jax.random.split(jax.random.key(0), s.L)
    layers = eqx.filter_vmap(lambda key: MoE(s.H, s.I, s.E, s.k, shared_intermediate_size=s.Is,
                                             param_dtype=dtype, backend=b, key=key))(keys)
    params, static = eqx.partition(layers, eqx.is_array)

    @jax.jit
    def step(params, x):
      def loss(params):
        def block(h, p):
          y, _ = eqx.combine(p, static)(h)
          return h + y, None
        return loss_of(jax.lax.scan(block, x, params)[0])
      return jax.value_and_grad(loss)(params)

    loss, grads = step(params, tokens(s, dtype))
    return loss, {n: getattr(grads, n) for n in layers.options.param_shapes()}

  assert_same_model(run(backend), run("xla"), f"{backend} eqx.filter_vmap + scan")


# --- What the CUDA backward reads -------------------------------------------------------------

POISON_CASES = [
    # T, H, I, E, k, Is, block_m: tile tails, a shared expert; many experts (one without
    # routes) and half tiles.
    (300, 128, 192, 8, 3, 64, 128),
    (700, 256, 128, 64, 4, 0, 64),
]


def fill_free_memory_with_nan(fraction=0.5):
  """Allocates NaN over `fraction` of the device's free memory and frees it again: the next
  calls get those bytes back from XLA's allocator for their buffers and scratch."""
  stats = jax.devices()[0].memory_stats() or {}
  free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
  n = max(int(free * fraction) // 2, 1 << 20)
  jax.block_until_ready(jnp.full((n,), jnp.nan, jnp.bfloat16)).delete()


def routing_with_an_idle_expert(T, E, k, seed):
  rng = np.random.default_rng(seed)
  ids = np.argsort(rng.random((T, E - 1)), axis=1)[:, :k]
  return np.where(ids >= E // 2, ids + 1, ids).astype(np.int32)  # expert E // 2 gets no route


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k,Is,block_m", POISON_CASES)
def test_backward_reads_only_defined_rows(T, H, I, E, k, Is, block_m):
  case = make_case(T, H, I, E, k, Is=Is, dtype=BF16, seed=T,
                   experts=routing_with_an_idle_expert(T, E, k, seed=T))
  args = (case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down,
          case.shared)
  dy = case.dy.astype(BF16)
  fwd = jax.jit(functools.partial(ops.moe_fwd, out_dtype=BF16, block_m=block_m))
  bwd = jax.jit(functools.partial(ops.moe_bwd, block_m=block_m))
  fill_free_memory_with_nan()
  y, res = fwd(*args)
  rows, offsets = np.asarray(res.rows), np.asarray(res.offsets)
  used = int(offsets[-1])
  padding = np.flatnonzero(rows[:used] < 0)
  assert padding.size and used < rows.size, "the case has padding rows and a tail"
  # The forward's contract: xs holds each route's token row and zeros in its padding rows.
  xs = np.asarray(res.xs, np.float32)
  assert not xs[padding].any(), "padding rows of xs are not zero"
  live = rows[:used] >= 0
  np.testing.assert_array_equal(
      xs[:used][live], np.asarray(case.x, np.float32)[rows[:used][live] // k])

  fill_free_memory_with_nan()
  want = jax.tree.map(np.asarray, bwd(dy, *args, res))
  nan = jnp.asarray(np.nan, BF16)
  poisoned = res._replace(gu=res.gu.at[padding].set(nan).at[used:].set(nan),
                          xs=res.xs.at[used:].set(nan))
  fill_free_memory_with_nan()
  got = jax.tree.map(np.asarray, bwd(dy, *args, poisoned))
  for name, g, w in zip(ops.Grads._fields, got, want):
    for i, (gi, wi) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(w))):
      assert np.isfinite(gi.astype(np.float32)).all(), f"d{name}[{i}] not finite"
      assert bits(gi) == bits(wi), f"d{name}[{i}]: poisoned rows changed it"
  # The idle expert's weight gradients are written zeros, not whatever the buffer held.
  idle = E // 2
  for name in ("w_gate", "w_up", "w_down"):
    assert not np.asarray(getattr(got, name)[idle], np.float32).any(), f"d{name}[idle]"
