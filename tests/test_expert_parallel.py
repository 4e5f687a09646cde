"""Expert parallelism on CPU devices (mok_jax.expert_parallel): mok_jax.moe inside
jax.shard_map with axis_name, experts and tokens sharded over the same mesh axis, gives the
single-device layer's bits for y and every gradient on the `ffi` backend (the shared expert's
weight gradients, which ranks sum as data parallelism does, to rounding) and its results to
rounding on the `xla` backend, for EP sizes 1, 2, 4 and 8, f32 and bf16, random and adversarial
routing."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
import oracle
from mok_jax import expert_parallel
from cases import (BF16, CPU_BACKENDS, F32, F32_RTOL, assert_close, assert_ep_bits,
                   assert_grads_close, assert_same_bits, distinct_experts, loss_and_grads,
                   make_case, mesh_of, sharded_grad_fn, sharded_loss_and_grads)

T, H, I, E, K, IS = 24, 16, 8, 8, 3, 8  # T and E divide by every EP size up to 8
OUT_OF_RANGE = (-1, E, 2**31 - 1)


def routing(name, seed=0):
  """(T, K) global ids: "random" (distinct ids a token, three out of range on the first,
  middle and last rank's tokens), "one_rank" (every route to the last rank's experts: the
  other ranks receive nothing), "one_expert" (every route of every token to expert 1, k
  times), "sparse" (most routes out of range, so that most ranks send nothing)."""
  rng = np.random.default_rng(seed)
  if name == "random":
    experts = distinct_experts(rng, T, K, E)
    experts[1, 2], experts[10, 0], experts[T - 1, 1] = OUT_OF_RANGE
  elif name == "one_rank":
    experts = rng.integers(E - 1, E, (T, K))  # the last expert: the last rank at every EP size
  elif name == "one_expert":
    experts = np.ones((T, K), np.int32)
  else:
    experts = np.full((T, K), -1, np.int32)
    experts[5, 1], experts[17, 0], experts[17, 2] = 3, 6, 0
  return experts.astype(np.int32)


def ep_case(Is, dtype=F32, seed=0, route="random"):
  return make_case(T=T, H=H, I=I, E=E, Is=Is, dtype=dtype, experts=routing(route, seed),
                   seed=seed)


@functools.cache
def single_device(backend, Is, dtype=F32, seed=0, route="random"):
  return loss_and_grads(ep_case(Is, dtype, seed, route), backend)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("Is", [None, IS], ids=["routed", "shared"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_ep_has_the_single_device_bits(ep, backend, Is, dtype):
  case = ep_case(Is, dtype)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(ep), P("ep"), P("ep"), "ep")
  want_y, want_grads = single_device(backend, Is, dtype)
  assert_ep_bits(y, grads, want_y, want_grads, f"EP={ep} {backend}", dtype, backend)
  assert np.all(grads["weights"][[1, 10, T - 1], [2, 0, 1]] == 0)


@pytest.mark.parametrize("route", ["one_rank", "one_expert", "sparse"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("ep", [2, 8])
def test_ep_bits_under_adversarial_routing(ep, backend, route):
  case = ep_case(IS, BF16, seed=4, route=route)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(ep), P("ep"), P("ep"), "ep")
  want_y, want_grads = single_device(backend, IS, BF16, seed=4, route=route)
  assert_ep_bits(y, grads, want_y, want_grads, f"EP={ep} {backend} {route}", BF16, backend)


def test_single_device_matches_oracle():
  """The single-device results above are right (checked against the oracle, out-of-range ids
  included), so the EP results are too."""
  case = ep_case(IS)
  for backend in CPU_BACKENDS:
    y, _ = single_device(backend, IS)
    assert_close(y, oracle.moe(*case.args(), case.shared), F32_RTOL, f"{backend} y")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_capacity_bounds_the_sends(backend):
  """Config.ep_capacity: enough for the routing gives the dropless bits; too little fails with
  an error naming the rows needed, never a silent drop."""
  case = ep_case(None, route="one_rank")  # each rank sends its T/ep * K routes to the last rank
  ep = 4
  need = T // ep * K
  want_y, want_grads = single_device(backend, None, route="one_rank")
  enough = mok_jax.Config(ep_capacity=need)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(ep), P("ep"), P("ep"), "ep", enough)
  assert_ep_bits(y, grads, want_y, want_grads, f"capacity {need}", F32, backend)
  short = mok_jax.Config(ep_capacity=need - 1)
  with pytest.raises(Exception, match=f"sends {need} routed rows to one rank, more than "
                                      f"Config.ep_capacity = {need - 1}"):
    y, _ = sharded_loss_and_grads(case, backend, mesh_of(ep), P("ep"), P("ep"), "ep", short)
    jax.block_until_ready(y)
  try:  # the other ranks' and the backward's reports of the same overflow
    jax.effects_barrier()
  except Exception:  # pylint: disable=broad-except
    pass


@pytest.mark.parametrize("bad", ["ring", None, 3])
def test_config_rejects_bad_ep_fields(bad):
  with pytest.raises(ValueError, match="ep_transport"):
    mok_jax.Config(ep_transport=bad)
  with pytest.raises(ValueError, match="ep_capacity"):
    mok_jax.Config(ep_capacity=0)
  with pytest.raises(ValueError, match="ep_capacity"):
    mok_jax.Config(ep_capacity=2.5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ep_on_a_2d_mesh(backend):
  """Tokens over ('dp', 'ep'), experts over 'ep' only: the expert weights' gradients are also
  summed over 'dp', where they are replicated."""
  case = ep_case(IS, seed=2)
  mesh = mesh_of(2, 4, names=("dp", "ep"))
  y, grads = sharded_loss_and_grads(case, backend, mesh, P(("dp", "ep")), P("ep"), "ep")
  want_y, want_grads = loss_and_grads(case, backend)
  assert_close(y, want_y, F32_RTOL, "y")
  assert_grads_close(grads, want_grads, F32_RTOL, "dp=2 x ep=4")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replicated_experts_under_shard_map(backend):
  """Data parallelism without axis_name: every rank holds all experts, gradients are summed."""
  case = ep_case(IS, seed=3)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(4, names=("dp",)), P("dp"), P(),
                                    None)
  want_y, want_grads = loss_and_grads(case, backend)
  assert_close(y, want_y, F32_RTOL, "y")
  assert_grads_close(grads, want_grads, F32_RTOL, "replicated experts")


def shard_map_inputs(jaxpr):
  """The avals of every shard_map's inputs in a jaxpr, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      yield from (v.aval for v in eqn.invars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from shard_map_inputs(sub)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("Is", [None, IS], ids=["routed", "shared"])
def test_backward_shard_map_gets_no_empty_residual(Is, recompute):
  """No empty array (gu_shared without a shared expert, gu with recompute) crosses into the
  backward's shard_map: XLA folds such an input to a constant, and removing the unused input
  then crashed Shardy compiling forward+backward on 2 GPUs (jax 0.11.2, 2026-11-30)."""
  case = ep_case(Is)
  f = sharded_grad_fn(case, "ffi", mesh_of(2), P("ep"), P("ep"), "ep",
                      mok_jax.Config(recompute=recompute))
  avals = list(shard_map_inputs(jax.make_jaxpr(f)(*case.params()).jaxpr))
  assert len(avals) > 12  # the forward's and the backward's shard_map
  empty = [a.str_short() for a in avals if 0 in a.shape]
  assert not empty, empty


def ffi_calls(jaxpr):
  """The ffi_call equations of a closed jaxpr, those of its sub-jaxprs (shard_map, custom VJP,
  jit) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ffi_call":
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found.extend(ffi_calls(sub))
  return found


@pytest.mark.parametrize("ep", [1, 4])
def test_ep_tells_the_targets_its_ranks(ep):
  """Under shard_map each rank's expert call, forward and backward, gets `ranks` = the EP size:
  the CUDA kernel's launch choices then expect a rank's share of the routes, not all of them;
  the home rank's combines (y, then dx) are mok_moe_combine calls."""
  case = ep_case(None)
  f = sharded_grad_fn(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep")
  calls = ffi_calls(jax.make_jaxpr(f)(*case.params()).jaxpr)
  names = sorted(e.params["target_name"] for e in calls)
  assert names == ["mok_moe_bwd", "mok_moe_combine", "mok_moe_combine", "mok_moe_fwd"], names
  assert all(int(dict(e.params["attributes"])["ranks"]) == ep for e in calls
             if e.params["target_name"] != "mok_moe_combine")


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
def test_ep_bits_under_scan_over_layers(remat):
  """Two layers of stacked experts under lax.scan (and jax.checkpoint of the body), jit and
  grad: EP = 4 gives the single device's bits on the ffi backend."""
  L, ep = 2, 4
  rng = np.random.default_rng(7)
  case = ep_case(None)
  stack = lambda a: jnp.stack([a, a * 0.5])  # noqa: E731
  params = (case.weights, stack(case.w_gate), stack(case.w_up), stack(case.w_down))
  routes = jnp.asarray(np.stack([routing("random", 7), distinct_experts(rng, T, K, E)]))

  def layers(x, weights, w_gate, w_up, w_down, routes, axis_name):
    def body(h, layer):
      g, u, d, e = layer
      y = mok_jax.moe(h, e, weights, g, u, d, axis_name=axis_name, backend="ffi")
      return h + y, None
    body = jax.checkpoint(body) if remat else body
    return jax.lax.scan(body, x, (w_gate, w_up, w_down, routes))[0]

  def loss_of(f):
    return jax.jit(jax.value_and_grad(
        lambda x, *p: jnp.sum(f(x, *p, routes) * case.dy), argnums=tuple(range(5))))

  one = loss_of(functools.partial(layers, axis_name=None))
  tok, ex = P("ep"), P(None, "ep")
  sharded = jax.shard_map(functools.partial(layers, axis_name="ep"), mesh=mesh_of(ep),
                          in_specs=(tok, tok, ex, ex, ex, P(None, "ep")), out_specs=tok)
  many = loss_of(sharded)
  (_, want), (_, got) = one(case.x, *params), many(case.x, *params)
  for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), got, want):
    assert_same_bits(a, b, f"EP={ep} d{name}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ep_inference_has_the_training_bits(backend):
  """Not differentiated, the layer keeps no residuals (the FFI targets' recompute mode): y has
  the bits of the differentiated call's."""
  case = ep_case(IS, BF16, seed=5)
  mesh = mesh_of(4)

  def layer(x, e, w, g, u, d, shared):
    return mok_jax.moe(x, e, w, g, u, d, shared=shared, axis_name="ep", backend=backend)

  f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 6 + (P(),),
                            out_specs=P("ep")))
  y = f(case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down,
        case.shared)
  want_y, _ = sharded_loss_and_grads(case, backend, mesh, P("ep"), P("ep"), "ep")
  assert_same_bits(y, want_y, f"{backend} inference y")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's documented semantics, from all_gathers (XLA:CPU has no ragged
  all-to-all): each rank s sends operand[input_offsets[d] : + send_sizes[d]] to rank d, which
  finds them at output[output_offsets[d] : + send_sizes[d]] (offsets in the receiver's buffer,
  given by the sender); recv_sizes[s] must be what s sends. Rows of operand past the sizes are
  never read, rows of output that nothing lands in keep output's values; a recv_sizes that
  disagrees turns the output to 7s, so that no test can pass on it."""
  n_ranks, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  gather = functools.partial(jax.lax.all_gather, axis_name=axis_name)
  rows, starts, sizes, at = map(gather, (operand, input_offsets, send_sizes, output_offsets))
  n = output.shape[0]
  i = jnp.arange(n)
  for s in range(n_ranks):
    src = jnp.clip(starts[s, me] + i, 0, operand.shape[0] - 1)
    dst = jnp.where(i < sizes[s, me], at[s, me] + i, n)  # row n: dropped
    output = output.at[dst].set(rows[s][src], mode="drop")
  agree = jnp.all(recv_sizes == sizes[:, me])
  return jnp.where(agree, output, jnp.full_like(output, 7))


@pytest.fixture
def ragged_on_cpu(monkeypatch):
  """The ragged transport on CPU devices, through the emulation above."""
  monkeypatch.setattr(expert_parallel, "DENSE_PLATFORMS", ())
  monkeypatch.setattr(expert_parallel, "_ragged_all_to_all", emulated_ragged_all_to_all)


@pytest.mark.parametrize("route", ["random", "one_rank", "sparse"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("ep", [2, 8])
def test_ragged_exchange_has_the_single_device_bits(ep, backend, route, ragged_on_cpu):
  """Only the rows that hold routes move, out and back, forward and backward: every send
  offset, size and receive size right, or y and the gradients lose rows."""
  del ragged_on_cpu
  case = ep_case(IS, BF16, seed=4, route=route)
  y, grads = sharded_loss_and_grads(case, backend, mesh_of(ep), P("ep"), P("ep"), "ep")
  want_y, want_grads = single_device(backend, IS, BF16, seed=4, route=route)
  assert_ep_bits(y, grads, want_y, want_grads, f"ragged EP={ep} {backend} {route}", BF16,
                 backend)


def collectives(hlo: str):
  """The collectives of a StableHLO module (ragged_all_to_all is a custom call there)."""
  return sorted({op for op in ("all_to_all", "all_gather", "all_reduce", "collective_permute")
                 if f"stablehlo.{op}" in hlo} |
                ({"ragged_all_to_all"} if "@ragged_all_to_all" in hlo else set()))


@pytest.mark.parametrize("platform,want", [("cpu", ["all_to_all"]),
                                           ("cuda", ["all_to_all", "ragged_all_to_all"])])
def test_the_transport_by_platform(platform, want):
  """The program lowered for a GPU moves the routed rows by ragged all-to-alls (the (P,) counts
  by one all_to_all); for XLA:CPU, which has none, by all_to_alls of whole blocks."""
  case = ep_case(None)
  f = jax.jit(sharded_grad_fn(case, "xla", mesh_of(4), P("ep"), P("ep"), "ep"))
  unchecked = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
  exported = jax.export.export(f, platforms=(platform,), disabled_checks=unchecked)(
      *case.params())
  assert collectives(exported.mlir_module()) == want
