"""mok_jax.route against a hand-written NumPy router, and its gradient w.r.t. the logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax

# Scores in f32 against float64.
ROUTE_RTOL = 1e-6
GRAD_RTOL = 1e-5


def np_route(logits, top_k, score="softmax", renormalize=True, n_groups=None,
             topk_groups=None, bias=None):
  """One token's (experts, weights, scores) in float64, as docs/usage.md (Routing) states the
  router."""
  logits = np.asarray(logits, np.float64)
  if score == "softmax":
    scores = np.exp(logits - logits.max()) / np.sum(np.exp(logits - logits.max()))
  else:
    scores = 1.0 / (1.0 + np.exp(-logits))
  select = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
  if n_groups is not None:
    groups = select.reshape(n_groups, -1)
    top2 = -np.sort(-groups, axis=1)[:, :2]
    best = np.argsort(-top2.sum(axis=1), kind="stable")[:topk_groups]
    keep = np.zeros(n_groups, bool)
    keep[best] = True
    select = np.where(keep[:, None], groups, -np.inf).reshape(-1)
  experts = np.argsort(-select, kind="stable")[:top_k]  # ties: lower id first
  weights = scores[experts]
  if renormalize:
    weights = weights / (weights.sum() + 1e-20)
  return experts, weights, scores


def np_route_grad(experts, scores, score, renormalize, dweights):
  """d sum(dweights * weights) / d logits for one token, by hand."""
  E = scores.shape[0]
  w = scores[experts]
  if renormalize:  # weights = w / s, s = sum(w)
    s = w.sum()
    dw = dweights / s - np.sum(dweights * w) / s**2
  else:
    dw = dweights
  dscores = np.zeros(E)
  np.add.at(dscores, experts, dw)
  if score == "softmax":  # d p_i / d l_m = p_i (delta_im - p_m)
    return scores * (dscores - np.sum(dscores * scores))
  return dscores * scores * (1.0 - scores)  # sigmoid


def check_rows(logits, experts, weights, **kwargs):
  logits = np.asarray(logits).reshape(-1, np.shape(logits)[-1])
  experts = np.asarray(experts).reshape(logits.shape[0], -1)
  weights = np.asarray(weights).reshape(logits.shape[0], -1)
  assert experts.dtype == np.int32 and weights.dtype == np.float32
  for t in range(logits.shape[0]):
    want_experts, want_weights, _ = np_route(logits[t], experts.shape[1], **kwargs)
    np.testing.assert_array_equal(experts[t], want_experts, err_msg=f"token {t} experts")
    np.testing.assert_allclose(weights[t], want_weights, rtol=ROUTE_RTOL, atol=ROUTE_RTOL,
                               err_msg=f"token {t} weights")


def logits_like(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 2, jnp.float32)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_matches_numpy(score, renormalize):
  logits = logits_like(9, 8, seed=1)
  experts, weights = jax.jit(lambda l: mok_jax.route(l, 3, score=score,
                                                     renormalize=renormalize))(logits)
  assert experts.shape == weights.shape == (9, 3)
  check_rows(logits, experts, weights, score=score, renormalize=renormalize)
  if renormalize:
    np.testing.assert_allclose(np.sum(weights, axis=-1), 1.0, rtol=ROUTE_RTOL)


def test_route_leading_batch_dims():
  logits = logits_like(2, 3, 5, 8, seed=2)
  experts, weights = mok_jax.route(logits, 2, score="sigmoid")
  assert experts.shape == weights.shape == (2, 3, 5, 2)
  check_rows(logits, experts, weights, score="sigmoid")


def test_route_bf16_logits_scored_in_f32():
  logits = logits_like(6, 8, seed=3).astype(jnp.bfloat16)
  experts, weights = mok_jax.route(logits, 2)
  assert weights.dtype == jnp.float32
  check_rows(np.asarray(logits.astype(jnp.float32)), experts, weights)


def test_route_ties_pick_lower_ids():
  experts, weights = mok_jax.route(jnp.zeros((2, 6)), 4)
  np.testing.assert_array_equal(experts, [[0, 1, 2, 3]] * 2)
  np.testing.assert_allclose(weights, 0.25, rtol=ROUTE_RTOL)


def test_route_top_k_equals_E():
  logits = logits_like(4, 5, seed=4)
  experts, weights = mok_jax.route(logits, 5, renormalize=False)
  check_rows(logits, experts, weights, renormalize=False)
  np.testing.assert_allclose(np.sum(weights, axis=-1), 1.0, rtol=ROUTE_RTOL)  # all of softmax


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_bias_selects_but_does_not_weigh(score):
  logits = logits_like(7, 8, seed=5)
  bias = jnp.asarray([0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 0.0, -10.0])
  experts, weights = mok_jax.route(logits, 2, score=score, renormalize=False, bias=bias)
  check_rows(logits, experts, weights, score=score, renormalize=False, bias=bias)
  assert np.all(np.asarray(experts)[:, 0] == 5) and not np.any(np.asarray(experts) == 7)
  unbiased = jax.nn.softmax(logits) if score == "softmax" else jax.nn.sigmoid(logits)
  np.testing.assert_allclose(weights[:, 0], unbiased[:, 5], rtol=ROUTE_RTOL)
  # No gradient reaches the bias.
  g = jax.grad(lambda b: jnp.sum(mok_jax.route(logits, 2, score=score, bias=b)[1] ** 2))(bias)
  np.testing.assert_array_equal(g, np.zeros(8))


@pytest.mark.parametrize("n_groups, topk_groups, top_k",
                         [(4, 2, 4), (4, 1, 2), (8, 3, 3), (16, 4, 4), (1, 1, 3)])
def test_route_groups_deepseek_v3(n_groups, topk_groups, top_k):
  """Sigmoid scores with a selection bias and group-limited routing, as in DeepSeek-V3."""
  E = 16
  logits = logits_like(12, E, seed=n_groups)
  bias = jnp.asarray(np.random.default_rng(6).standard_normal(E) * 0.3, jnp.float32)
  kwargs = dict(score="sigmoid", n_groups=n_groups, topk_groups=topk_groups, bias=bias)
  experts, weights = mok_jax.route(logits, top_k, **kwargs)
  check_rows(logits, experts, weights, **kwargs)
  groups = np.asarray(experts) // (E // n_groups)
  assert all(len(set(row)) <= topk_groups for row in groups)


def test_route_groups_change_the_selection():
  """Expert 0 has the best sigmoid score, but its group's two best sum to 1.0 < 2 sigmoid(1):
  group-limited routing (1 group of 2) takes experts 2 and 3 instead."""
  logits = jnp.asarray([[5.0, -5.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
  kwargs = dict(score="sigmoid", n_groups=4, topk_groups=1)
  experts, weights = mok_jax.route(logits, 2, **kwargs)
  assert list(np.asarray(experts)[0]) == [2, 3]
  check_rows(logits, experts, weights, **kwargs)
  experts, _ = mok_jax.route(logits, 2, score="sigmoid")
  assert list(np.asarray(experts)[0]) == [0, 2]


GRAD_OPTIONS = [
    dict(score="softmax", renormalize=True),
    dict(score="softmax", renormalize=False),
    dict(score="sigmoid", renormalize=True),
    dict(score="sigmoid", renormalize=False),
    dict(score="sigmoid", renormalize=True, n_groups=4, topk_groups=2,
         bias=np.linspace(-0.2, 0.2, 8).astype(np.float32)),
]


@pytest.mark.parametrize("kwargs", GRAD_OPTIONS, ids=["softmax", "softmax_raw", "sigmoid",
                                                      "sigmoid_raw", "sigmoid_groups_bias"])
def test_route_grad_wrt_logits(kwargs):
  logits = logits_like(6, 8, seed=7)
  dweights = np.random.default_rng(8).standard_normal((6, 3))

  def loss(l):
    return jnp.sum(mok_jax.route(l, 3, **kwargs)[1] * dweights)

  got = np.asarray(jax.jit(jax.grad(loss))(logits))
  for t in range(6):
    experts, _, scores = np_route(logits[t], 3, **kwargs)
    want = np_route_grad(experts, scores, kwargs["score"], kwargs["renormalize"], dweights[t])
    np.testing.assert_allclose(got[t], want, rtol=GRAD_RTOL, atol=GRAD_RTOL * np.abs(want).max(),
                               err_msg=f"token {t}")
