"""mok_jax: a fused Mixture-of-Experts megakernel for JAX.

    experts, weights = mok_jax.route(logits, top_k)
    y = mok_jax.moe(x, experts, weights, w_gate, w_up, w_down)
"""

from mok_jax.config import Config
from mok_jax.functional import moe, route

__all__ = ["Config", "moe", "route"]
__version__ = "0.1.0"
