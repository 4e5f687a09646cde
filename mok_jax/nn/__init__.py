"""MoE layers for model code: `mok_jax.nn.flax.MoE` (Flax NNX) and `mok_jax.nn.equinox.MoE`.

Importing `mok_jax.nn` imports neither Flax nor Equinox; each submodule imports its framework
when it is first used:

    from mok_jax.nn.flax import MoE        # or: mok_jax.nn.flax.MoE after `import mok_jax.nn`
    from mok_jax.nn.equinox import MoE

Both compute `mok_jax.nn.common.forward` and return (y, MoEAux).
"""

import importlib

from mok_jax.nn.common import MoEAux, MoEOptions, aux_losses, update_bias

__all__ = ["MoEAux", "MoEOptions", "aux_losses", "update_bias", "flax", "equinox"]


def __getattr__(name):
  if name in ("flax", "equinox"):
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
