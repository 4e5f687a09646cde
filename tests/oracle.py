"""The NumPy float64 oracle of the MoE layer (docs/usage.md, "What the layer computes"), at
the top of the tests.

A plain loop over experts, no sorting: for each expert e, the routes (t, j) with
experts[t, j] == e run e's MLP on x[t] and add weights[t, j] times its output to y[t]. An id
outside [0, E) matches no e in range(E), so it contributes nothing. Everything is float64; with
`round_to=bf16` the values are rounded where the backends round them (reference.py): the SwiGLU
activation h, each route's expert output and the shared expert's output, and y at the end.
The backward is written out by hand and is not rounded (bf16 tests use a bf16 tolerance).
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

f64 = np.float64


class Grads(NamedTuple):
  x: np.ndarray  # (T, H)
  weights: np.ndarray  # (T, k)
  w_gate: np.ndarray  # (E, H, I)
  w_up: np.ndarray  # (E, H, I)
  w_down: np.ndarray  # (E, I, H)
  shared: tuple | None  # (ws_gate (H, Is), ws_up (H, Is), ws_down (Is, H)) or None


def _np(a):
  return np.asarray(a).astype(f64)


def _rounder(round_to):
  if round_to is None or np.dtype(round_to) == np.float32:
    return lambda v: v  # f32 backends round nothing that the f32 tolerance would see
  if np.dtype(round_to) == np.dtype(ml_dtypes.bfloat16):
    return lambda v: v.astype(ml_dtypes.bfloat16).astype(f64)
  raise ValueError(f"oracle: cannot round to {round_to}")


def sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def silu(v):
  return v * sigmoid(v)


def silu_grad(v):
  s = sigmoid(v)
  return s * (1.0 + v * (1.0 - s))


def mlp(v, w_gate, w_up, w_down, rnd):
  """(silu(v @ w_gate) * (v @ w_up)) @ w_down for the rows of v; returns (out, g, u, h)."""
  g, u = v @ w_gate, v @ w_up
  h = rnd(silu(g) * u)
  return h @ w_down, g, u, h


def mlp_backward(v, w_gate, w_up, w_down, g, u, h, dout):
  """Gradients of sum(dout * mlp(v)) w.r.t. v, w_gate, w_up, w_down (rows of v summed)."""
  dh = dout @ w_down.T
  dg = dh * u * silu_grad(g)
  du = dh * silu(g)
  dv = dg @ w_gate.T + du @ w_up.T
  return dv, v.T @ dg, v.T @ du, h.T @ dout


def routes_to(experts, e):
  """(t, j) index arrays of the routes to expert e, in ascending (t, j) order."""
  return np.nonzero(np.asarray(experts) == e)


def moe(x, experts, weights, w_gate, w_up, w_down, shared=None, *, round_to=None, round_y=True):
  """y (T, H) float64 (rounded to round_to, then back in float64, when it is given).

  round_y=False leaves the final sum unrounded, as in an f32 partial output (out_dtype=f32)."""
  rnd = _rounder(round_to)
  x, weights = _np(x), _np(weights)
  w_gate, w_up, w_down = _np(w_gate), _np(w_up), _np(w_down)
  y = np.zeros_like(x)
  for e in range(w_gate.shape[0]):
    t, j = routes_to(experts, e)
    out, *_ = mlp(x[t], w_gate[e], w_up[e], w_down[e], rnd)
    np.add.at(y, t, weights[t, j][:, None] * rnd(out))
  if shared is not None:  # a route of weight 1, rounded like the others
    out, *_ = mlp(x, *map(_np, shared), rnd)
    y += rnd(out)
  return rnd(y) if round_y else y


def moe_grads(dy, x, experts, weights, w_gate, w_up, w_down, shared=None, *, round_to=None):
  """The gradients of sum(dy * moe(...)), float64."""
  rnd = _rounder(round_to)
  dy, x, weights = _np(dy), _np(x), _np(weights)
  w_gate, w_up, w_down = _np(w_gate), _np(w_up), _np(w_down)
  dx, dweights = np.zeros_like(x), np.zeros_like(weights)
  dw_gate, dw_up, dw_down = np.zeros_like(w_gate), np.zeros_like(w_up), np.zeros_like(w_down)
  for e in range(w_gate.shape[0]):
    t, j = routes_to(experts, e)
    out, g, u, h = mlp(x[t], w_gate[e], w_up[e], w_down[e], rnd)
    dweights[t, j] = np.sum(dy[t] * rnd(out), axis=1)
    dv, dw_gate[e], dw_up[e], dw_down[e] = mlp_backward(
        x[t], w_gate[e], w_up[e], w_down[e], g, u, h, weights[t, j][:, None] * dy[t])
    np.add.at(dx, t, dv)
  dshared = None
  if shared is not None:
    shared = tuple(map(_np, shared))
    _, g, u, h = mlp(x, *shared, rnd)
    dv, *dshared = mlp_backward(x, *shared, g, u, h, dy)
    dx += dv
    dshared = tuple(dshared)
  return Grads(dx, dweights, dw_gate, dw_up, dw_down, dshared)
