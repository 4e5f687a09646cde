"""`mok_jax.moe` on inputs with explicit shardings (jax.sharding.AxisType.Explicit), no
shard_map of the caller's: tokens split over mesh axes run where they are, with no gather of x
(data parallelism), and expert stacks split over an axis run the layer's expert parallelism.
y comes back sharded as x."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mok_jax
from cases import (CPU_BACKENDS, F32, GRAD_NAMES, GRAD_RTOL, RTOL, assert_close, bits,
                   loss_and_grads, make_case)


def explicit_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


def place(mesh, a, spec):
  return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))


def put(case, mesh, x_spec, w_spec):
  """The case's arrays placed: the per-token ones by x_spec, the expert stacks by w_spec, the
  shared expert replicated."""
  at = functools.partial(place, mesh)
  return case._replace(
      x=at(case.x, x_spec), experts=at(case.experts, x_spec), weights=at(case.weights, x_spec),
      w_gate=at(case.w_gate, w_spec), w_up=at(case.w_up, w_spec), w_down=at(case.w_down, w_spec),
      shared=case.shared and tuple(at(a, P()) for a in case.shared), dy=at(case.dy, x_spec))


def forward_and_grads(case, backend):
  """jit of y and the gradients of sum(dy * y) w.r.t. x, weights and every weight tensor."""

  def loss(x, experts, weights, w_gate, w_up, w_down, shared, dy):
    y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared, backend=backend)
    return jnp.sum(y.astype(jnp.float32) * dy), y

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5, 6), has_aux=True))
  args = (case.x, case.experts, case.weights, case.w_gate, case.w_up, case.w_down, case.shared,
          case.dy)
  (_, y), grads = f(*args)
  named = dict(zip(GRAD_NAMES, (*grads[:5], *(grads[5] or ()))))
  return y, named, f.lower(*args).compile().as_text()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_data_parallel_tokens_stay_where_they_are(backend):
  case = make_case(T=32, H=16, I=8, E=4, k=2, Is=8, dtype=F32, seed=3)
  mesh = explicit_mesh((8,), ("data",))
  y, grads, hlo = forward_and_grads(put(case, mesh, P("data"), P()), backend)
  assert "all-gather" not in hlo, "x or its routes were gathered"
  assert y.sharding.spec[0] == "data"
  want_y, want = loss_and_grads(case, backend)
  if backend == "ffi":  # each token's output and input gradients come from its rows alone
    assert bits(y) == bits(want_y)
    assert bits(grads["x"]) == bits(want["x"])
    assert bits(grads["weights"]) == bits(want["weights"])
  assert_close(y, want_y, RTOL[F32], "y")
  for name in GRAD_NAMES:  # weight gradients: the shards' partial sums, summed across them
    assert_close(grads[name], want[name], GRAD_RTOL[F32], f"d{name}")


@pytest.mark.parametrize("shape,names,x_spec,T,Is", [
    ((4, 2), ("data", "expert"), P("data"), 20, 8),  # tokens over both, 20 padded to 24
    ((8,), ("ep",), P("ep"), 32, 8),  # tokens and experts over the same axis
    ((8,), ("ep",), P(), 32, None),  # tokens replicated, no shared expert
])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_expert_stacks_split_over_an_axis(backend, shape, names, x_spec, T, Is):
  """Experts over the last axis: the layer splits the tokens over it too (where x is not) and
  hands y back split as x was."""
  case = make_case(T=T, H=16, I=8, E=8, k=2, Is=Is, dtype=F32, seed=4)
  mesh = explicit_mesh(shape, names)
  y, grads, _ = forward_and_grads(put(case, mesh, x_spec, P(names[-1])), backend)
  assert y.shape == case.x.shape and y.sharding.spec[0] == (x_spec[0] if x_spec else None)
  want_y, want = loss_and_grads(case, backend)
  assert_close(y, want_y, RTOL[F32], "y")
  assert grads.keys() == want.keys()
  for name in want:
    assert_close(grads[name], want[name], GRAD_RTOL[F32], f"d{name}")


@pytest.mark.parametrize("x_spec,w_spec,shared_spec,match", [
    (P(None, "data"), P(), P(), "x is sharded as"),
    (P("data"), P(None, None, "data"), P(), "w_gate is sharded as"),
    (P("data"), P(), P("data"), "ws_gate is sharded as"),
    (P("data"), P(("data", "expert")), P(), "over several mesh axes"),
])
def test_shardings_the_layer_would_have_to_gather(x_spec, w_spec, shared_spec, match):
  case = make_case(T=32, H=16, I=8, E=8, k=2, Is=8, dtype=F32)
  mesh = explicit_mesh((4, 2), ("data", "expert"))
  placed = put(case, mesh, P("data"), w_spec)._replace(
      x=place(mesh, case.x, x_spec),
      shared=tuple(place(mesh, a, shared_spec) for a in case.shared))
  with pytest.raises(ValueError, match=match):
    forward_and_grads(placed, "ffi")


def test_expert_stacks_split_differently():
  case = make_case(T=32, H=16, I=8, E=8, k=2, dtype=F32)
  mesh = explicit_mesh((4, 2), ("data", "expert"))
  specs = (P("data"), P("data"), P("data"), P("expert"), P("data"), P("expert"))
  x, experts, weights, w_gate, w_up, w_down = map(functools.partial(place, mesh), case.args(),
                                                  specs)
  with pytest.raises(ValueError, match="split their experts over different axes"):
    jax.jit(mok_jax.moe)(x, experts, weights, w_gate, w_up, w_down)


def test_eager_call_places_itself_too():
  case = make_case(T=32, H=16, I=8, E=4, k=2, Is=8, dtype=F32, seed=5)
  placed = put(case, explicit_mesh((8,), ("data",)), P("data"), P())
  y = mok_jax.moe(*placed.args(), shared=placed.shared, backend="ffi")
  assert y.sharding.spec[0] == "data"
  assert bits(y) == bits(mok_jax.moe(*case.args(), shared=case.shared, backend="ffi"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_only_the_routing_split(backend):
  """x replicated, its routing split over "data": the tokens are split by the routing's axes
  (the xla backend's sort would otherwise see a split token axis), y replicated as x."""
  case = make_case(T=32, H=16, I=8, E=4, k=2, Is=8, dtype=F32, seed=6)
  mesh = explicit_mesh((8,), ("data",))
  placed = put(case, mesh, P("data"), P())._replace(x=place(mesh, case.x, P()))
  y = jax.jit(mok_jax.moe, static_argnames="backend")(*placed.args(), shared=placed.shared,
                                                      backend=backend)
  assert y.sharding.spec[0] is None
  assert_close(y, mok_jax.moe(*case.args(), shared=case.shared, backend=backend), RTOL[F32])


def test_vmap_over_a_split_batch_axis():
  """Under vmap the batch axis is not an input of moe's; split over "data", the folded call
  still runs each shard's tokens where they are (no all-gather) and y keeps the split."""
  cases = [make_case(T=16, H=16, I=8, E=4, k=2, dtype=F32, seed=s) for s in range(4)]
  mesh = explicit_mesh((4,), ("data",))
  c = cases[0]
  stacked = [place(mesh, jnp.stack([jnp.asarray(getattr(b, n)) for b in cases]), P("data"))
             for n in ("x", "experts", "weights")]
  f = jax.jit(jax.vmap(lambda x, e, w: mok_jax.moe(x, e, w, c.w_gate, c.w_up, c.w_down,
                                                   backend="ffi")))
  ys = f(*stacked)
  assert "all-gather" not in f.lower(*stacked).compile().as_text()
  assert ys.sharding.spec[0] == "data"
  ys = np.asarray(ys)
  for b, case in enumerate(cases):
    alone = mok_jax.moe(case.x, case.experts, case.weights, c.w_gate, c.w_up, c.w_down,
                        backend="ffi")
    assert bits(ys[b]) == bits(alone), f"element {b}"


@pytest.mark.parametrize("kwargs", [
    {}, {"score": "sigmoid", "n_groups": 4, "topk_groups": 2, "bias": np.linspace(0, 1, 16)},
], ids=["softmax", "sigmoid_groups_bias"])
def test_route_keeps_split_tokens_where_they_are(kwargs):
  """route on logits split over tokens: the same experts and weights, and no gather of the
  logits (which jax.lax.top_k on split rows makes XLA do on CPU)."""
  logits = np.random.default_rng(7).standard_normal((64, 16)).astype(np.float32)
  split = place(explicit_mesh((8,), ("data",)), logits, P("data"))
  f = jax.jit(lambda l: mok_jax.route(l, 4, **kwargs))
  assert "all-gather" not in f.lower(split).compile().as_text()
  (experts, weights), (want_e, want_w) = f(split), mok_jax.route(logits, 4, **kwargs)
  assert experts.sharding.spec[0] == "data"
  assert bits(experts) == bits(want_e) and bits(weights) == bits(want_w)
  eager = mok_jax.route(split, 4, **kwargs)
  assert bits(eager[0]) == bits(want_e)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replicated_on_an_explicit_mesh(backend):
  """Every input replicated on a mesh with Explicit axes (what jax.set_mesh makes of new
  arrays): the layer runs as unplaced, although jax.lax.ragged_dot has no sharding rule."""
  case = make_case(T=24, H=16, I=8, E=4, k=2, Is=8, dtype=F32, seed=8)
  mesh = explicit_mesh((4,), ("data",))
  with jax.set_mesh(mesh):
    y, grads, _ = forward_and_grads(put(case, mesh, P(), P()), backend)
  want_y, want = loss_and_grads(case, backend)
  assert bits(y) == bits(want_y)
  for name in GRAD_NAMES:
    assert_close(grads[name], want[name], GRAD_RTOL[F32], f"d{name}")


def test_vmap_over_split_tokens():
  """Under vmap, each element's tokens split over "data": the call runs them where they are
  (vmap of the layer's shard_map) and y keeps the split. (A batch axis split too would be
  gathered: vmap of shard_map treats the batch as whole.)"""
  cases = [make_case(T=16, H=16, I=8, E=4, k=2, dtype=F32, seed=s) for s in range(4)]
  mesh = explicit_mesh((4,), ("data",))
  c = cases[0]
  stacked = [place(mesh, jnp.stack([jnp.asarray(getattr(b, n)) for b in cases]), P(None, "data"))
             for n in ("x", "experts", "weights")]
  f = jax.jit(jax.vmap(lambda x, e, w: mok_jax.moe(x, e, w, c.w_gate, c.w_up, c.w_down,
                                                   backend="ffi")))
  ys = f(*stacked)
  hlo = f.lower(*stacked).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo, "rows moved between devices"
  assert tuple(ys.sharding.spec)[:2] == (None, "data")
  ys = np.asarray(ys)
  for b, case in enumerate(cases):
    alone = mok_jax.moe(case.x, case.experts, case.weights, c.w_gate, c.w_up, c.w_down,
                        backend="ffi")
    assert bits(ys[b]) == bits(alone), f"element {b}"
