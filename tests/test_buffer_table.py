"""The targets' buffers are listed once, in mok_jax.ops (FWD_OPERANDS, FWD_RESULTS, BWD_OPERANDS,
BWD_RESULTS, BWD_ALIASES, and the FP8 targets' FWD_FP8_*, BWD_FP8_*) and, for the NVLink
transport's, mok_jax.ep_transport (DISPATCH_*, COMBINE_*): the C++ bindings, the argument
structs, every handler's parameters and docs/design.md must name the same buffers in the same
order."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import pytest

from mok_jax import ep_transport, ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS_H = (ROOT / "ffi" / "moe_args.h").read_text()
EP_CC = (ROOT / "ffi" / "ep_transport_cuda.cc").read_text()
FWD = ops.FWD_OPERANDS + ops.FWD_RESULTS
BWD = ops.BWD_OPERANDS + ops.BWD_RESULTS
COMBINE = ops.COMBINE_OPERANDS + ops.COMBINE_RESULTS
FWD_FP8 = ops.FWD_FP8_OPERANDS + ops.FWD_FP8_RESULTS
BWD_FP8 = ops.BWD_FP8_OPERANDS + ops.BWD_FP8_RESULTS
EP_DISPATCH = ep_transport.DISPATCH_OPERANDS + ep_transport.DISPATCH_RESULTS
EP_COMBINE = ep_transport.COMBINE_OPERANDS + ep_transport.COMBINE_RESULTS


def _bound_names(binder: str, src: str = ARGS_H) -> tuple[str, ...]:
  """The buffer names of BindMoeFwd / BindMoeBwd, from the comment on each Arg and Ret, with
  those of the binders they call (BindMoeInputs) in their place."""
  body = src[src.index(f"auto {binder}("):]
  body = body[body.index("{"):body.index("\n}\n")]
  found = re.findall(r"\b(Bind\w+)\(|template (?:Arg|Ret)<ffi::AnyBuffer>\(\);?\s*// "
                     r"(?:scratch )?(\w+)", body)
  return tuple(n for call, name in found for n in (_bound_names(call, src) if call else (name,)))


def _struct_fields(name: str) -> tuple[str, ...]:
  body = ARGS_H[ARGS_H.index(f"struct {name} {{"):]
  body = body[:body.index("\n};")]
  return tuple(re.findall(r"^\s*(?:ffi::AnyBuffer|MoeResiduals) (\w+);", body, re.M))


def _handler_params(path: str, function: str) -> tuple[str, ...]:
  src = (ROOT / "ffi" / path).read_text()
  match = re.search(rf"ffi::Error {function}\((.*?)\)\s*\{{", src, re.S)
  assert match, f"{path}: no handler {function}"
  return tuple(re.findall(r"(?:ffi::Result<ffi::AnyBuffer>|ffi::AnyBuffer|Buf|Out) (\w+)",
                          match.group(1)))


def test_bindings_name_the_table():
  assert _bound_names("BindMoeFwd") == FWD
  assert _bound_names("BindMoeBwd") == BWD
  assert _bound_names("BindMoeCombine") == COMBINE
  assert _bound_names("BindMoeFwdFp8") == FWD_FP8
  assert _bound_names("BindMoeBwdFp8") == BWD_FP8
  assert _bound_names("BindEpDispatch", EP_CC) == EP_DISPATCH
  assert _bound_names("BindEpCombine", EP_CC) == EP_COMBINE


def test_ep_scratch_results_are_marked():
  """The dispatch's last DISPATCH_SCRATCH results are scratch (the wrapper drops them)."""
  body = EP_CC[EP_CC.index("auto BindEpDispatch("):]
  scratch = re.findall(r"Ret<ffi::AnyBuffer>\(\)\s*// scratch (\w+)", body[:body.index("\n}\n")])
  assert tuple(scratch) == ep_transport.DISPATCH_RESULTS[-ep_transport.DISPATCH_SCRATCH:]


def test_structs_hold_the_table():
  assert _struct_fields("MoeInputs") == ops.FWD_OPERANDS
  assert _struct_fields("MoeResiduals") == ops.Residuals._fields
  fwd = _struct_fields("MoeFwdResults")
  assert fwd[0] == "y" and fwd[1] == "res" and fwd[2:] == ops.FWD_RESULTS[1 + len(
      ops.Residuals._fields):]
  assert _struct_fields("MoeBwdResults") == ops.BWD_RESULTS
  assert _struct_fields("MoeFp8Inputs") == ops.FWD_FP8_OPERANDS
  assert _struct_fields("MoeFwdFp8Results") == ops.FWD_FP8_RESULTS
  assert _struct_fields("MoeFp8Residuals") == ops.Fp8Residuals._fields
  assert _struct_fields("MoeBwdFp8Scratch") == ops.BWD_FP8_RESULTS[len(ops.BWD_RESULTS):]


@pytest.mark.parametrize("path, function, names", [
    ("moe_fwd_cpu.cc", "MoeFwd", FWD), ("moe_fwd_cuda.cc", "MoeFwdCuda", FWD),
    ("moe_bwd_cpu.cc", "MoeBwd", BWD), ("moe_bwd_cuda.cc", "MoeBwdCuda", BWD),
    ("moe_fwd_cpu.cc", "MoeFwdFp8", FWD_FP8), ("moe_fwd_fp8_cuda.cc", "MoeFwdFp8Cuda", FWD_FP8),
    ("moe_bwd_cpu.cc", "MoeBwdFp8", BWD_FP8), ("moe_bwd_fp8_cuda.cc", "MoeBwdFp8Cuda", BWD_FP8),
    ("moe_combine_cpu.cc", "MoeCombine", COMBINE),
    ("moe_combine_cuda.cc", "MoeCombineCuda", COMBINE),
    ("ep_transport_cuda.cc", "EpDispatchCuda", EP_DISPATCH),
    ("ep_transport_cuda.cc", "EpCombineCuda", EP_COMBINE)])
def test_handlers_take_the_table(path, function, names):
  assert _handler_params(path, function) == names


def test_python_declares_the_table():
  dims = ops.MoeDims(T=5, H=64, I=64, E=3, k=2, Is=64)
  assert len(ops.fwd_results(dims, jnp.bfloat16, jnp.bfloat16, 64)) == len(ops.FWD_RESULTS)
  assert len(ops.bwd_results(dims, jnp.bfloat16, 64)) == len(ops.BWD_RESULTS)
  aliases = ops.bwd_aliases(dims)
  assert {(ops.BWD_OPERANDS[o], ops.BWD_RESULTS[r]) for o, r in aliases.items()} == set(
      ops.BWD_ALIASES)
  assert ops.bwd_aliases(dims._replace(Is=0)) == {
      ops.BWD_OPERANDS.index(o): ops.BWD_RESULTS.index(r) for o, r in ops.BWD_ALIASES
      if o != "gu_shared"}
  assert ops.bwd_aliases(dims, recompute=True) == {}
  fp8 = ops.MoeDims(T=5, H=128, I=128, E=3, k=2, Is=128)
  assert len(ops.fwd_fp8_results(fp8, jnp.bfloat16, 64)) == len(ops.FWD_FP8_RESULTS)
  assert len(ops.bwd_fp8_results(fp8, 64)) == len(ops.BWD_FP8_RESULTS)


def test_design_doc_lists_the_results_in_order():
  """docs/design.md's table of mok_moe_fwd's results and its list of mok_moe_bwd's."""
  doc = (ROOT / "docs" / "design.md").read_text()
  rows = re.findall(r"^\| (\w+)(?:, (\w+))? \|", doc, re.M)
  fwd = [n for row in rows for n in row if n and n in ops.FWD_RESULTS]
  assert tuple(fwd[:len(ops.FWD_RESULTS)]) == ops.FWD_RESULTS
  section = doc[doc.index("`mok_moe_bwd` takes"):doc.index("Aliasing")]
  named = [n for n in re.findall(r"\b(\w+)\b", section) if n in ops.BWD_RESULTS]
  order = list(dict.fromkeys(named))
  assert order == [n for n in ops.BWD_RESULTS if n in order] and set(order) == set(
      ops.BWD_RESULTS)
