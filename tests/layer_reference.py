"""What the Flax and Equinox layer tests share: a dense reference of the MoE layer (every expert
on every token, a (T, E) gate matrix zero off the top k), the auxiliary losses' formulas in
NumPy, the layer cases and their tolerances."""

import jax
import jax.numpy as jnp
import numpy as np

F32_RTOL = 2e-5  # f32 layer vs f32 dense reference (different summation order)
BF16_RTOL = 3e-2  # bf16 compute dtype vs the f32 reference
GRAD_RTOL = 1e-4
HI = jax.lax.Precision.HIGHEST

# Layer options by case name, on top of LAYER (H 16, I 8, E 8, k 2).
LAYER = dict(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2)
CASES = {
    "softmax": dict(),
    "sigmoid_groups_shared": dict(score="sigmoid", renormalize=False, n_groups=4, topk_groups=2,
                                  shared_intermediate_size=6),
    "top1_shared_renorm": dict(top_k=1, shared_intermediate_size=4),
}


def layer_options(case="softmax", **kw) -> dict:
  return {**LAYER, **CASES[case], **kw}


def dense_moe(x, p, *, top_k, score="softmax", renormalize=True, n_groups=None,
              topk_groups=None, bias=None):
  """(y, load_balancing_loss, router_z_loss, counts) of the layer, written out densely."""
  x = x.reshape(-1, x.shape[-1])
  E = p["router"].shape[1]
  logits = jnp.dot(x, p["router"], precision=HI)
  scores = jax.nn.softmax(logits) if score == "softmax" else jax.nn.sigmoid(logits)
  select = jax.lax.stop_gradient(scores) + (0.0 if bias is None else bias)
  if n_groups is not None:
    grouped = select.reshape(-1, n_groups, E // n_groups)
    group_score = -jnp.sort(-grouped, axis=-1)[..., :2].sum(-1)
    kept = jnp.argsort(-group_score, axis=-1, stable=True)[:, :topk_groups]
    keep = (jnp.arange(n_groups)[None, None, :] == kept[:, :, None]).any(1)
    select = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(-1, E)
  chosen = jnp.argsort(-select, axis=-1, stable=True)[:, :top_k]
  mask = (jnp.arange(E)[None, None, :] == chosen[:, :, None]).any(1)
  gate = jnp.where(mask, scores, 0.0)
  if renormalize:
    gate = gate / (gate.sum(-1, keepdims=True) + 1e-20)
  ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HI)  # noqa: E731
  h = jax.nn.silu(ein("th,ehi->tei", x, p["w_gate"])) * ein("th,ehi->tei", x, p["w_up"])
  y = jnp.einsum("te,teh->th", gate, ein("tei,eih->teh", h, p["w_down"]), precision=HI)
  if p.get("ws_gate") is not None:
    hs = jax.nn.silu(jnp.dot(x, p["ws_gate"], precision=HI)) * jnp.dot(x, p["ws_up"], precision=HI)
    y = y + jnp.dot(hs, p["ws_down"], precision=HI)
  probs = scores if score == "softmax" else scores / scores.sum(-1, keepdims=True)
  counts = mask.sum(0)
  lb = E * jnp.sum(jax.lax.stop_gradient(counts / (x.shape[0] * top_k)) * probs.mean(0))
  z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  return y, lb, z, counts


def ref_kwargs(moe):
  """dense_moe's routing options from a layer's."""
  o = moe.options
  return dict(top_k=o.top_k, score=o.score, renormalize=o.renormalize, n_groups=o.n_groups,
              topk_groups=o.topk_groups)


def dense_ref(moe, params, x, **kw):
  """dense_moe with the layer's options and its parameters (by name), jitted."""
  return jax.jit(lambda x, p: dense_moe(x, p, **ref_kwargs(moe), **kw))(x, params)


def aux_numpy(logits, experts, E, score):
  """The documented formulas (MoEAux) in float64 NumPy."""
  logits = np.asarray(logits, np.float64)
  T, k = experts.shape
  if score == "softmax":
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
  else:
    s = 1 / (1 + np.exp(-logits))
    probs = s / s.sum(-1, keepdims=True)
  counts = np.bincount(np.asarray(experts).ravel(), minlength=E)
  lb = E * np.sum(counts / (T * k) * probs.mean(0))
  m = logits.max(-1)
  z = np.mean((m + np.log(np.exp(logits - m[:, None]).sum(-1))) ** 2)
  return lb, z, counts


def tokens(shape=(3, 5, 16), seed=1, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)
