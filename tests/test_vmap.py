"""`jax.vmap` over `mok_jax.moe` with the FFI targets (README, Usage). Not differentiated, the
batch goes into the token dimension (one call) and each element gets the bits of its own call;
differentiated, each element is a call of its own (`vmap_method="sequential"`) and its weight
gradients are its own until JAX sums them. The CPU targets run in CI; the CUDA target's cases
are marked `gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from cases import BF16, F32, GRAD_RTOL, assert_close, bits, make_case

B = 3

# (backend, dtype): the CUDA target takes bf16 only.
TARGETS = [("ffi", F32), ("ffi", BF16), pytest.param("cuda", BF16, marks=pytest.mark.gpu)]


def batch(dtype):
  """B cases of one shape that share the expert weights (and a shared expert): x, experts,
  weights and dy stacked on a leading axis; the weights of the first case."""
  cases = [make_case(T=20, H=64, I=64, E=4, k=2, Is=64, dtype=dtype, seed=s) for s in range(B)]
  stack = lambda name: jnp.stack([jnp.asarray(getattr(c, name)) for c in cases])
  return cases[0], stack("x"), stack("experts"), stack("weights"), stack("dy")


def loss_of(backend):
  def loss(x, experts, weights, w_gate, w_up, w_down, shared, dy):
    y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared, backend=backend)
    return jnp.sum(y.astype(jnp.float32) * dy)
  return loss


ARGNUMS = (0, 2, 3, 4, 5, 6)  # x, weights, w_gate, w_up, w_down, shared
EACH = (0, 0, 0, None, None, None, None, 0)  # the batched arguments of `loss`


@pytest.mark.parametrize("backend,dtype", TARGETS, ids=str)
def test_vmap_gives_each_elements_bits_in_one_call(backend, dtype):
  c, xs, es, ws, _ = batch(dtype)
  f = lambda x, e, w: mok_jax.moe(x, e, w, c.w_gate, c.w_up, c.w_down, shared=c.shared,
                                  backend=backend)
  batched = jax.jit(jax.vmap(f))
  program = batched.lower(xs, es, ws).as_text()
  assert program.count("@mok_moe_fwd") == 1 and "while" not in program, "not one call"
  ys = batched(xs, es, ws)
  assert ys.shape == xs.shape
  for b in range(B):
    assert bits(ys[b]) == bits(f(xs[b], es[b], ws[b])), f"element {b}"


@pytest.mark.parametrize("backend,dtype", TARGETS, ids=str)
def test_vmap_over_weights_too(backend, dtype):
  """A batch of expert weights (each element its own experts): a call per element."""
  c, xs, es, ws, _ = batch(dtype)
  scale = jnp.asarray([1.0, 0.5, 2.0], dtype)[:, None, None, None]
  w_ups = c.w_up[None] * scale
  f = lambda x, e, w, w_up: mok_jax.moe(x, e, w, c.w_gate, w_up, c.w_down, shared=c.shared,
                                        backend=backend)
  ys = jax.jit(jax.vmap(f))(xs, es, ws, w_ups)
  for b in range(B):
    assert bits(ys[b]) == bits(f(xs[b], es[b], ws[b], w_ups[b])), f"element {b}"


@pytest.mark.parametrize("backend,dtype", TARGETS, ids=str)
def test_per_element_gradients_under_vmap(backend, dtype):
  """vmap(grad): every gradient, weight gradients included, is each element's own."""
  c, xs, es, ws, dys = batch(dtype)
  g = jax.grad(loss_of(backend), argnums=ARGNUMS)
  batched = jax.jit(jax.vmap(g, in_axes=EACH))(xs, es, ws, c.w_gate, c.w_up, c.w_down,
                                               c.shared, dys)
  for b in range(B):
    own = g(xs[b], es[b], ws[b], c.w_gate, c.w_up, c.w_down, c.shared, dys[b])
    got = jax.tree.map(lambda a: a[b], batched)
    assert [bits(a) for a in jax.tree.leaves(got)] == [bits(a) for a in jax.tree.leaves(own)]


@pytest.mark.parametrize("backend,dtype", TARGETS, ids=str)
def test_gradients_of_a_vmapped_loss(backend, dtype):
  """grad(vmap): x's and the route weights' gradients are each element's bits; the expert
  weights' are the sum of the elements' (each rounded to the dtype first, then summed by JAX)."""
  c, xs, es, ws, dys = batch(dtype)
  loss = loss_of(backend)
  total = lambda *a: jnp.sum(jax.vmap(loss, in_axes=EACH)(*a))
  got = jax.jit(jax.grad(total, argnums=ARGNUMS))(xs, es, ws, c.w_gate, c.w_up, c.w_down,
                                                  c.shared, dys)
  own = [jax.grad(loss, argnums=ARGNUMS)(xs[b], es[b], ws[b], c.w_gate, c.w_up, c.w_down,
                                         c.shared, dys[b]) for b in range(B)]
  for b in range(B):
    assert bits(got[0][b]) == bits(own[b][0]), f"dx of element {b}"
    assert bits(got[1][b]) == bits(own[b][1]), f"dweights of element {b}"
  summed = jax.tree.map(lambda *g: np.sum([np.asarray(a, np.float64) for a in g], axis=0),
                        *[o[2:] for o in own])
  for name, a, e in zip(("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"),
                        jax.tree.leaves(got[2:]), jax.tree.leaves(summed)):
    assert_close(a, e, GRAD_RTOL[dtype], f"d{name}")
