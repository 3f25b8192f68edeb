"""Dense float64 references for the curvature models: form the matrices, eigendecompose,
solve. Deliberately naive so that they are obviously the definitions in ginger-math.md."""

import numpy as np


def ginger_step(s_prev, d, alpha, tau):
  """``S_t = top_tau(alpha S_{t-1} + (1 - alpha) d d^T)`` by a full eigendecomposition."""
  m = alpha * s_prev + (1 - alpha) * np.outer(d, d)
  w, v = np.linalg.eigh(m)
  k = min(tau, len(d))
  w, v = w[::-1][:k], v[:, ::-1][:, :k]
  return (v * np.maximum(w, 0)) @ v.T, np.maximum(w, 0)


def ginger_direction(s, g, gamma):
  return np.linalg.solve(gamma * np.eye(len(g)) + s, g)


def qng_step(g_prev, d, alpha):
  """``G_t = alpha G_{t-1} + (1 - alpha) d d^T`` (``G_0 = I``)."""
  return alpha * g_prev + (1 - alpha) * np.outer(d, d)


def block_vectors(tree_leaves, blocks):
  """Concatenate flattened leaves per block (the dense view of a block)."""
  flat = [np.ravel(np.asarray(x, np.float64)) for x in tree_leaves]
  return [np.concatenate([flat[i] for i in idx]) for idx in blocks]
