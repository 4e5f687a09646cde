"""`jax.export` of a differentiated layer on the FFI targets (README, Usage): allowed with the
targets' safety checks disabled, and the exported call gives the jitted call's bits."""

import jax
import jax.numpy as jnp
from jax import export

import mok_jax
from cases import BF16, bits, make_case


def test_export_with_the_targets_allowed():
  case = make_case(T=24, H=16, I=8, E=4, k=2, Is=8, dtype=BF16)

  def loss(x, w_gate, w_up, w_down):
    y = mok_jax.moe(x, case.experts, case.weights, w_gate, w_up, w_down, shared=case.shared,
                    backend="ffi")
    return jnp.sum(y.astype(jnp.float32) * case.dy)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
  args = (case.x, case.w_gate, case.w_up, case.w_down)
  allowed = [export.DisabledSafetyCheck.custom_call(n) for n in ("mok_moe_fwd", "mok_moe_bwd")]
  exported = export.export(f, disabled_checks=allowed)(*args)
  assert "mok_moe_bwd" in exported.mlir_module()
  got, want = exported.call(*args), f(*args)
  assert [bits(a) for a in jax.tree.leaves(got)] == [bits(a) for a in jax.tree.leaves(want)]
