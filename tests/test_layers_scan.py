"""jit + grad of a model that applies route + moe in jax.lax.scan over stacked layer weights:
both CPU backends agree, and the scan equals the same layers unrolled in Python."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from cases import F32_RTOL, assert_close

L, T, H, I, E, K, IS = 3, 16, 16, 8, 4, 2, 8
# The f32 tolerance holds through three layers (the largest difference seen is 1.7e-6).
MODEL_RTOL = F32_RTOL


def init_params(seed=0):
  rng = np.random.default_rng(seed)

  def normal(*shape, fan_in):
    return jnp.asarray(rng.standard_normal((L, *shape)) / np.sqrt(fan_in), jnp.float32)

  return dict(router=normal(H, E, fan_in=H), w_gate=normal(E, H, I, fan_in=H),
              w_up=normal(E, H, I, fan_in=H), w_down=normal(E, I, H, fan_in=I),
              ws_gate=normal(H, IS, fan_in=H), ws_up=normal(H, IS, fan_in=H),
              ws_down=normal(IS, H, fan_in=IS))


def layer(h, p, backend):
  experts, weights = mok_jax.route(h @ p["router"], K)
  y = mok_jax.moe(h, experts, weights, p["w_gate"], p["w_up"], p["w_down"],
                  shared=(p["ws_gate"], p["ws_up"], p["ws_down"]), backend=backend,
                  config=mok_jax.Config(block_m=4))
  return h + y


def loss_scan(params, x, target, backend):
  h, _ = jax.lax.scan(lambda h, p: (layer(h, p, backend), None), x, params)
  return jnp.mean((h - target) ** 2)


def loss_unrolled(params, x, target, backend):
  h = x
  for i in range(L):
    h = layer(h, jax.tree.map(lambda a: a[i], params), backend)
  return jnp.mean((h - target) ** 2)


@functools.cache
def loss_and_grads(model, backend):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  target = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  f = jax.jit(jax.value_and_grad(functools.partial(model, backend=backend), argnums=(0, 1)))
  loss, (dparams, dx) = f(init_params(), x, target)
  return float(loss), {"x": np.asarray(dx), **{k: np.asarray(v) for k, v in dparams.items()}}


def assert_same_model(got, want, what):
  assert got[0] == pytest.approx(want[0], rel=MODEL_RTOL), f"{what}: loss"
  assert got[1].keys() == want[1].keys()
  for name in want[1]:
    assert np.all(np.isfinite(got[1][name])), f"{what}: d{name}"
    assert_close(got[1][name], want[1][name], MODEL_RTOL, f"{what}: d{name}")


def test_scan_backends_agree():
  xla, ffi = loss_and_grads(loss_scan, "xla"), loss_and_grads(loss_scan, "ffi")
  # Every parameter receives a gradient, the router's through the routing weights.
  assert all(np.any(g != 0) for g in xla[1].values())
  assert_same_model(ffi, xla, "scan ffi vs xla")


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_scan_equals_unrolled_layers(backend):
  assert_same_model(loss_and_grads(loss_scan, backend), loss_and_grads(loss_unrolled, backend),
                    f"{backend} scan vs unrolled")


def loss_scan_remat(params, x, target, backend, policy):
  step = jax.checkpoint(lambda h, p: (layer(h, p, backend), None), policy=policy)
  h, _ = jax.lax.scan(step, x, params)
  return jnp.mean((h - target) ** 2)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "everything_saveable"])
@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_scan_under_checkpoint(backend, policy):
  """jax.checkpoint of each layer (remat, as models wrap their blocks), with policies that keep
  nothing, the dots or everything: the model's loss and gradients stay those of the scan."""
  model = functools.partial(loss_scan_remat, policy=getattr(jax.checkpoint_policies, policy))
  assert_same_model(loss_and_grads(model, backend), loss_and_grads(loss_scan, backend),
                    f"{backend} checkpointed ({policy}) vs plain scan")
