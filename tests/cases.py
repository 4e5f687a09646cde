"""Test inputs, tolerances and the jitted forward + backward of `mok_jax.moe` used by the tests."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax
from mok_jax import ops

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)

# Backends that run on a CPU-only machine: the pure-JAX one and the C++ CPU FFI targets.
CPU_BACKENDS = ("xla", "ffi")

# Tolerances, relative to the largest magnitude of the expected array (see assert_close).
# f32 against the float64 oracle: f32 accumulation over a few dozen terms.
F32_RTOL = 1e-5
# bf16 against the oracle rounded at the same points: a one-ulp flip of h, of a routed output or
# of y (2**-8 relative) where f32 and float64 land on opposite sides of a bf16 rounding boundary.
BF16_RTOL = 1e-2
# bf16 gradients: the backward also rounds dg, du, w h and each route's dx to bf16, and every
# gradient once at the end; the oracle's backward is not rounded (worst seen over seeds: 1.0e-2,
# in dw_down).
BF16_GRAD_RTOL = 3e-2
RTOL = {F32: F32_RTOL, BF16: BF16_RTOL}
GRAD_RTOL = {F32: F32_RTOL, BF16: BF16_GRAD_RTOL}

GRAD_NAMES = ("x", "weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


class Case(NamedTuple):
  x: jax.Array  # (T, H)
  experts: np.ndarray  # (T, k) integer ids (NumPy: any integer dtype)
  weights: jax.Array  # (T, k) f32
  w_gate: jax.Array  # (E, H, I)
  w_up: jax.Array  # (E, H, I)
  w_down: jax.Array  # (E, I, H)
  shared: tuple | None  # (ws_gate, ws_up, ws_down) or None
  dy: jax.Array  # (T, H) f32 cotangent of y

  def args(self):
    return (self.x, self.experts, self.weights, self.w_gate, self.w_up, self.w_down)

  def params(self):
    """The differentiable arguments, in the order grad_fn takes them."""
    return (self.x, self.weights, self.w_gate, self.w_up, self.w_down, self.shared)


def distinct_experts(rng, T, k, E):
  """(T, k) ids, k distinct experts per token, uniformly at random."""
  return np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)


def make_case(T=24, H=16, I=8, E=4, k=2, Is=None, dtype=F32, seed=0, experts=None) -> Case:
  """Random inputs whose activations are O(1): x ~ N(0, 1), weights scaled by 1/sqrt(fan_in)."""
  rng = np.random.default_rng(seed)

  def normal(*shape, fan_in=1):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), dtype)

  x = normal(T, H)
  if experts is None:
    experts = distinct_experts(rng, T, k, E)
  experts = np.asarray(experts)
  k = experts.shape[1]
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
  w_gate, w_up = normal(E, H, I, fan_in=H), normal(E, H, I, fan_in=H)
  w_down = normal(E, I, H, fan_in=I)
  shared = None
  if Is:
    shared = (normal(H, Is, fan_in=H), normal(H, Is, fan_in=H), normal(Is, H, fan_in=Is))
  dy = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  return Case(x, experts, weights, w_gate, w_up, w_down, shared, dy)


def grad_fn(case: Case, backend, config=None):
  """value_and_grad of sum(dy * y), with y as aux, w.r.t. `case.params()` (x, weights, w_gate,
  w_up, w_down, shared). `experts` is closed over as a constant, so NumPy ids of any integer
  dtype reach `mok_jax.moe` unconverted."""
  experts = case.experts

  def loss(x, weights, w_gate, w_up, w_down, shared):
    y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared, config=config,
                    backend=backend)
    return jnp.sum(y.astype(jnp.float32) * case.dy), y

  return jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)


def named_grads(case: Case, grads) -> dict:
  """grad_fn's gradients keyed by GRAD_NAMES (shared ones only with a shared expert)."""
  named = dict(zip(GRAD_NAMES[:5], grads[:5]))
  if case.shared is not None:
    named.update(zip(GRAD_NAMES[5:], grads[5]))
  return named


def loss_and_grads(case: Case, backend, config=None, jit=True):
  """y and the gradients of sum(dy * y), as NumPy arrays: (y, dict keyed by GRAD_NAMES)."""
  f = grad_fn(case, backend, config)
  if jit:
    f = jax.jit(f)
  (_, y), g = f(*case.params())
  return np.asarray(y), {name: np.asarray(v) for name, v in named_grads(case, g).items()}


def bwd_operand_producers(case: Case, backend, config=None) -> tuple[str, dict]:
  """What XLA compiled of grad_fn's mok_moe_bwd call: its output_to_operand_aliasing, and for
  each operand that ops.bwd_aliases names, the opcode of the instruction producing it (a
  `copy` there means XLA copied the residual rather than hand the backward its buffer)."""
  params = case.params()
  hlo = jax.jit(grad_fn(case, backend, config)).lower(*params).compile().as_text()
  call = next(line for line in hlo.splitlines() if 'custom_call_target="mok_moe_bwd"' in line)
  operands = re.search(r"custom-call\(([^)]*)\)", call).group(1)
  names = [re.sub(r"/\*.*?\*/", "", o).strip() for o in operands.split(",")]
  aliasing = re.search(r"output_to_operand_aliasing=\{(.*?)\}, ", call)
  producers = {}
  for op in ops.bwd_aliases(ops.MoeDims(*_dims(case)), (config or mok_jax.Config()).recompute):
    name = names[op].split()[-1]
    line = next(l for l in hlo.splitlines() if l.strip().startswith(f"{name} = ") or
                l.strip().startswith(f"ROOT {name} = "))
    producers[op] = re.search(r"\} ([a-z-]+)\(", line.split(" = ", 1)[1]).group(1)
  return (aliasing.group(1) if aliasing else ""), producers


def check_bwd_takes_residual_buffers(backend):
  """Under jit, mok_moe_bwd writes dgu over the forward's gu (dgu_shared over gu_shared) and
  dx of each routed row over its xs, with no copy between them; with recompute it aliases
  nothing (xs is gathered and gu recomputed into its scratch)."""
  for Is in (None, 64):  # the CUDA kernel's sizes are multiples of 64
    case = make_case(T=40, H=64, I=64, E=4, k=2, Is=Is, dtype=BF16)
    aliasing, producers = bwd_operand_producers(case, backend)
    pairs = {(int(o), int(a)) for o, a in re.findall(r"\{(\d+)\}: \((\d+), \{\}\)", aliasing)}
    want = {(10, 13), (8, 15), *([(11, 14)] if Is else [])}
    assert pairs == want, (Is, aliasing)
    assert producers == {op: "get-tuple-element" for _, op in want}, (Is, producers)
    assert bwd_operand_producers(case, backend, mok_jax.Config(recompute=True)) == ("", {})


def _dims(case: Case):
  T, H = case.x.shape
  E, _, I = case.w_gate.shape
  return T, H, I, E, case.experts.shape[1], 0 if case.shared is None else case.shared[0].shape[1]


def mesh_of(*shape, names=("ep",)):
  """A mesh of the first prod(shape) devices, axes `names`."""
  n = int(np.prod(shape))
  return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def sharded_grad_fn(case: Case, backend, mesh, x_spec, w_spec, axis_name, config=None):
  """grad_fn with moe applied inside shard_map: tokens (and routes) split by x_spec, experts
  by w_spec, the shared expert replicated."""

  def layer(x, experts, weights, w_gate, w_up, w_down, shared):
    return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared,
                       axis_name=axis_name, config=config, backend=backend)

  sharded = jax.shard_map(layer, mesh=mesh,
                          in_specs=(x_spec, x_spec, x_spec, w_spec, w_spec, w_spec, P()),
                          out_specs=x_spec)
  experts = jnp.asarray(case.experts)

  def loss(x, weights, w_gate, w_up, w_down, shared):
    y = sharded(x, experts, weights, w_gate, w_up, w_down, shared)
    return jnp.sum(y.astype(jnp.float32) * case.dy), y

  return jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)


def sharded_loss_and_grads(case: Case, backend, mesh, x_spec, w_spec, axis_name, config=None):
  """loss_and_grads of sharded_grad_fn."""
  f = jax.jit(sharded_grad_fn(case, backend, mesh, x_spec, w_spec, axis_name, config))
  (_, y), g = f(*case.params())
  return np.asarray(y), {name: np.asarray(v) for name, v in named_grads(case, g).items()}


def oracle_grads_dict(grads) -> dict:
  out = dict(zip(GRAD_NAMES[:5], grads[:5]))
  if grads.shared is not None:
    out.update(zip(GRAD_NAMES[5:], grads.shared))
  return out


def f64(a):
  a = np.asarray(a)
  if a.dtype == ml_dtypes.bfloat16:
    a = a.astype(np.float32)
  return a.astype(np.float64)


def assert_close(actual, expected, rtol, name=""):
  """|actual - expected| <= rtol * max|expected| elementwise (plus rtol * |expected|).

  An error relative to the array's scale, not to each element: the elements of a sum with
  cancellation are legitimately less accurate than the scale of the array.
  """
  actual, expected = f64(actual), f64(expected)
  assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
  scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


def assert_grads_close(actual: dict, expected: dict, rtol, what=""):
  assert actual.keys() == expected.keys(), (actual.keys(), expected.keys())
  for name in actual:
    assert_close(actual[name], expected[name], rtol, f"{what} d{name}")


def bits(a):
  """The bytes of an array, for bitwise comparisons (NaN-safe, -0.0 != 0.0)."""
  a = np.asarray(a)
  return a.dtype, a.shape, a.tobytes()


def assert_same_bits(got, want, what):
  """got and want hold the same bits (-0.0 is not 0.0; a NaN equals itself)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
  view = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
  differ = got.view(view) != want.view(view)
  assert not differ.any(), (
      f"{what}: {differ.sum()} of {differ.size} values differ in their bits, e.g. "
      f"{np.asarray(got)[differ][:4]} against {np.asarray(want)[differ][:4]}")


def assert_ep_bits(y, grads, want_y, want_grads, tag, dtype=F32, backend="ffi"):
  """The FFI backends: y and every gradient in the same bits (the shared expert's weight
  gradients to rounding). The XLA backend: to rounding, since XLA:CPU's grouped matmul
  (jax.lax.ragged_dot) gives a row bits that depend on the number of groups, E / P."""
  rtol, grad_rtol = (F32_RTOL, F32_RTOL) if dtype == F32 else (BF16_RTOL, BF16_GRAD_RTOL)
  if backend == "xla":
    assert_close(y, want_y, rtol, f"{tag} y")
    assert_grads_close(grads, want_grads, grad_rtol, tag)
    return
  assert_same_bits(y, want_y, f"{tag} y")
  for name, want in want_grads.items():
    if name in GRAD_NAMES[5:]:
      assert_close(grads[name], want, grad_rtol, f"{tag} {name}")
    else:
      assert_same_bits(grads[name], want, f"{tag} d{name}")


# Shapes of the CUDA tests (T, H, I, E, k, Is): tails of every tile (I % 128 == 64,
# H % 256 != 0), k = E, T = 1, a shared expert; and the most experts a GPU takes (512) for few
# tokens, so that most experts are empty and the others mostly padding rows.
CUDA_SHAPES = (
    (1, 64, 64, 1, 1, 0),
    (37, 128, 192, 5, 2, 0),
    (300, 256, 320, 8, 8, 0),
    (513, 320, 128, 16, 4, 64),
    (2048, 512, 256, 64, 6, 192),
    (40, 192, 128, 512, 16, 64),
)

CUDA_ROUTINGS = ("one_expert", "empty_experts", "out_of_range", "all_invalid", "duplicates")


def cuda_routing(name, T=700, E=8, k=3, seed=1):
  """(T, k) int64 ids of a named adversarial routing, large enough to span several 128-row
  tiles per expert."""
  rng = np.random.default_rng(seed)
  ids = distinct_experts(rng, T, k, E).astype(np.int64)
  if name == "one_expert":
    ids[:] = 5
  elif name == "empty_experts":
    ids = ids % 3  # experts 3.. get nothing (duplicates in a row too)
  elif name == "out_of_range":
    bad = rng.random(ids.shape) < 0.3
    ids[bad] = rng.choice([-1, E, 2**31 - 1], size=bad.sum())
  elif name == "all_invalid":
    ids[:] = -1
  elif name == "duplicates":
    ids[:, 1] = ids[:, 0]
  else:
    raise ValueError(name)
  return ids


# Routed rows an expert, (full 128-row tiles, rows past them): tails of 1-127 rows that ride in
# the expert's last full row tiles, 16 a tile, where there are enough of them (kTail), and ones
# that cannot (more tails than full tiles, or no full tile).
TAIL_COUNTS = ((2, 17), (2, 32), (2, 33), (3, 40), (4, 64), (8, 127), (8, 100), (1, 16), (1, 17),
               (2, 1), (5, 0), (0, 50), (6, 96), (3, 48))


def tail_routing(k=4, seed=2):
  """(T, k) int64 ids that give expert e exactly 128 f + r routes, (f, r) = TAIL_COUNTS[e], in
  random order (an id may repeat in a token's row); the last token's spare slots are -1."""
  counts = [128 * f + r for f, r in TAIL_COUNTS]
  flat = np.repeat(np.arange(len(counts)), counts)
  np.random.default_rng(seed).shuffle(flat)
  T = -(-len(flat) // k)
  return np.concatenate([flat, np.full(T * k - len(flat), -1)]).reshape(T, k)


def per_block_m(params):
  """pytest params: each of `params` (a value or a tuple of values) followed by each block_m the
  CUDA kernel takes. The block_ms of one case come one after another, so a test can cache what
  does not depend on block_m (the oracle, the XLA backend) for just one case at a time."""
  out = []
  for p in params:
    values = p if isinstance(p, tuple) else (p,)
    name = "-".join(map(str, values))
    out += [pytest.param(*values, b, id=f"{name}-block_m{b}") for b in ops.CUDA_BLOCK_MS]
  return out


# CUDA-graph capture of the custom calls (docs/usage.md, Determinism and CUDA graphs), and XLA
# without command buffers.
# Both with XLA's deterministic ops: without them the bits of `loss`, XLA's f32 sum of y * dy,
# differed between processes whose y (and every gradient) had the same bits
# (test_same_bits_in_clusters failed so in 1 of 3 runs at f5068e1 and 3 of 4 at 5ffc795; with
# the flag it passed 4 of 4; one H200, 2026-11-30 18:06-18:09 UTC).
COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                        "--xla_gpu_graph_min_graph_size=1 --xla_gpu_deterministic_ops=true")
NO_COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer= --xla_gpu_deterministic_ops=true"
# Calls of one executable: with command buffers on, the later ones replay the captured graph,
# whose device counters must have been advanced by the kernels themselves.
REPLAYS = 3


def digest(a) -> str:
  a = np.asarray(a)
  return hashlib.sha256(repr((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()


def cuda_digests() -> dict:
  """sha256 of every output of the CUDA backend on one case (a shared expert, tails of every
  tile), for each block_m: {str(block_m): {"fwd": [{"y"}] * REPLAYS, "grad": [{"loss", "y",
  "x", "weights", ...}] * REPLAYS}}, "fwd" from a jitted forward and "grad" from a jitted
  value_and_grad, each executable called REPLAYS times.

  About 128 routed rows an expert, so that experts end on odd and even row tiles alike at
  either block_m; gate|up 640 columns (three column tiles, the last narrow) and down 384 (two,
  the second narrow): in clusters of two, column pairs with and without a second tile."""
  case = make_case(2048, 384, 320, 96, 6, Is=128, dtype=BF16, seed=7)
  out = {}
  for block_m in ops.CUDA_BLOCK_MS:
    config = mok_jax.Config(block_m=block_m)
    fwd = jax.jit(functools.partial(mok_jax.moe, shared=case.shared, config=config,
                                    backend="cuda"))
    grad = jax.jit(grad_fn(case, "cuda", config))
    runs = {"fwd": [], "grad": []}
    for _ in range(REPLAYS):
      runs["fwd"].append({"y": digest(fwd(*case.args()))})
      (loss, y), g = grad(*case.params())
      runs["grad"].append({"loss": digest(loss), "y": digest(y),
                           **{name: digest(v) for name, v in named_grads(case, g).items()}})
    out[str(block_m)] = runs
  return out


@functools.cache
def in_fresh_process(function: str, xla_flags: str, **env):
  """The JSON result of `function` ("module.name", a module of tests/) called in a fresh
  process with XLA_FLAGS=xla_flags (XLA reads them once, when JAX starts its backends) and the
  other environment variables `env`; cached, so that each (function, flags) runs once."""
  module = function.rsplit(".", 1)[0]
  here = os.path.dirname(os.path.abspath(__file__))  # for `import module`
  code = f"import json, {module}; print(json.dumps({function}()))"
  done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, XLA_FLAGS=xla_flags,
                                                               **env),
                        cwd=here, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, f"XLA_FLAGS={xla_flags}: {done.stderr[-4000:]}"
  return json.loads(done.stdout.strip().splitlines()[-1])


def cuda_digests_with(xla_flags: str) -> dict:
  """cuda_digests() in a fresh process with XLA_FLAGS=xla_flags; one process per flags for the
  forward and the backward tests."""
  return in_fresh_process("cases.cuda_digests", xla_flags)


def sanitizer_cases(small_only: bool = False):
  """Forward and backward of the CUDA backend on the small cases that compute-sanitizer checks
  (tools/sanitize.sh): tile tails, a shared expert and out-of-range ids (block_m 128); half
  tiles and several tiles per persistent CTA (block_m 64); each with an expert that no route
  picks; and the backward with recompute. small_only: the two 300-token cases (racecheck, whose
  cost grows with every shared-memory access, takes minutes on the 2500-token one)."""
  shapes = [(300, 128, 192, 8, 3, 64, 128, False), (2500, 256, 128, 64, 8, 0, 64, False),
            (300, 128, 192, 8, 3, 64, 64, True)]
  if small_only:
    shapes = [s for s in shapes if s[0] == 300]
  for T, H, I, E, k, Is, block_m, recompute in shapes:
    rng = np.random.default_rng(T)
    experts = rng.integers(-1, E + 1, (T, k))
    experts[experts == E // 2] = -1  # an expert without routes
    case = make_case(T, H, I, E, k, Is=Is, dtype=BF16, seed=T, experts=experts)
    y, grads = loss_and_grads(case, "cuda", mok_jax.Config(block_m=block_m, recompute=recompute))
    assert np.isfinite(y.astype(np.float32)).all()
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads.values())
  # tools/sanitize.sh requires this line: a run that ends before it checked nothing.
  print(f"sanitizer_cases: {len(shapes)} cases ran", flush=True)
