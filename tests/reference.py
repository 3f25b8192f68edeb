"""Dense float64 references for the curvature models: form the matrices, eigendecompose,
solve. Deliberately naive so that they are obviously the definitions in docs/ginger-math.md."""

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


class SubspaceGinger:
  """The definition of :func:`ginger_step` / :func:`ginger_direction` for blocks too big for a
  dense ``n x n`` matrix: every ``S_t`` lies in the span of ``d_1 .. d_t``, so it is kept as a
  small dense matrix ``M`` in an orthonormal basis ``B`` of that span (``S = B M B^T``), and
  ``G^{-1} g = B (gamma I + M)^{-1} B^T g + (g - B B^T g) / gamma``. Exact in float64 while the
  basis has fewer columns than rows."""

  def __init__(self, n, tau, alpha):
    self.basis = np.zeros((n, 0))
    self.m = np.zeros((0, 0))
    self.tau, self.alpha = tau, alpha

  def step(self, d):
    r = d - self.basis @ (self.basis.T @ d)
    r -= self.basis @ (self.basis.T @ r)  # twice is enough (Kahan-Parlett)
    if np.linalg.norm(r) > 1e-12 * np.linalg.norm(d):
      self.basis = np.hstack([self.basis, (r / np.linalg.norm(r))[:, None]])
      self.m = np.pad(self.m, ((0, 1), (0, 1)))
    c = self.basis.T @ d
    w, v = np.linalg.eigh(self.alpha * self.m + (1 - self.alpha) * np.outer(c, c))
    w, v = w[::-1], v[:, ::-1]
    w[min(self.tau, len(d)) :] = 0  # top_tau
    self.m = (v * np.maximum(w, 0)) @ v.T
    return np.maximum(w[: min(self.tau, len(d))], 0)

  def direction(self, g, gamma):
    c = self.basis.T @ g
    inside = np.linalg.solve(gamma * np.eye(len(c)) + self.m, c)
    return (g - self.basis @ c) / gamma + self.basis @ inside


class SubspaceQNG:
  """:func:`qng_step`'s ``G_t = alpha^t I + B M B^T`` kept in the span ``B`` of the ``d``'s."""

  def __init__(self, n, alpha):
    self.ginger = SubspaceGinger(n, n, alpha)
    self.scale = 1.0  # alpha^t

  def step(self, d):
    self.ginger.step(d)
    self.scale *= self.ginger.alpha

  def direction(self, g):
    return self.ginger.direction(g, self.scale)


def hard_fisher_vectors(rng, sizes, steps, scale, noise=0.1):
  """``d_t`` per leaf from 3 fixed unit directions (weights 1, 0.3, 0.1) plus ``noise`` of a
  fresh random unit vector, times ``scale``, rounded to float32; and random float32 ``g_t``.
  The spectrum then spans several decades, with a top eigenvalue near
  ``(1 - alpha) scale^2``."""
  dirs = [rng.normal(size=(3, n)) for n in sizes]
  dirs = [x / np.linalg.norm(x, axis=1, keepdims=True) for x in dirs]
  for _ in range(steps):
    ds, gs = [], []
    for x, n in zip(dirs, sizes):
      z = rng.normal(size=n)
      v = (rng.normal(size=3) * [1.0, 0.3, 0.1]) @ x + noise * z / np.linalg.norm(z)
      ds.append((scale * v).astype(np.float32))
      gs.append(rng.normal(size=n).astype(np.float32))
    yield ds, gs


class TruncatedQNG:
  """QNG's truncated product by its definition, densely: ``A = K_{t-tau+1} ... K_t`` (the
  last ``tau`` factors), ``K = sqrt(alpha) I + beta q q^T`` with ``q = A^{-1} d`` from the
  product before the step, ``G^{-1} g = (A A^T)^{-1} g`` by dense solves."""

  def __init__(self, n, tau, alpha):
    self.factors, self.n, self.tau, self.alpha = [], n, tau, alpha

  def product(self):
    a = np.eye(self.n)
    for k in self.factors:
      a = a @ k
    return a

  def step(self, d):
    q = np.linalg.solve(self.product(), d)
    qq = q @ q
    beta = (np.sqrt(self.alpha + (1 - self.alpha) * qq) - np.sqrt(self.alpha)) / qq if qq else 0
    self.factors = (self.factors + [np.sqrt(self.alpha) * np.eye(self.n) + beta * np.outer(q, q)])[
      -self.tau :
    ]

  def direction(self, g):
    a = self.product()
    return np.linalg.solve(a @ a.T, g)
