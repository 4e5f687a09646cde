"""mok_jax: a fused Mixture-of-Experts megakernel for JAX.

    experts, weights = mok_jax.route(logits, top_k)
    y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down)
    y = mok_jax.moe(x, experts, weights, *mok_jax.quantize_experts(w_gate, w_up, w_down),
                    config=mok_jax.Config(precision="fp8"))
"""

from mok_jax.config import Config
from mok_jax.functional import moe, route
from mok_jax.quantize import quantize_experts
from mok_jax.workspace import Workspace

__all__ = ["Config", "Workspace", "moe", "quantize_experts", "route"]
__version__ = "0.1.0"
