"""The diagonal-plus-rank-one eigensolver against float64 LAPACK on hard cases, against the
dense float32 ``eigh`` it replaces, and the claim that Brand's core has that form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ginger._src import lowrank, secular


def _cases(n, rng):
  """``(name, d, z, rho)``: spectra that break naive secular solvers."""
  d_rand = rng.normal(size=n)
  return [
    ("random", d_rand, rng.normal(size=n), 0.3),
    ("zeros", np.r_[rng.uniform(size=n - n // 2), np.zeros(n // 2)], rng.normal(size=n), 0.01),
    ("clustered", 1 + 1e-7 * rng.normal(size=n), rng.normal(size=n), 0.5),
    ("ties", np.repeat([3.0, 1.0, 0.0], n // 3 + 1)[:n], rng.normal(size=n), 0.01),
    (
      "1e-20..1e0",
      np.r_[10.0 ** rng.uniform(-20, 0, size=n - 1), 0.0],
      rng.normal(size=n) * 10.0 ** rng.uniform(-10, 0, size=n),
      0.01,
    ),
    ("1e20 scale", 1e20 * rng.uniform(size=n), 1e9 * rng.normal(size=n), 1.0),
    ("1e-20 scale", 1e-20 * rng.uniform(size=n), 1e-10 * rng.normal(size=n), 1.0),
    ("tiny z", np.sort(rng.uniform(size=n)), np.r_[1e-20, 1e-10, rng.normal(size=n - 2)], 1.0),
    ("zero z", rng.uniform(size=n), np.zeros(n), 1.0),
    (
      "in-span slot",
      np.r_[np.sort(rng.uniform(size=n - 1))[::-1], -1.0],
      np.r_[rng.normal(size=n - 1), 0.0],
      0.01,
    ),
  ]


def _errors(d, z, rho, w, v):
  """Eigenvalue error and residual in units of ||M||, and orthogonality error."""
  m = np.diag(d) + rho * np.outer(z, z)
  norm = np.linalg.norm(m, 2)
  w, v = np.asarray(w, np.float64), np.asarray(v, np.float64)
  exact = np.linalg.eigvalsh(m)[::-1]
  return (
    np.max(np.abs(w - exact)) / norm,
    np.max(np.abs(m @ v - v * w)) / norm,
    np.max(np.abs(v.T @ v - np.eye(len(d)))),
  )


@pytest.mark.parametrize("n", [2, 9, 33])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_backward_stable_on_hard_cases(x64, n, dtype):
  """Eigenvalues and residuals within ``8 n eps ||M||``, eigenvectors orthogonal to
  ``8 n eps``: the backward-error bound of the method (each of the n secular roots is found
  to adjacent floats; Lowner's zhat makes the vectors exact for a matrix that close)."""
  rng = np.random.default_rng(n)
  cases = _cases(n, rng)
  d = jnp.asarray(np.stack([c[1] for c in cases]), dtype)
  z = jnp.asarray(np.stack([c[2] for c in cases]), dtype)
  rho = jnp.asarray([c[3] for c in cases], dtype)
  w, v = jax.jit(secular.eigh_diag_plus_rank_one)(d, z, rho)
  bound = 8 * n * np.finfo(dtype).eps
  for i, (name, *_) in enumerate(cases):
    errs = _errors(
      np.asarray(d[i], np.float64), np.asarray(z[i], np.float64), float(rho[i]), w[i], v[i]
    )
    assert max(errs) < bound, (name, errs)
    assert np.all(np.diff(np.asarray(w[i])) <= 0), name


def test_exact_zeros_stay_exactly_zero():
  """Zero diagonal entries are exact eigenvalues whenever the rank-one part cannot reach them:
  of m zeros, m - 1 are deflated by one reflection (the rank-one update lifts at most one),
  and a zero with ``z = 0`` is deflated outright."""
  d = jnp.asarray([[2.0, 1.0, 0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0, 0.0, -1.0]])
  z = jnp.asarray([[1.0, 2.0, 0.3, -0.2, 0.1, 0.5], [1.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
  w, v = jax.jit(secular.eigh_diag_plus_rank_one)(d, z, 0.1)
  assert np.sum(np.asarray(w[0]) == 0.0) == 3  # 4 zeros, one lifted
  assert np.sum(np.asarray(w[1]) == 0.0) == 3  # 3 zeros, none reached (z = 0 there)
  assert float(w[1, -1]) == -1.0
  np.testing.assert_array_equal(np.abs(np.asarray(v[1, :, -1])), [0, 0, 0, 0, 0, 1])


def test_poles_closer_than_two_normal_numbers(x64):
  """Float32 poles less than two normal numbers apart (0 and 2.2e-38): a root between them is
  no further than a subnormal from one of them, which XLA flushes to zero (a division by zero,
  NaN eigenvectors: the hypothesis test of Ginger's state found it). Such poles lie far below
  the matrix's rounding level and are merged as equal ones are."""
  tiny = np.finfo(np.float32).tiny
  d = jnp.asarray(
    [[2.5614448e-16, 2.2252805e-38, 0.0, -1.0], [3e-30, 1.5 * tiny, tiny, 0.0]], jnp.float32
  )
  z = jnp.asarray(
    [[-1.0, -1.4777450e-08, 9.4979455e-09, 0.0], [0.5, -1e-8, 2e-8, 1.0]], jnp.float32
  )
  rho = jnp.asarray([0.1, 1e-3], jnp.float32)
  w, v = jax.jit(secular.eigh_diag_plus_rank_one)(d, z, rho)
  bound = 8 * 4 * np.finfo(np.float32).eps
  for i in range(2):
    assert np.all(np.isfinite(np.asarray(v[i]))), v[i]
    errs = _errors(
      np.asarray(d[i], np.float64), np.asarray(z[i], np.float64), float(rho[i]), w[i], v[i]
    )
    assert max(errs) < bound, (i, errs)


@pytest.mark.parametrize("n", [9, 33])
def test_float32_at_least_as_accurate_as_dense_eigh(x64, n):
  """The default is the secular solver only because it is not less accurate than float32
  ``eigh`` of the formed matrix; small eigenvalues it gets to high *relative* accuracy."""
  rng = np.random.default_rng(7)
  cases = _cases(n, rng)
  d = jnp.asarray(np.stack([c[1] for c in cases]), jnp.float32)
  z = jnp.asarray(np.stack([c[2] for c in cases]), jnp.float32)
  rho = jnp.asarray([c[3] for c in cases], jnp.float32)
  w, v = jax.jit(secular.eigh_diag_plus_rank_one)(d, z, rho)  # one program, not op by op
  m = d[..., None] * jnp.eye(n) + rho[:, None, None] * z[:, :, None] * z[:, None, :]
  wd, vd = lowrank.sorted_eigh(m)
  small_sec, small_dense = [], []
  for i, (name, *_) in enumerate(cases):
    args = (np.asarray(d[i], np.float64), np.asarray(z[i], np.float64), float(rho[i]))
    sec, dense = _errors(*args, w[i], v[i]), _errors(*args, wd[i], vd[i])
    eps = np.finfo(np.float32).eps
    assert max(sec) <= max(2 * max(dense), 8 * eps), (name, sec, dense)
    exact = np.linalg.eigvalsh(np.diag(args[0]) + args[2] * np.outer(args[1], args[1]))[::-1]
    small_sec.append(_small_relative_error(w[i], exact))
    small_dense.append(_small_relative_error(wd[i], exact))
  assert max(small_sec) <= max(small_dense)


def _small_relative_error(w, exact):
  """Relative error of the eigenvalues below 1e-3 of the largest (absolute where exact 0)."""
  small = np.abs(exact) < 1e-3 * np.abs(exact).max()
  err = np.abs(np.asarray(w, np.float64) - exact) / np.where(exact == 0, 1.0, np.abs(exact))
  return np.max(err[small], initial=0.0)


@pytest.mark.parametrize("in_span", [False, True])
def test_brand_core_is_diagonal_plus_rank_one(x64, in_span):
  """``[U p]^T (alpha U diag(sigma) U^T + (1-alpha) v v^T) [U p]`` formed densely equals
  ``diag(alpha sigma, 0) + (1-alpha) w w^T`` with ``w = [U^T v; r]`` (times ``s^2``), and both
  solvers give its spectrum."""
  rng = np.random.default_rng(3)
  n, k, alpha = 12, 4, 0.9
  u, _ = np.linalg.qr(rng.normal(size=(n, k)))
  sigma = np.sort(rng.uniform(size=k))[::-1]
  v = u @ rng.normal(size=k) if in_span else rng.normal(size=n)
  c = u.T @ v
  resid = v - u @ c
  r = np.linalg.norm(resid)
  basis = np.hstack([u, (resid / r)[:, None] if not in_span else np.zeros((n, 1))])
  dense = basis.T @ (alpha * (u * sigma) @ u.T + (1 - alpha) * np.outer(v, v)) @ basis
  args = (jnp.asarray(c), jnp.asarray(0.0 if in_span else r), jnp.asarray(sigma))
  args += (jnp.asarray(np.linalg.norm(v)), jnp.asarray(in_span), alpha)
  core, s = lowrank.brand_core(*args)
  expected = dense / float(s) ** 2
  if in_span:
    expected[k, k] = -1.0  # the marker of the empty slot
  np.testing.assert_allclose(core, expected, atol=1e-14)
  for solver in ("secular", "dense"):
    w, vecs, _ = jax.jit(lowrank.brand_eigh, static_argnums=(5, 6))(*args, solver)
    np.testing.assert_allclose(w, np.linalg.eigvalsh(expected)[::-1], atol=1e-14)
    np.testing.assert_allclose(np.asarray(core) @ vecs, vecs * w, atol=1e-14)


# ---- the bisection as one Pallas kernel (interpreted here) -----------------------------------


def _hard_batch(n, dtype, lead=(10,)):
  """The hard cases of :func:`_cases` as one batch of ``lead`` (10 cases) matrices."""
  cases = _cases(n, np.random.default_rng(n))
  d = jnp.asarray(np.stack([c[1] for c in cases]).reshape(lead + (n,)), dtype)
  z = jnp.asarray(np.stack([c[2] for c in cases]).reshape(lead + (n,)), dtype)
  rho = jnp.asarray(np.reshape([c[3] for c in cases], lead), dtype)
  return d, z, rho


def _spy(monkeypatch, name):
  """Records the operands and result of every call of ``secular.<name>`` (while traced)."""
  calls = []
  fn = getattr(secular, name)

  def spy(*args, **kwargs):
    hi = fn(*args, **kwargs)
    calls.append((args, kwargs, hi))
    return hi

  monkeypatch.setattr(secular, name, spy)
  return calls


@pytest.mark.parametrize(
  ("dtype", "n", "lead"), [("float32", 9, (10,)), ("float32", 33, (2, 5)), ("float64", 33, (10,))]
)
def test_bisection_kernel_gives_the_jnp_bits(x64, dtype, n, lead, monkeypatch):
  """The solver with the kernel (interpreted) equals the jnp solver exactly, and the kernel's
  brackets the jnp loop's bit for bit on the same operands: the hard cases (deflated entries,
  ties, clustered poles, tiny z) as tau 8 and tau 32 cores (n = 9, 33: blocks of 16 and 64,
  padded poles and roots), batches of one and two axes. A different summation order over
  the poles (``jnp.sum``'s, Triton's) fails this for some root; so do a missed padding mask
  and a step too few.

  Both solvers run in one program: XLA computes the code before the bisection once there,
  while two programs may fuse its reductions (``jnp.sum``, ``einsum``) differently and round
  them differently, which has nothing to do with the kernel."""
  kernel_calls, jnp_calls = _spy(monkeypatch, "bisect_pallas"), _spy(monkeypatch, "bisect_jnp")

  def both(d, z, rho):
    ref = secular.eigh_diag_plus_rank_one(d, z, rho)
    got = secular.eigh_diag_plus_rank_one(d, z, rho, impl="pallas", interpret=True)
    [(args, kwargs, hi)], [(jnp_args, _, jnp_hi)] = kernel_calls, jnp_calls
    assert kwargs == {"interpret": True}
    return ref, got, hi, jnp_hi, args, jnp_args

  ref, got, hi, jnp_hi, args, jnp_args = jax.jit(both)(*_hard_batch(n, dtype, lead))
  for a, b in zip(args, jnp_args):
    np.testing.assert_array_equal(a, b)
  assert hi.shape == lead + (n,) and hi.dtype == (np.int32 if dtype == "float32" else np.int64)
  np.testing.assert_array_equal(hi, jnp_hi)
  for a, b in zip(got, ref):
    np.testing.assert_array_equal(a, b)
  active = np.asarray(args[2])
  assert active.any() and not active.all()  # deflated entries among active ones
  with pytest.raises(ValueError, match="impl must be one of"):
    secular.eigh_diag_plus_rank_one(*_hard_batch(n, dtype, lead), impl="auto")
