"""The NVLink transport's Python side on CPU devices (mok_jax.ep_transport; the kernels are tested
on a GPU by test_ep_nvlink_cuda.py and test_ep_transport_cuda.py): which transport "auto" and
"nvlink" pick and why not, the layer's wiring of the two custom calls (forward and custom VJP)
through an emulation of their contract, which gives the collective transport's bits for y and
every gradient at EP 1, 2, 4 and 8, and the program lowered for a GPU: the custom calls with
their workspaces and layout attributes."""

from __future__ import annotations

import functools
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from cases import (BF16, assert_same_bits, distinct_experts, make_case, mesh_of, sharded_grad_fn,
                   sharded_loss_and_grads)
from mok_jax import ep_transport, expert_parallel, ops, reference
from mok_jax.workspace import Workspace

T, H, I, E, K, IS = 24, 16, 8, 8, 3, 8  # T and E divide by every EP size up to 8
EP_TRANSPORT_H = (pathlib.Path(__file__).resolve().parents[1] / "cuda" / "ep_transport.h")


def header_constant(name):
  """An int constant of cuda/ep_transport.h."""
  return int(re.search(rf"constexpr int {name} = (\d+);", EP_TRANSPORT_H.read_text()).group(1))


NVLINK = mok_jax.Config(ep_transport="nvlink")


# --- the reference: the two calls' contract, in JAX on CPU devices ---------------------------

def _blocks_to_peers(a, axis_name, n_ranks):
  """(P C, ...) in blocks by destination -> in blocks by source (an all_to_all of blocks)."""
  blocks = a.reshape(n_ranks, -1, *a.shape[1:])
  return jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True).reshape(a.shape)


def emulated_dispatch(x, experts, weights, *, axis_name, n_local, n_ranks, capacity, fallback):
  """mok_ep_dispatch by its contract (ep_transport.dispatch): expert_parallel.plan's layout, the
  rows each rank sends in blocks by source, NaN in the rows that no route fills (which nothing
  may read), -1 / 0 for their experts, routes and weights."""
  del fallback
  T, k = experts.shape
  C = capacity
  p = expert_parallel.plan(experts, n_local, n_ranks, C)
  has = p.route >= 0
  at = jnp.maximum(p.route, 0)
  w = jnp.ones((T * k,), jnp.float32) if weights is None else weights.reshape(-1)
  ids = experts.reshape(-1)
  move = functools.partial(_blocks_to_peers, axis_name=axis_name, n_ranks=n_ranks)
  arrived = move(has)
  x_recv = jnp.where(arrived[:, None], move(x[at // k]), jnp.nan)
  expert = move(jnp.where(has, ids[at] % n_local, -1))
  weight = move(jnp.where(has, w[at], 0.0))
  route = move(p.route)
  hist = jnp.zeros((n_ranks, n_local), jnp.int32).at[
      jnp.where(has, jnp.arange(n_ranks * C) // C, n_ranks), ids[at] % n_local].add(
          1, mode="drop")
  counts = move(jnp.concatenate([p.sent[:, None], hist], axis=1))
  pos = jnp.where(p.slot >= 0, jnp.arange(T * k).reshape(T, k), -1)
  valid = (ids >= 0) & (ids < n_local * n_ranks)
  need = jnp.bincount(jnp.where(valid, ids // n_local, n_ranks), length=n_ranks + 1)[:n_ranks]
  out = ep_transport.Dispatched(ep_transport.Received(x_recv, expert, weight, route, counts),
                                pos, need.astype(jnp.int32))
  return reference.vary(out, reference.varying_axes(x))


def emulated_combine(rows, row_weights, received, pos, weights, extra, *, axis_name, out_dtype,
                     fallback):
  """mok_ep_combine by its contract (ep_transport.combine): each received row's output in its
  home slot t k + j, then the home sum of mok_moe_combine (the CPU target)."""
  del fallback
  n_ranks = received.counts.shape[0]
  T, k = pos.shape
  move = functools.partial(_blocks_to_peers, axis_name=axis_name, n_ranks=n_ranks)
  back_route = move(received.route)  # at home: the route of each of its send slots, or -1
  owner_row = jnp.full((T * k,), rows.shape[0], jnp.int32).at[
      jnp.where(back_route >= 0, back_route, T * k)].set(
          jnp.arange(rows.shape[0], dtype=jnp.int32), mode="drop")
  has = (owner_row < rows.shape[0])[:, None]
  slots = jnp.where(has, move(rows)[jnp.minimum(owner_row, rows.shape[0] - 1)], 0)
  out = ops.moe_combine(slots, pos, weights, extra, out_dtype=out_dtype)
  out_weights = None
  if row_weights is not None:
    back = move(row_weights)[jnp.minimum(owner_row, rows.shape[0] - 1)]
    out_weights = jnp.where(pos >= 0, back.reshape(T, k), 0.0)
  return reference.vary((out, out_weights), reference.varying_axes(rows))


@pytest.fixture
def nvlink_on_cpu(monkeypatch):
  """The NVLink layer on CPU devices: the transport's availability check passed, the two calls
  emulated."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  monkeypatch.setattr(expert_parallel, "_ep_dispatch", emulated_dispatch)
  monkeypatch.setattr(expert_parallel, "_ep_combine", emulated_combine)


def routing(name, seed=0):
  """(T, K) global ids: "random" (distinct a token, three outside [0, E)), "one_rank" (every
  route to the last rank's experts), "sparse" (most routes outside [0, E))."""
  rng = np.random.default_rng(seed)
  if name == "random":
    experts = distinct_experts(rng, T, K, E)
    experts[1, 2], experts[10, 0], experts[T - 1, 1] = -1, E, 2**31 - 1
  elif name == "one_rank":
    experts = np.full((T, K), E - 1)
  else:
    experts = np.full((T, K), -1)
    experts[5, 1], experts[17, 0], experts[17, 2] = 3, 6, 0
  return experts.astype(np.int32)


def ep_case(Is=IS, seed=0, route="random"):
  return make_case(T=T, H=H, I=I, E=E, Is=Is, dtype=BF16, experts=routing(route, seed),
                   seed=seed)


@functools.cache
def collective(ep, Is, seed, route, ep_capacity=None):
  case = ep_case(Is, seed, route)
  config = mok_jax.Config(ep_transport="collective", ep_capacity=ep_capacity)
  return sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", config)


def assert_all_bits(got, want, tag):
  (y, grads), (want_y, want_grads) = got, want
  assert_same_bits(y, want_y, f"{tag} y")
  assert grads.keys() == want_grads.keys()
  for name in grads:
    assert_same_bits(grads[name], want_grads[name], f"{tag} d{name}")


# --- the layer over the emulated calls ---------------------------------------------------------

@pytest.mark.parametrize("Is", [None, IS], ids=["routed", "shared"])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_nvlink_layer_has_the_collective_bits(ep, Is, nvlink_on_cpu):
  """y and every gradient (the shared expert's too: both transports run it at home alike)."""
  del nvlink_on_cpu
  case = ep_case(Is)
  got = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", NVLINK)
  assert_all_bits(got, collective(ep, Is, 0, "random"), f"EP={ep}")


@pytest.mark.parametrize("route", ["one_rank", "sparse"])
@pytest.mark.parametrize("ep", [2, 8])
def test_nvlink_layer_under_adversarial_routing(ep, route, nvlink_on_cpu):
  del nvlink_on_cpu
  case = ep_case(IS, 3, route)
  got = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", NVLINK)
  assert_all_bits(got, collective(ep, IS, 3, route), f"EP={ep} {route}")


def test_nvlink_layer_checks_the_capacity(nvlink_on_cpu):
  """A bound that the routing fits gives the dropless bits; one it does not fit fails with the
  rows it needed, from the dispatch's own `need`."""
  del nvlink_on_cpu
  ep, need = 4, T // 4 * K  # "one_rank": each rank sends all its routes to the last rank
  case = ep_case(None, 0, "one_rank")
  enough = mok_jax.Config(ep_transport="nvlink", ep_capacity=need)
  got = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", enough)
  assert_all_bits(got, collective(ep, None, 0, "one_rank"), "bounded")
  short = mok_jax.Config(ep_transport="nvlink", ep_capacity=need - 1)
  with pytest.raises(Exception, match=f"sends {need} routed rows to one rank, more than "
                                      f"Config.ep_capacity = {need - 1}"):
    y, _ = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", short)
    jax.block_until_ready(y)
  try:  # the other ranks' reports of the same overflow
    jax.effects_barrier()
  except Exception:  # pylint: disable=broad-except
    pass


def test_nvlink_inference_has_the_training_bits(nvlink_on_cpu):
  del nvlink_on_cpu
  case = ep_case(IS, 5)
  mesh = mesh_of(4)

  def layer(x, e, w, g, u, d, shared):
    return mok_jax.moe(x, e, w, g, u, d, shared=shared, axis_name="ep", backend="ffi",
                       config=NVLINK)

  f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 6 + (P(),),
                            out_specs=P("ep")))
  y = f(case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down,
        case.shared)
  want_y, _ = collective(4, IS, 5, "random")
  assert_same_bits(y, want_y, "inference y")


@pytest.mark.parametrize("Is", [None, IS], ids=["routed", "shared"])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_the_calls_by_collectives_have_the_collective_bits(ep, Is, monkeypatch):
  """The two calls' results computed with XLA's collectives (what they lower to where the mesh
  has no devices, under "auto", and on XLA:CPU): the collective transport's bits."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  case = ep_case(Is, 2)
  got = sharded_loss_and_grads(case, "ffi", mesh_of(ep), P("ep"), P("ep"), "ep", NVLINK)
  assert_all_bits(got, collective(ep, Is, 2, "random"), f"EP={ep}")


def calls(jaxpr, names):
  """The equations of primitives named `names` in a jaxpr, sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found.extend(calls(sub, names))
  return found


def test_the_layer_binds_the_transports_primitives(monkeypatch):
  """With the real calls (not emulated) the traced layer holds two dispatches and two combines
  (forward, and the transpose in the backward) and no collective of the routed rows."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  case = ep_case(IS)
  f = sharded_grad_fn(case, "ffi", mesh_of(4), P("ep"), P("ep"), "ep", NVLINK)
  jaxpr = jax.make_jaxpr(f)(*case.params()).jaxpr
  names = sorted(e.primitive.name for e in calls(jaxpr, set(ep_transport.TARGETS)))
  assert names == ["mok_ep_combine", "mok_ep_combine", "mok_ep_dispatch", "mok_ep_dispatch"]
  assert not calls(jaxpr, {"all_to_all", "ragged_all_to_all"})
  for eqn in calls(jaxpr, set(ep_transport.TARGETS)):
    assert eqn.params["axis_name"] == "ep"
    assert eqn.params["layout"] == Workspace.layout(T // 4, H, K, E, 4, T // 4 * K, BF16)


# --- which transport runs ----------------------------------------------------------------------

def _pieces(backend="ffi"):
  return (expert_parallel.FfiPieces(mok_jax.Config(), 2) if backend == "ffi" else
          expert_parallel.XlaPieces())


def test_auto_picks_collective_on_cpu():
  for pieces in (_pieces("ffi"), _pieces("xla")):
    assert expert_parallel.transport(mok_jax.Config(), pieces, BF16, 64, 4, 2) == "collective"
  assert expert_parallel.transport(mok_jax.Config(ep_transport="collective"), _pieces(), BF16,
                                   64, 4, 2) == "collective"


@pytest.mark.parametrize("backend,match", [
    ("xla", r"the XLA backend moves the routed rows with XLA's collectives"),
    ("ffi", r"JAX's default backend is 'cpu', where the FFI targets are the C\+\+ CPU "
            r"reference; the NVLink transport runs on CUDA GPUs only"),
])
def test_nvlink_on_cpu_says_why_not(backend, match):
  case = ep_case(None)
  with pytest.raises(ValueError, match=r"moe: Config\(ep_transport='nvlink'\) cannot run here: "
                     + match + r".*ep_transport='collective'"):
    sharded_loss_and_grads(case, backend, mesh_of(2), P("ep"), P("ep"), "ep", NVLINK)


def test_auto_picks_nvlink_where_it_runs(monkeypatch):
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  assert expert_parallel.transport(mok_jax.Config(), _pieces(), BF16, 64, 4, 2) == "nvlink"
  assert expert_parallel.transport(NVLINK, _pieces(), BF16, 64, 4, 2) == "nvlink"


def test_auto_keeps_collectives_across_processes(monkeypatch):
  """Several processes: "nvlink" runs where the transport can (the workspace maps through
  CUDA IPC), "auto" keeps XLA's collectives (ep_transport.auto_declines says why)."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert expert_parallel.transport(mok_jax.Config(), _pieces(), BF16, 64, 4, 2) == "collective"
  assert expert_parallel.transport(NVLINK, _pieces(), BF16, 64, 4, 2) == "nvlink"
  assert re.search(r"2 processes: 'auto' keeps XLA's collectives across processes",
                   ep_transport.auto_declines())
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  assert ep_transport.auto_declines() is None


def test_nvlink_needs_an_expert_axis():
  """Without axis_name nothing is routed between ranks: "nvlink" is not asked for."""
  case = ep_case(None)
  y = mok_jax.moe(case.x, case.experts, case.weights, case.w_gate, case.w_up, case.w_down,
                  config=NVLINK, backend="ffi")
  want = mok_jax.moe(case.x, case.experts, case.weights, case.w_gate, case.w_up, case.w_down,
                     backend="ffi")
  assert_same_bits(y, want, "no axis")


def _gpu_process(monkeypatch, *, gpus=(0, 1), processes=1, client=None,
                 peer=lambda a, b: True, targets=ep_transport.TARGETS):
  """A stand-in for a process with these GPUs and this CUDA module (one of `processes`, with
  this jax.distributed client)."""
  monkeypatch.setattr(jax, "process_count", lambda: processes)
  monkeypatch.setattr(ep_transport.distributed.global_state, "client", client)
  monkeypatch.setattr(jax, "local_devices", lambda: [
      types.SimpleNamespace(platform="gpu", local_hardware_id=g) for g in gpus])
  monkeypatch.setattr(ops, "_mok_cuda", types.SimpleNamespace(
      can_access_peer=peer,
      ep_transport_constants=lambda: {"max_ranks": header_constant("kEpMaxRanks"),
                                      "max_local_experts": header_constant("kEpMaxLocalExperts")}))
  monkeypatch.setattr(ops, "_CUDA_TARGETS", frozenset(targets))
  ep_transport._peer_problem.cache_clear()


# (id, stand-in process, unavailable_reason arguments, regex of the reason or None)
REASONS = [
    ("ok", {}, (BF16, 64, 4, 2), None),
    ("one_rank_no_peers", {"peer": lambda a, b: False}, (BF16, 64, 4, 1), None),
    ("no_module", {"targets": ()}, (BF16, 64, 4, 2), r"installed without its CUDA module"),
    ("processes_without_client", {"processes": 2}, (BF16, 64, 4, 2),
     r"the JAX job has 2 processes but no jax.distributed client, through whose key-value "
     r"store the workspace's CUDA IPC handles are exchanged"),
    ("processes", {"processes": 2, "client": object()}, (BF16, 64, 4, 2), None),
    ("f32", {}, (jnp.float32, 64, 4, 2), r"moves bfloat16 rows, got float32"),
    ("row_bytes", {}, (BF16, 12, 4, 2), r"a row of H = 12 is not a multiple of 16 bytes"),
    ("ranks", {}, (BF16, 64, 4, 512), r"at most 256 ranks, got 512"),
    ("experts", {}, (BF16, 64, 2048, 2), r"at most 1024 experts a rank, got 2048"),
    ("peers", {"peer": lambda a, b: (a, b) != (1, 0)}, (BF16, 64, 4, 2),
     r"GPU 1 cannot access the memory of GPU 0 \(cudaDeviceCanAccessPeer = 0\)"),
]


@pytest.mark.parametrize("process,args,match", [r[1:] for r in REASONS],
                         ids=[r[0] for r in REASONS])
def test_unavailable_reasons(monkeypatch, process, args, match):
  _gpu_process(monkeypatch, **process)
  try:
    reason = ep_transport.unavailable_reason(*args)
  finally:
    ep_transport._peer_problem.cache_clear()
  if match is None:
    assert reason is None
  else:
    assert re.search(match, reason), reason


# --- the lowered program ---------------------------------------------------------------------

def lowered_for_cuda(case, mesh, x_spec=P("ep"), config=NVLINK):
  """The StableHLO of forward + backward lowered for a CUDA GPU (the CPU FFI targets stand in
  for the CUDA ones at trace time: the same names and shapes)."""
  f = jax.jit(sharded_grad_fn(case, "ffi", mesh, x_spec, P("ep"), "ep", config))
  return jax.export.export(f, platforms=("cuda",), disabled_checks=ALLOWED)(
      *case.params()).mlir_module()


# Custom calls that jax.export may keep: the FFI targets', and the ragged all-to-all of the
# calls computed with collectives.
ALLOWED = [jax.export.DisabledSafetyCheck.custom_call(n) for n in (
    "mok_moe_fwd", "mok_moe_bwd", "mok_moe_combine", "ragged_all_to_all", *ep_transport.TARGETS)]


def custom_calls(hlo, target):
  return re.findall(rf"stablehlo.custom_call @{target}\((.*?)\n", hlo)


def _attribute(call, name):
  """An i64 array attribute of a custom call (a splat of one value prints as dense<v>)."""
  found = re.search(rf"{name} = dense<\[?([-0-9, ]*)\]?> : tensor<(\d+)xi64>", call)
  values = [int(v) for v in found.group(1).split(", ")]
  return values * int(found.group(2)) if len(values) == 1 else values


def test_lowered_for_cuda_holds_the_custom_calls(monkeypatch):
  """Two of each (forward, and the backward's transpose), with the layout of the layer's
  workspace; a mesh of CPU devices has no workspace, so the handle is NO_WORKSPACE, which the
  handler would report."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  case = ep_case(IS)
  hlo = lowered_for_cuda(case, mesh_of(4))
  lay = Workspace.layout(T // 4, H, K, E, 4, None, BF16)
  for target in ep_transport.TARGETS:
    found = custom_calls(hlo, target)
    assert len(found) == 2, (target, found)
    for call in found:
      assert _attribute(call, "layout") == list(lay.offsets().values())
      assert _attribute(call, "workspaces") == [ep_transport.NO_WORKSPACE]
  assert "ragged_all_to_all" not in hlo


def test_auto_without_a_workspace_lowers_to_collectives(monkeypatch):
  """"auto" (here past its check for a GPU) where the mesh's devices are not this process's
  GPUs: the same calls computed with XLA's collectives (ragged all-to-alls for a GPU), so that
  the program runs."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  hlo = lowered_for_cuda(ep_case(IS), mesh_of(4), config=mok_jax.Config())
  assert not any(custom_calls(hlo, t) for t in ep_transport.TARGETS)
  assert "ragged_all_to_all" in hlo


def test_auto_without_room_for_a_workspace_warns_and_lowers_to_collectives(monkeypatch):
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  monkeypatch.setattr(ep_transport, "_gpus_of_this_process", lambda devices: True)

  def workspace_for(devices, nbytes):
    raise MemoryError(f"mok_jax.Workspace: could not allocate {nbytes} bytes")

  monkeypatch.setattr(ep_transport, "_workspace_for", workspace_for)
  with pytest.warns(UserWarning, match=r"ep_transport='auto'\) moves the routed rows with XLA's "
                    r"collectives: mok_jax.Workspace: could not allocate \d+ bytes"):
    hlo = lowered_for_cuda(ep_case(None), mesh_of(2), config=mok_jax.Config())
  assert not any(custom_calls(hlo, t) for t in ep_transport.TARGETS)
  with pytest.raises(MemoryError, match=r"could not allocate \d+ bytes"):
    lowered_for_cuda(ep_case(None), mesh_of(2))


def explicitly_sharded_grad(case, mesh, config):
  """jit of the gradients of sum(y) of inputs placed on `mesh` (Explicit axes): tokens and the
  expert stacks split over "ep", which sharded.sharded_moe runs in a shard_map over the
  inputs' AbstractMesh."""
  place = lambda a: jax.device_put(jnp.asarray(a), jax.sharding.NamedSharding(mesh, P("ep")))  # noqa: E731
  args = [place(a) for a in (case.x, case.w_gate, case.w_up, case.w_down)]
  experts, weights = place(case.experts), place(case.weights)

  def loss(x, w_gate, w_up, w_down):
    y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, backend="ffi", config=config)
    return jnp.sum(y.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), args


def test_nvlink_on_an_abstract_mesh_says_why(monkeypatch):
  """Explicitly sharded inputs outside jax.set_mesh: no devices when the program is lowered,
  which "nvlink" needs to find its workspaces; "auto" lowers to collectives there."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
  case = ep_case(None)
  f, args = explicitly_sharded_grad(case, mesh, NVLINK)
  with pytest.raises(ValueError, match=r"ep_transport='nvlink'\) needs the devices of the mesh "
                     r"over axis 'ep' when the program is lowered.*jax.set_mesh"):
    jax.export.export(f, platforms=("cuda",), disabled_checks=ALLOWED)(*args)
  f, args = explicitly_sharded_grad(case, mesh, mok_jax.Config())
  hlo = jax.export.export(f, platforms=("cuda",), disabled_checks=ALLOWED)(*args).mlir_module()
  assert not any(custom_calls(hlo, t) for t in ep_transport.TARGETS)
  with jax.set_mesh(mesh):  # the devices are known: the custom calls
    f, args = explicitly_sharded_grad(case, mesh, NVLINK)
    hlo = jax.export.export(f, platforms=("cuda",), disabled_checks=ALLOWED)(*args).mlir_module()
  # Only the gradients are returned, and d sum(y) / dy does not depend on y: the forward's
  # combine is dead code, and gone; its dispatch stays (the backward reads its rows).
  assert len(custom_calls(hlo, "mok_ep_dispatch")) == 2
  assert len(custom_calls(hlo, "mok_ep_combine")) == 1


def test_lowering_asks_for_a_workspace_a_group(monkeypatch):
  """Tokens over ("dp", "ep"), experts over "ep": two EP groups of 4, each group's devices in
  the order of its axis, and both handles in every call."""
  monkeypatch.setattr(expert_parallel, "nvlink_problem", lambda *args: None)
  monkeypatch.setattr(ep_transport, "_gpus_of_this_process", lambda devices: True)
  asked = []

  def workspace_for(devices, nbytes):
    asked.append((tuple(d.id for d in devices), nbytes))
    return 40 + len(asked)

  monkeypatch.setattr(ep_transport, "_workspace_for", workspace_for)
  case = ep_case(None)
  mesh = mesh_of(2, 4, names=("dp", "ep"))
  hlo = lowered_for_cuda(case, mesh, P(("dp", "ep")))
  lay = Workspace.layout(T // 8, H, K, E, 4, None, BF16)
  groups = {tuple(d.id for d in row) for row in mesh.devices}
  assert {devices for devices, _ in asked} == groups and len(groups) == 2
  assert {nbytes for _, nbytes in asked} == {lay.bytes}
  handles = sorted({h for call in custom_calls(hlo, "mok_ep_dispatch") +
                    custom_calls(hlo, "mok_ep_combine") for h in _attribute(call, "workspaces")})
  assert handles == sorted({40 + i for i in range(1, len(asked) + 1)})


def test_ep_groups_of_a_mesh():
  mesh = mesh_of(2, 4, names=("ep", "dp"))
  groups = ep_transport.ep_groups(mesh, "ep")
  assert [[d.id for d in g] for g in groups] == [[m.id for m in mesh.devices[:, j]]
                                                 for j in range(4)]
  assert ep_transport.ep_groups(mesh.abstract_mesh, "ep") is None
  assert ep_transport.ep_groups(mesh, "tp") is None


def test_wrappers_check_their_inputs():
  x = jnp.zeros((4, 16), jnp.float32)
  with pytest.raises(ValueError, match=r"ep_dispatch: x must be \(T, H\) bfloat16"):
    ep_transport.dispatch(x, jnp.zeros((4, 2), jnp.int32), None, axis_name="ep", n_local=2,
                          n_ranks=1, capacity=8)
  received = ep_transport.Received(jnp.zeros((8, 16), BF16), *(jnp.zeros((8,), t) for t in (
      jnp.int32, jnp.float32, jnp.int32)), jnp.zeros((1, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"ep_combine: rows must be \(8, 16\) bfloat16"):
    ep_transport.combine(jnp.zeros((8, 16), jnp.float32), None, received,
                         jnp.zeros((4, 2), jnp.int32), None, None, axis_name="ep",
                         out_dtype=BF16)
  with pytest.raises(ValueError, match=r"ep_combine: out_dtype must be bfloat16 or float32"):
    ep_transport.combine(jnp.zeros((8, 16), BF16), None, received, jnp.zeros((4, 2), jnp.int32),
                         None, None, axis_name="ep", out_dtype=jnp.float16)


def test_a_process_creates_the_workspaces_of_its_groups_only(monkeypatch):
  """Across processes, the handles of a call are those of the EP groups that hold a GPU of
  this process (process 0 here): the other groups' workspaces are their processes'."""
  gpu = lambda p, g: types.SimpleNamespace(platform="gpu", process_index=p,  # noqa: E731
                                           local_hardware_id=g)
  groups = ((gpu(0, 0), gpu(1, 0)), (gpu(2, 0), gpu(3, 0)), (gpu(0, 1), gpu(1, 1)))
  monkeypatch.setattr(ep_transport, "ep_groups", lambda mesh, axis_name: groups)
  asked = []
  monkeypatch.setattr(ep_transport, "_workspace_for",
                      lambda devices, nbytes: asked.append(devices) or len(asked))
  lay = Workspace.layout(4, 64, 2, 4, 2)
  assert list(ep_transport._workspace_handles(None, "ep", lay)) == [1, 2]
  assert asked == [groups[0], groups[2]]
  far = ((gpu(2, 0), gpu(3, 0)),)
  monkeypatch.setattr(ep_transport, "ep_groups", lambda mesh, axis_name: far)
  assert list(ep_transport._workspace_handles(None, "ep", lay)) == [ep_transport.NO_WORKSPACE]
