"""The NVLink transport through XLA (mok_jax.ep_transport: the custom calls mok_ep_dispatch and
mok_ep_combine on a mok_jax.Workspace that the layer creates), against the same layer with the
collective transport and the fused call on one GPU: y and every gradient in the same bits.

One GPU (`gpu`): EP = 1 under shard_map, which runs every kernel of both calls (a rank sends
its rows to itself through its workspace) with the rounds counted on the device: under jit,
called again and again, under CUDA-graph capture, in a scan over layers, with a bounded
capacity; "auto" picks the transport; a program without its workspace fails with the reason.
Several ranks on one GPU go through the same launchers in test_ep_transport_cuda.py. Several
GPUs (`multigpu`): EP = 2, 4, 8 over real GPUs, and two EP groups of a (dp, ep) mesh."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from cases import (BF16, COMMAND_BUFFER_FLAGS, NO_COMMAND_BUFFER_FLAGS, REPLAYS, assert_ep_bits,
                   assert_same_bits, digest, distinct_experts, in_fresh_process,
                   loss_and_grads, make_case, mesh_of, named_grads, sharded_grad_fn,
                   sharded_loss_and_grads)
from mok_jax import ep_transport

pytestmark = pytest.mark.gpu

# Tails of the 128-row and 256-column tiles (I = 192, H = 320), a shared expert; T and E divide
# by every EP size up to 8.
T, H, I, E, K, IS = 1024, 320, 192, 16, 4, 128


def nvlink(**kw):
  return mok_jax.Config(ep_transport="nvlink", **kw)


def collective(**kw):
  return mok_jax.Config(ep_transport="collective", **kw)


@functools.cache
def case_of(seed, Is=IS):
  rng = np.random.default_rng(seed)
  experts = distinct_experts(rng, T, K, E)
  # Out-of-range ids on the first, a middle and the last rank's tokens (at every EP size).
  experts[1, 2], experts[T // 2, 0], experts[T - 1, 3] = -1, E, 2**31 - 1
  return make_case(T=T, H=H, I=I, E=E, Is=Is, dtype=BF16, experts=experts, seed=seed)


def run_ep(case, n, config, names=("ep",), shape=None, x_spec=P("ep")):
  mesh = mesh_of(*(shape or (n,)), names=names)
  return sharded_loss_and_grads(case, "cuda", mesh, x_spec, P("ep"), "ep", config)


def assert_all_bits(got, want, tag):
  (y, grads), (want_y, want_grads) = got, want
  assert_same_bits(y, want_y, f"{tag} y")
  assert grads.keys() == want_grads.keys()
  for name in grads:
    assert_same_bits(grads[name], want_grads[name], f"{tag} d{name}")


def lowered_text(case, n, config, names=("ep",), shape=None, x_spec=P("ep")):
  mesh = mesh_of(*(shape or (n,)), names=names)
  f = jax.jit(sharded_grad_fn(case, "cuda", mesh, x_spec, P("ep"), "ep", config))
  return f.lower(*case.params()).as_text()


# --- one GPU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_one_rank_has_the_fused_and_the_collective_bits(block_m, recompute):
  """EP = 1 through both calls: the fused call's bits (the shared expert's weight gradients,
  which shard_map sums over ranks, to rounding) and the collective transport's, every bit."""
  case = case_of(block_m)
  knobs = dict(block_m=block_m, recompute=recompute)
  got = run_ep(case, 1, nvlink(**knobs))
  want_y, want_grads = loss_and_grads(case, "cuda", mok_jax.Config(**knobs))
  assert_ep_bits(*got, want_y, want_grads, f"nvlink P=1 block_m={block_m}", BF16, "cuda")
  assert_all_bits(got, run_ep(case, 1, collective(**knobs)), "nvlink vs collective")


def test_the_calls_are_in_the_program_and_auto_picks_them():
  case = case_of(0)
  for config in (nvlink(), mok_jax.Config()):
    text = lowered_text(case, 1, config)
    assert text.count("mok_ep_dispatch") >= 2 and text.count("mok_ep_combine") >= 2
    assert "ragged_all_to_all" not in text
  assert "mok_ep_dispatch" not in lowered_text(case, 1, collective())


def test_routed_only_and_bounded_capacity():
  """No shared expert; and Config.ep_capacity that the routing just fits (one rank: its every
  valid route, T k less the three out-of-range ids), which bounds the workspace's receive rows."""
  case = case_of(1, Is=None)
  for config in (nvlink(), nvlink(ep_capacity=T * K - 3)):
    want = run_ep(case, 1, collective(ep_capacity=config.ep_capacity))
    assert_all_bits(run_ep(case, 1, config), want, f"ep_capacity={config.ep_capacity}")


def test_calls_again_and_again_have_the_same_bits():
  """Every call of one executable is a new round of the workspace's epochs (advanced by the
  kernels): the same bits every time, and the same as a freshly compiled one."""
  case = case_of(2)
  f = jax.jit(sharded_grad_fn(case, "cuda", mesh_of(1), P("ep"), P("ep"), "ep", nvlink()))
  runs = []
  for _ in range(REPLAYS):
    (_, y), g = f(*case.params())
    runs.append([digest(y)] + [digest(v) for v in named_grads(case, g).values()])
  assert runs == [runs[0]] * REPLAYS
  y, grads = run_ep(case, 1, nvlink())
  assert runs[0] == [digest(y)] + [digest(v) for v in grads.values()]


def test_inference_has_the_training_bits():
  case = case_of(3)

  def layer(x, e, w, g, u, d, shared):
    return mok_jax.moe(x, e, w, g, u, d, shared=shared, axis_name="ep", backend="cuda",
                       config=nvlink())

  f = jax.jit(jax.shard_map(layer, mesh=mesh_of(1), in_specs=(P("ep"),) * 6 + (P(),),
                            out_specs=P("ep")))
  y = f(case.x, jnp.asarray(case.experts), case.weights, case.w_gate, case.w_up, case.w_down,
        case.shared)
  assert_same_bits(y, run_ep(case, 1, nvlink())[0], "inference y")


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
def test_scan_over_layers(remat):
  """Two layers under lax.scan (and jax.checkpoint of the body, whose recomputed forward
  dispatches again without a combine that anything needs): the collective transport's bits."""
  case = case_of(4, Is=None)
  stack = lambda a: jnp.stack([a, a * 0.5])  # noqa: E731
  params = (case.weights, stack(case.w_gate), stack(case.w_up), stack(case.w_down))
  routes = jnp.asarray(np.stack([case.experts, case.experts[::-1]]))

  def layers(x, weights, w_gate, w_up, w_down, routes, config):
    def body(h, layer):
      g, u, d, e = layer
      y = mok_jax.moe(h, e, weights, g, u, d, axis_name="ep", backend="cuda", config=config)
      return h + y, None
    body = jax.checkpoint(body) if remat else body
    return jax.lax.scan(body, x, (w_gate, w_up, w_down, routes))[0]

  def grads(config):
    tok, ex = P("ep"), P(None, "ep")
    f = jax.shard_map(functools.partial(layers, config=config), mesh=mesh_of(1),
                      in_specs=(tok, tok, ex, ex, ex, P(None, "ep")), out_specs=tok)
    g = jax.jit(jax.grad(lambda x, *p: jnp.sum(f(x, *p, routes).astype(jnp.float32) * case.dy),
                         argnums=tuple(range(5))))
    return [np.asarray(v) for v in g(case.x, *params)]

  for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads(nvlink()),
                        grads(collective())):
    assert_same_bits(a, b, f"scan d{name}")


def nvlink_digests() -> dict:
  """sha256 of y and every gradient of EP = 1 over the NVLink transport, from one jitted
  executable called REPLAYS times (with command buffers on, the later calls replay the
  captured graph, whose rounds the kernels count themselves)."""
  case = case_of(5)
  f = jax.jit(sharded_grad_fn(case, "cuda", mesh_of(1), P("ep"), P("ep"), "ep", nvlink()))
  runs = []
  for _ in range(REPLAYS):
    (loss, y), g = f(*case.params())
    runs.append({"y": digest(y), **{n: digest(v) for n, v in named_grads(case, g).items()}})
  return {"runs": runs, "lowered": "mok_ep_dispatch" in f.lower(*case.params()).as_text()}


def test_same_bits_with_command_buffers():
  plain = in_fresh_process("test_ep_nvlink_cuda.nvlink_digests", NO_COMMAND_BUFFER_FLAGS)
  graphs = in_fresh_process("test_ep_nvlink_cuda.nvlink_digests", COMMAND_BUFFER_FLAGS)
  assert plain["lowered"] and graphs["lowered"]
  assert plain["runs"] == [plain["runs"][0]] * REPLAYS, plain
  assert graphs["runs"] == plain["runs"]


def test_a_program_without_its_workspace_says_why(monkeypatch):
  """Lowered as if for another machine (no workspace: handle NO_WORKSPACE), the call fails with
  an error naming the GPU and the fix, not a crash."""
  monkeypatch.setattr(ep_transport, "_workspace_handles",
                      lambda *args: np.array([ep_transport.NO_WORKSPACE], np.int64))
  case = case_of(6, Is=None)
  with pytest.raises(Exception, match=r"mok_ep_dispatch: no workspace of this call .* holds GPU "
                     r"\d+: the program was lowered without the GPUs of its EP groups"):
    y, _ = run_ep(case, 1, nvlink())
    jax.block_until_ready(y)


def test_auto_on_an_abstract_mesh_moves_rows_by_collectives():
  """Explicitly sharded inputs outside jax.set_mesh: the mesh has no devices when the program
  is lowered, so "auto" computes the two calls with XLA's collectives (the same bits), and an
  explicit "nvlink" says what to do."""
  mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
  case = case_of(8, Is=None)
  place = lambda a: jax.device_put(jnp.asarray(a), jax.sharding.NamedSharding(mesh, P("ep")))  # noqa: E731
  args = [place(a) for a in (case.x, case.w_gate, case.w_up, case.w_down)]
  experts, weights = place(case.experts), place(case.weights)

  def grad(config):
    def loss(x, w_gate, w_up, w_down):
      y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, backend="cuda", config=config)
      return jnp.sum(y.astype(jnp.float32) * case.dy)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  auto = grad(mok_jax.Config())
  assert "mok_ep_dispatch" not in auto.lower(*args).as_text()
  for a, b in zip(auto(*args), grad(collective())(*args)):
    assert_same_bits(np.asarray(a), np.asarray(b), "auto by collectives")
  with pytest.raises(ValueError, match=r"needs the devices of the mesh over axis 'ep'"):
    grad(nvlink())(*args)
  with jax.set_mesh(mesh):  # devices known: the custom calls, the same bits
    assert "mok_ep_dispatch" in grad(nvlink()).lower(*args).as_text()
    for a, b in zip(grad(nvlink())(*args), grad(collective())(*args)):
      assert_same_bits(np.asarray(a), np.asarray(b), "nvlink under set_mesh")


# --- several GPUs ------------------------------------------------------------------------------

def gpus() -> int:
  return len(jax.devices())


@functools.cache
def one_gpu(seed):
  return loss_and_grads(case_of(seed), "cuda")


@pytest.mark.multigpu
@pytest.mark.parametrize("ep_capacity", [None, T // 2 * K], ids=["dropless", "bounded"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_over_gpus_has_one_gpus_bits(ep, ep_capacity):
  """EP ranks, one a GPU, through peer access: the fused call's bits on one GPU (the shared
  expert's weight gradients to rounding) and the collective transport's, every bit."""
  if gpus() < ep:
    pytest.skip(f"needs {ep} GPUs, {gpus()} visible")
  case = case_of(0)
  got = run_ep(case, ep, nvlink(ep_capacity=ep_capacity))
  assert_ep_bits(*got, *one_gpu(0), f"nvlink EP={ep}", BF16, "cuda")
  assert_all_bits(got, run_ep(case, ep, collective(ep_capacity=ep_capacity)),
                  f"nvlink vs collective EP={ep}")
  grads = got[1]
  assert np.all(grads["weights"][[1, T // 2, T - 1], [2, 0, 3]] == 0)


@pytest.mark.multigpu
def test_auto_picks_nvlink_over_gpus():
  case = case_of(0)
  text = lowered_text(case, 2, mok_jax.Config())
  assert "mok_ep_dispatch" in text and "ragged_all_to_all" not in text


@pytest.mark.multigpu
def test_two_ep_groups_of_a_2d_mesh():
  """Tokens over (dp, ep), experts over ep: each dp row of the mesh is an EP group with a
  workspace of its own; the same bits as the collective transport on the same mesh."""
  if gpus() < 4:
    pytest.skip(f"needs 4 GPUs, {gpus()} visible")
  ep = gpus() // 2 if gpus() < 8 else 4
  ep = 1 << (ep.bit_length() - 1)
  mesh = dict(names=("dp", "ep"), shape=(2, ep), x_spec=P(("dp", "ep")))
  case = case_of(7)
  got = run_ep(case, 2 * ep, nvlink(), **mesh)
  assert_all_bits(got, run_ep(case, 2 * ep, collective(), **mesh), f"dp=2 x ep={ep}")


@pytest.mark.multigpu
def test_same_bits_every_run_over_gpus():
  ep = min(8, 1 << (gpus().bit_length() - 1))
  runs = [run_ep(case_of(1), ep, nvlink()) for _ in range(2)]
  assert_all_bits(runs[0], runs[1], f"EP={ep} twice")
