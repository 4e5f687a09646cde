"""The implementations under test: mok_jax's backends and the peers a JAX user would pick.

Every JAX implementation is a function layer(x, experts, weights, w_gate, w_up, w_down, shared)
-> y with mok_jax.moe's contract. The JAX peers are the `xla` backend's layer (sort routes by
expert, grouped gate/up matmuls, SwiGLU, grouped down matmul, weighted combine) with its grouped
matmul swapped: `jax.lax.ragged_dot` or `tokamax.ragged_dot`. The PyTorch peer (the same layer
on `torch._grouped_mm`) lives in torch_peer.py; it runs in a process without JAX on the GPU.

`jax_layer` raises `Unavailable` with the reason when an implementation cannot run here (not
installed, fails to import, not supported by the device or dtype); the benchmark reports that
reason in the implementation's row.
"""

from __future__ import annotations

import dataclasses
import functools


class Unavailable(Exception):
  """The implementation cannot run here; str(self) says why."""


@dataclasses.dataclass(frozen=True)
class Impl:
  name: str  # as printed and stored
  group: str  # "mok_jax" (under test) or "peer"
  framework: str  # "jax" or "torch"
  label: str  # short, for the chart legend


IMPLS = {
    i.name: i for i in (
        Impl("mok_jax:cuda", "mok_jax", "jax", "mok_jax cuda"),
        Impl("mok_jax:xla", "mok_jax", "jax", "mok_jax xla"),
        Impl("mok_jax:ffi", "mok_jax", "jax", "mok_jax ffi (C++ on CPU)"),
        Impl("jax.ragged_dot", "peer", "jax", "jax.lax.ragged_dot"),
        Impl("tokamax.ragged_dot", "peer", "jax", "tokamax.ragged_dot"),
        Impl("torch._grouped_mm", "peer", "torch", "torch._grouped_mm"),
    )
}
ALIASES = {"cuda": "mok_jax:cuda", "xla": "mok_jax:xla", "ffi": "mok_jax:ffi",
           "jax": "jax.ragged_dot", "ragged_dot": "jax.ragged_dot", "tokamax": "tokamax.ragged_dot",
           "torch": "torch._grouped_mm"}
PEERS = tuple(name for name, impl in IMPLS.items() if impl.group == "peer")


def mok_backends(platform: str) -> tuple[str, ...]:
  """mok_jax backends worth timing on a platform: on a GPU the CUDA kernel and the pure-JAX
  path ("ffi" is the CUDA kernel there too); on a CPU the pure-JAX path and the C++ targets."""
  if platform == "gpu":
    return ("mok_jax:cuda", "mok_jax:xla")
  return ("mok_jax:xla", "mok_jax:ffi")


def default_impls(platform: str) -> list[str]:
  return list(mok_backends(platform)) + list(PEERS)


def resolve(names: str, platform: str) -> list[str]:
  """--impls text (comma-separated names or aliases; empty: the defaults) -> names."""
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


def describe_exception(exc: BaseException, limit: int = 400) -> str:
  text = f"{type(exc).__name__}: {exc}".strip()
  first = " ".join(text.split())
  return first if len(first) <= limit else first[:limit - 3] + "..."


def is_oom(exc: BaseException) -> bool:
  text = f"{type(exc).__name__} {exc}"
  return ("RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
          or "OutOfMemory" in text)


def failure_status(exc: BaseException) -> str:
  return "oom" if is_oom(exc) else "error"


def jax_layer(name: str, shape, dtype, ep: int = 1):
  """(layer, note) for a JAX implementation, or raises Unavailable. note: None, a text for
  every mode, or a dict of texts by mode. ep > 1: mok_jax's layer with expert parallelism over
  the first ep devices, in shard_map (tokens and experts split over them)."""
  import jax  # pylint: disable=import-outside-toplevel

  import mok_jax  # pylint: disable=import-outside-toplevel
  from mok_jax import expert_parallel, ops  # pylint: disable=import-outside-toplevel
  from mok_jax.config import Config  # pylint: disable=import-outside-toplevel

  if name.startswith("mok_jax:"):
    backend = name.split(":", 1)[1]
    platform = jax.default_backend()
    dims = ops.MoeDims(shape.T, shape.H, shape.I, shape.E, shape.k, shape.Is)
    if backend == "cuda" or (backend == "ffi" and platform != "cpu"):
      reason = ops.cuda_unsupported_reason(platform, dtype, dims, Config())
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

    if ep > 1:
      layer = _expert_parallel(layer, shape, ep)
    note = None
    has_target = getattr(ops, "has_cuda_target", None)
    if (backend != "xla" and platform == "gpu" and has_target is not None
        and not has_target("mok_moe_bwd")):
      note = {"fwd+bwd": "no CUDA backward built: the kernel's forward, then the XLA "
                         "backend's VJP (which recomputes the forward)"}
    return layer, note

  if ep > 1:
    raise Unavailable("no expert parallelism in this implementation")
  if name == "jax.ragged_dot":
    grouped, note = jax.lax.ragged_dot, None
  elif name == "tokamax.ragged_dot":
    grouped, note = _tokamax_ragged_dot(shape, dtype)
  else:
    raise ValueError(f"{name} is not a JAX implementation")

  pieces = expert_parallel.XlaPieces(ragged_dot=_operand_dtype_out(grouped))

  def layer(x, experts, weights, w_gate, w_up, w_down, shared):
    return expert_parallel.routed_moe(x, experts, weights, w_gate, w_up, w_down, shared,
                                      pieces=pieces, axis_name=None, config=Config())

  return layer, note


def _expert_parallel(layer, shape, ep: int):
  """layer in shard_map over a mesh ("ep",) of the first ep devices: tokens, routes and experts
  split over it, the shared expert replicated."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType, PartitionSpec  # pylint: disable=import-outside-toplevel

  if len(jax.devices()) < ep:
    raise Unavailable(f"--ep {ep} needs {ep} devices, found {len(jax.devices())}")
  if shape.E % ep:
    raise Unavailable(f"--ep {ep} does not divide the {shape.E} experts")
  mesh = jax.make_mesh((ep,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
  split = PartitionSpec("ep")

  def sharded(x, experts, weights, w_gate, w_up, w_down, shared):
    f = jax.shard_map(lambda *a: layer(*a[:6], a[6] if a[6:] else None), mesh=mesh,
                      in_specs=(split,) * 6 + ((PartitionSpec(),) if shared else ()),
                      out_specs=split)
    return f(x, experts, weights, w_gate, w_up, w_down, *((shared,) if shared else ()))

  return sharded


def _operand_dtype_out(grouped):
  """`grouped` with its product in the operands' dtype, widened afterwards, as a user of the
  peers writes the layer: tokamax's backward takes a cotangent of the operands' dtype only
  ("lhs and rhs must have the same dtype" for an f32 one), and jax.lax.ragged_dot with f32
  products ran mixtral's forward+backward at half the rate of bf16 products (47 against 93
  TFLOP/s on an H200)."""

  def call(lhs, rhs, group_sizes, preferred_element_type=None, **kwargs):
    out = grouped(lhs, rhs, group_sizes=group_sizes, **kwargs)
    return out if preferred_element_type is None else out.astype(preferred_element_type)

  return call


def _tokamax_ragged_dot(shape, dtype):
  """tokamax.ragged_dot as a user calls it (implementation=None: tokamax picks), and a note
  naming the implementation it picks for this layer's gate/up product, found the way tokamax
  finds it: the first of its defaults that does not raise NotImplementedError."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except BaseException as exc:  # SyntaxError on Python < 3.12, missing deps, ...
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
      raise
    raise Unavailable(f"import tokamax failed: {describe_exception(exc)}") from None
  grouped = getattr(tokamax, "ragged_dot", None)
  if grouped is None:
    raise Unavailable(f"tokamax {getattr(tokamax, '__version__', '?')} has no ragged_dot")
  try:
    note = _tokamax_pick(grouped, shape, dtype)
  except Exception as exc:  # pylint: disable=broad-except
    note = f"could not tell which tokamax implementation runs: {describe_exception(exc, 200)}"

  return grouped, note


def _layer_precision(reference, dtype):
  """The precision reference.expert_rows passes its grouped matmul for this dtype (HIGHEST for
  f32; None, the default, for bf16: tokamax's backward rejects an explicit one), so that the
  probe below lowers the call the layer makes. The bench passes no precision of its own."""
  pick = getattr(reference, "_precision", None)  # pylint: disable=protected-access
  if pick is not None:
    return pick(dtype)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _tokamax_pick(grouped, shape, dtype) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from mok_jax import reference  # pylint: disable=import-outside-toplevel

  try:
    from tokamax._src.ops.ragged_dot import api  # pylint: disable=import-outside-toplevel
    order = tuple(api._DEFAULT_IMPLEMENTATIONS)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    order = ("mosaic", "triton", "xla")
  sds = jax.ShapeDtypeStruct
  args = (sds((shape.T * shape.k, shape.H), dtype), sds((shape.E, shape.H, shape.I), dtype),
          sds((shape.E,), jnp.int32))
  skipped = []
  for impl in order:
    # As _operand_dtype_out calls it: the product in the operands' dtype.
    call = functools.partial(grouped, precision=_layer_precision(reference, dtype),
                             implementation=impl, bypass_device_check=False)
    try:
      jax.jit(lambda a, b, g, call=call: call(a, b, group_sizes=g)).lower(*args)
    except NotImplementedError as exc:
      skipped.append(f"{impl}: {describe_exception(exc, 120)}")
      continue
    except Exception as exc:  # pylint: disable=broad-except
      return f"tokamax implementation {impl!r} fails to lower: {describe_exception(exc, 200)}"
    if skipped:
      return f"tokamax fell back to {impl!r} ({'; '.join(skipped)})"
    return f"tokamax implementation {impl!r}"
  return "no tokamax implementation lowers: " + "; ".join(skipped)
