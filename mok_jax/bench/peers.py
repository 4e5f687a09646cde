"""The implementations under test: mok_jax's backends and the peers a JAX user would pick.

Every JAX implementation is layer(x, experts, weights, w_gate, w_up, w_down, shared) -> y with
mok_jax.moe's contract. The JAX peers are the xla backend's routed layer with its grouped matmul
swapped for `jax.lax.ragged_dot` or `tokamax.ragged_dot`; the PyTorch peer (torch_peer.py) runs
in a process without JAX on the GPU. `jax_layer` raises Unavailable with the reason when one
cannot run here, which the benchmark reports in its row.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, PartitionSpec

import mok_jax
from mok_jax import expert_parallel, ops, reference
from mok_jax.bench.records import failure

# name -> the chart's label; the order is the table's and the chart's.
IMPLS = {"mok_jax:cuda": "mok_jax cuda", "mok_jax:xla": "mok_jax xla",
         "mok_jax:ffi": "mok_jax ffi (C++ on CPU)", "jax.ragged_dot": "jax.lax.ragged_dot",
         "tokamax.ragged_dot": "tokamax.ragged_dot", "torch._grouped_mm": "torch._grouped_mm"}
ALIASES = {"cuda": "mok_jax:cuda", "xla": "mok_jax:xla", "ffi": "mok_jax:ffi",
           "jax": "jax.ragged_dot", "ragged_dot": "jax.ragged_dot", "tokamax": "tokamax.ragged_dot",
           "torch": "torch._grouped_mm"}
PEERS = ("jax.ragged_dot", "tokamax.ragged_dot", "torch._grouped_mm")


class Unavailable(Exception):
  """The implementation cannot run here; str(self) says why."""


def group(name: str) -> str:
  return "mok_jax" if name.startswith("mok_jax:") else "peer" if name in PEERS else "ceiling"


def default_impls(platform: str) -> list[str]:
  """On a GPU "ffi" is the CUDA kernel too; on a CPU it is the C++ targets."""
  mine = ["mok_jax:cuda", "mok_jax:xla"] if platform == "gpu" else ["mok_jax:xla", "mok_jax:ffi"]
  return mine + list(PEERS)


def resolve(names: str, platform: str) -> list[str]:
  """--impls text (names or aliases; empty: the platform's defaults) -> names."""
  if not names:
    return default_impls(platform)
  out = []
  for raw in (n.strip() for n in names.split(",") if n.strip()):
    name = ALIASES.get(raw, raw)
    if name not in IMPLS:
      raise ValueError(f"unknown implementation {raw!r}; known: {', '.join(IMPLS)} "
                       f"(aliases: {', '.join(ALIASES)})")
    if name not in out:
      out.append(name)
  return out


def jax_layer(name: str, shape, dtype, ep: int = 1):
  """(layer, note) or raises Unavailable; note is None, a text, or texts by mode. ep > 1:
  mok_jax's layer in shard_map over the first ep devices, tokens and experts split."""

  if name.startswith("mok_jax:"):
    backend, platform = name.split(":", 1)[1], jax.default_backend()
    if backend == "cuda" or (backend == "ffi" and platform != "cpu"):
      dims = ops.MoeDims(shape.T, shape.H, shape.I, shape.E, shape.k, shape.Is)
      reason = ops.cuda_unsupported_reason(platform, dtype, dims, mok_jax.Config())
      if reason:
        raise Unavailable(reason)
    elif backend == "ffi":
      try:
        ops.check_ffi_dtype(dtype)
      except ValueError as exc:
        raise Unavailable(str(exc)) from None

    def layer(x, experts, weights, w_gate, w_up, w_down, shared):
      return mok_jax.moe(x, experts, weights, w_gate, w_up, w_down, shared=shared,
                         backend=backend, axis_name="ep" if ep > 1 else None)

    note = None
    if backend != "xla" and platform == "gpu" and not ops.has_cuda_target("mok_moe_bwd"):
      note = {"fwd+bwd": "no CUDA backward built: the kernel's forward, then the XLA "
                         "backend's VJP (which recomputes the forward)"}
    return (_expert_parallel(layer, shape, ep) if ep > 1 else layer), note

  if ep > 1:
    raise Unavailable("no expert parallelism in this implementation")
  grouped, note = (jax.lax.ragged_dot, None) if name == "jax.ragged_dot" else _tokamax(shape, dtype)
  pieces = expert_parallel.XlaPieces(ragged_dot=_operand_dtype_out(grouped))

  def layer(x, experts, weights, w_gate, w_up, w_down, shared):
    return expert_parallel.routed_moe(x, experts, weights, w_gate, w_up, w_down, shared,
                                      pieces=pieces, axis_name=None, config=mok_jax.Config())

  return layer, note


def _expert_parallel(layer, shape, ep: int):
  if len(jax.devices()) < ep:
    raise Unavailable(f"--ep {ep} needs {ep} devices, found {len(jax.devices())}")
  if shape.E % ep:
    raise Unavailable(f"--ep {ep} does not divide the {shape.E} experts")
  mesh = jax.make_mesh((ep,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
  split = PartitionSpec("ep")

  def sharded(x, experts, weights, w_gate, w_up, w_down, shared):
    rest = (shared,) if shared else ()  # replicated
    f = jax.shard_map(lambda *a: layer(*a[:6], a[6] if a[6:] else None), mesh=mesh,
                      in_specs=(split,) * 6 + (PartitionSpec(),) * len(rest), out_specs=split)
    return f(x, experts, weights, w_gate, w_up, w_down, *rest)

  return sharded


def _operand_dtype_out(grouped):
  """`grouped` with its product in the operands' dtype, widened afterwards, as a user of the
  peers writes the layer: tokamax's backward rejects a cotangent of another dtype, and
  jax.lax.ragged_dot with f32 products ran mixtral's fwd+bwd at half the rate of bf16 ones
  (47 against 93 TFLOP/s on an H200)."""

  def call(lhs, rhs, group_sizes, preferred_element_type=None, **kwargs):
    out = grouped(lhs, rhs, group_sizes=group_sizes, **kwargs)
    return out if preferred_element_type is None else out.astype(preferred_element_type)

  return call


def _tokamax(shape, dtype):
  """tokamax.ragged_dot as a user calls it (tokamax picks), and a note naming what it picks for
  the gate/up product, found as tokamax finds it: the first of its defaults that lowers."""


  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except Exception as exc:  # pylint: disable=broad-except  # SyntaxError on Python < 3.12, ...
    raise Unavailable(f"import tokamax failed: {failure(exc)['reason']}") from None
  if not hasattr(tokamax, "ragged_dot"):
    raise Unavailable(f"tokamax {getattr(tokamax, '__version__', '?')} has no ragged_dot")
  try:
    from tokamax._src.ops.ragged_dot import api  # pylint: disable=import-outside-toplevel
    order = tuple(api._DEFAULT_IMPLEMENTATIONS)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    order = ("mosaic", "triton", "xla")
  sds = jax.ShapeDtypeStruct
  args = (sds((shape.T * shape.k, shape.H), dtype), sds((shape.E, shape.H, shape.I), dtype),
          sds((shape.E,), "int32"))
  precision = reference._precision(dtype)  # pylint: disable=protected-access  # the layer's
  skipped = []
  for impl in order:
    def probe(a, b, g, impl=impl):
      return tokamax.ragged_dot(a, b, group_sizes=g, precision=precision, implementation=impl,
                                bypass_device_check=False)
    try:
      jax.jit(probe).lower(*args)
    except NotImplementedError as exc:
      skipped.append(f"{impl}: {failure(exc, 120)['reason']}")
      continue
    except Exception as exc:  # pylint: disable=broad-except
      return tokamax.ragged_dot, (f"tokamax implementation {impl!r} fails to lower: "
                                  f"{failure(exc, 200)['reason']}")
    return tokamax.ragged_dot, (f"tokamax fell back to {impl!r} ({'; '.join(skipped)})"
                                if skipped else f"tokamax implementation {impl!r}")
  return tokamax.ragged_dot, "no tokamax implementation lowers: " + "; ".join(skipped)
