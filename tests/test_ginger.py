"""scale_by_ginger / ginger against dense float64 math, plus optax integration and errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import (
  SubspaceGinger,
  block_vectors,
  ginger_direction,
  ginger_step,
  hard_fisher_vectors,
)

import ginger
from ginger._src import lowrank

PYTREES = {
  "matrix+vectors": {"w": (5, 3), "b": (4,), "tiny": (2,)},
  "nested": {"enc": {"k": (3, 2, 2)}, "dec": [(6,), (1,)]},
  "single": {"x": (9,)},
}


def _zeros(shapes, dtype=jnp.float64):
  return jax.tree.map(lambda s: jnp.zeros(s, dtype), shapes, is_leaf=lambda s: isinstance(s, tuple))


def _random_like(rng, tree, scale=1.0):
  return jax.tree.map(lambda x: jnp.asarray(scale * rng.normal(size=x.shape), x.dtype), tree)


def _blocks(n_leaves, block):
  return [list(range(n_leaves))] if block == "global" else [[i] for i in range(n_leaves)]


@functools.cache
def _jitted_ginger(block, tau, eigensolver="secular"):
  """One compiled update per (block, tau): alpha and gamma are injected as state, so a
  sweep over them reuses the compilation (and exercises optax.inject_hyperparams)."""
  tx = optax.inject_hyperparams(ginger.scale_by_ginger, static_args=("tau", "block"))(
    tau=tau, alpha=0.5, gamma=1.0, block=block, state_dtype="float64", eigensolver=eigensolver
  )
  return tx, jax.jit(tx.update)


def _run_against_dense(shapes, block, tau, alpha, gamma, steps=10, seed=0, eigensolver="secular"):
  """Runs scale_by_ginger and the dense reference side by side; returns max relative error."""
  rng = np.random.default_rng(seed)
  params = _zeros(shapes)
  tx, update = _jitted_ginger(block, tau, eigensolver)
  state = tx.init(params)
  state.hyperparams.update(alpha=jnp.float64(alpha), gamma=jnp.float64(gamma))
  blocks = _blocks(len(jax.tree.leaves(params)), block)
  dense = [np.zeros((len(v), len(v))) for v in block_vectors(jax.tree.leaves(params), blocks)]
  worst = 0.0
  for t in range(steps):
    g = _random_like(rng, params)
    d = _random_like(rng, params, scale=1.0 + t)  # growing scale: the spectrum changes order
    out, state = update(g, state, fisher_grads=d)
    gs = block_vectors(jax.tree.leaves(g), blocks)
    ds = block_vectors(jax.tree.leaves(d), blocks)
    outs = block_vectors(jax.tree.leaves(out), blocks)
    for b in range(len(blocks)):
      dense[b], _ = ginger_step(dense[b], ds[b], alpha, tau)
      ref = ginger_direction(dense[b], gs[b], gamma)
      worst = max(worst, np.max(np.abs(outs[b] - ref)) / np.max(np.abs(ref)))
  return worst


# In `make test` (each case compiles its own update): every tree and block, the smallest and
# largest tau, and each kind of leaf on both sides of tau (a leaf of size <= tau keeps full
# rank): tau 1, 5 on matrix+vectors (5: b and tiny full rank, w truncated), tau 2, 8 on nested
# (size-1 leaf; 8: the 6-vector full rank too), tau 8 on single (tau = size - 1). The other
# combinations run the same code on other sizes: slow.
FAST_TAU_TREES = {(1, "matrix+vectors"), (5, "matrix+vectors"), (2, "nested"), (8, "nested")}
FAST_TAU_TREES |= {(8, "single")}


@pytest.mark.parametrize("block", ["per_tensor", "global"])
@pytest.mark.parametrize(
  ("tau", "tree"),
  [
    pytest.param(tau, tree, marks=() if (tau, tree) in FAST_TAU_TREES else pytest.mark.slow)
    for tau in (1, 2, 3, 5, 8)
    for tree in sorted(PYTREES)
  ],
)
def test_matches_dense_reference_over_tau(x64, block, tree, tau):
  assert _run_against_dense(PYTREES[tree], block, tau, alpha=0.9, gamma=1e-2) < 1e-8


@pytest.mark.parametrize("block", ["per_tensor", "global"])
@pytest.mark.parametrize("eigensolver", ["secular", "dense"])
def test_matches_dense_reference_over_alpha_gamma(x64, block, eigensolver):
  for alpha in (0.9, 0.99, 0.999):
    for gamma in (1e-8, 1e-6, 1e-4, 1e-2, 1.0):
      # G^{-1} has condition number sigma_max / gamma; the dense solve loses that much.
      tol = 1e-9 + 1e-13 * 400 / gamma
      err = _run_against_dense(
        PYTREES["matrix+vectors"], block, 4, alpha, gamma, eigensolver=eigensolver
      )
      assert err < tol, (alpha, gamma, err)


HARD_SIZES = (10, 37, 200, 1000, 5000)


@functools.cache
def _jitted_float32_ginger(block, tau, eigensolver):
  # Every 3rd step re-orthonormalises, so that path too must keep the exact zeros.
  tx = ginger.scale_by_ginger(
    tau, 0.99, 1e-5, block, reorthonormalise_every=3, eigensolver=eigensolver
  )
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("block", ["per_tensor", "global"])
@pytest.mark.parametrize("tau", [pytest.param(4, marks=pytest.mark.slow), 8])  # 4: test-all
@pytest.mark.parametrize("ratio, eigensolver", [(1e5, "secular"), (1e9, "secular"), (1e9, "dense")])
def test_float32_is_exact_from_the_first_step(block, tau, ratio, eigensolver):
  """float32 state against the float64 definition, every step from the first, with
  ``sigma_max / gamma`` from ``ratio`` at the first step to ~50 ``ratio`` (gamma = 1e-5,
  alpha = 0.99, leaves of 10..5000 entries).

  While a block has seen ``t < tau`` vectors its curvature has rank ``t``: the other
  eigenvalues are exactly zero, and must come out as exact zeros (float32 ``eigh`` returns
  them as noise of ~1e-7 sigma_max, which at 1e9 is 100 gamma and wrecks those directions).
  The 5e-4 bound (the issue's target) follows from the data: float32 rounding turns the
  kept eigenvectors by about ``eps sigma_max / sigma_min`` (Davis-Kahan; the smallest kept
  gap is the smallest kept eigenvalue), and here the noise directions' eigenvalues are
  ``~ 0.1^2 / 26`` of the top one in the steady state: ``6e-8 * 2.6e3 = 1.5e-4``. The
  condition number ``sigma_max / gamma`` itself does not enter.
  """
  gamma, alpha = 1e-5, 0.99
  tx, update = _jitted_float32_ginger(block, tau, eigensolver)
  state = tx.init([jnp.zeros(n) for n in HARD_SIZES])
  blocks = _blocks(len(HARD_SIZES), block)
  refs = [SubspaceGinger(sum(HARD_SIZES[i] for i in b), tau, alpha) for b in blocks]
  rng = np.random.default_rng(int(np.log10(ratio)) + tau)
  scale = np.sqrt(ratio * gamma / (1 - alpha))  # sigma_1 = (1 - alpha) ||d_1||^2 ~ ratio gamma
  first = None
  for t, (ds, gs) in enumerate(hard_fisher_vectors(rng, HARD_SIZES, 30, scale)):
    out, state = update(gs, state, fisher_grads=ds)
    sigmas = [state.sigma] if block == "global" else state.sigma
    for b, ref in zip(blocks, refs, strict=True):
      cat = lambda xs, b=b: np.concatenate([np.asarray(xs[i], np.float64) for i in b])
      w = ref.step(cat(ds))
      expected = ref.direction(cat(gs), gamma)
      err = np.max(np.abs(cat(out) - expected)) / np.max(np.abs(expected))
      assert err < 5e-4, (t, b, err)
      sigma = np.asarray(sigmas[b[0]] if block == "per_tensor" else sigmas[0])
      assert np.all(sigma[t + 1 :] == 0), (t, sigma)  # rank <= t + 1: exact zeros
      first = max(w[0], first or 0.0) if t == 0 else first
  # The regime holds from the first step (later the EMA sums ~26 steps: 10-100x more).
  assert ratio / 10 < first / gamma < 10 * ratio, first / gamma


def test_sigma_is_the_dense_spectrum(x64):
  rng = np.random.default_rng(1)
  params = {"x": jnp.zeros(7, jnp.float64)}
  tx = ginger.scale_by_ginger(3, 0.9, 1e-3, state_dtype="float64")
  update = jax.jit(tx.update)  # one program (op by op: hundreds of small ones)
  state = tx.init(params)
  dense = np.zeros((7, 7))
  for _ in range(10):
    d = _random_like(rng, params)
    _, state = update(d, state, fisher_grads=d)
    dense, w = ginger_step(dense, np.asarray(d["x"]), 0.9, 3)
  np.testing.assert_allclose(state.sigma["x"], w, rtol=1e-10, atol=1e-14)
  u = np.asarray(state.u["x"])
  np.testing.assert_allclose((u * np.asarray(state.sigma["x"])) @ u.T, dense, atol=1e-12)


def test_first_step_is_rank_one_exact(x64):
  """From S_0 = 0: S_1 = (1-alpha) d d^T, so G^{-1} g has a closed form."""
  d = jnp.array([3.0, 4.0, 0.0])
  g = jnp.array([1.0, -2.0, 5.0])
  alpha, gamma = 0.5, 0.1
  tx = ginger.scale_by_ginger(2, alpha, gamma, "global", state_dtype="float64")
  out, state = jax.jit(tx.update)(g, tx.init(g), fisher_grads=d)
  s = (1 - alpha) * float(d @ d)
  dhat = d / jnp.linalg.norm(d)
  expected = (g - (s / (gamma + s)) * (dhat @ g) * dhat) / gamma
  np.testing.assert_allclose(out, expected, rtol=1e-12)
  np.testing.assert_allclose(state.sigma, [s, 0.0], atol=1e-12)


def test_default_fisher_is_the_updates(x64):
  rng = np.random.default_rng(2)
  params = {"a": jnp.zeros((4, 2), jnp.float64)}
  tx = ginger.scale_by_ginger(2, state_dtype="float64")
  g = _random_like(rng, params)
  update, state = jax.jit(tx.update), tx.init(params)
  out1, s1 = update(g, state)
  out2, s2 = update(g, state, fisher_grads=g)
  jax.tree.map(np.testing.assert_array_equal, (out1, s1), (out2, s2))


def test_small_leaves_are_exact(x64):
  """A leaf with size <= tau keeps full rank: no truncation, G^{-1} is exact."""
  rng = np.random.default_rng(3)
  params = {"bias": jnp.zeros(3, jnp.float64)}
  tx = ginger.scale_by_ginger(8, 0.9, 1e-3, state_dtype="float64")
  state = tx.init(params)
  assert state.u["bias"].shape == (3, 3)
  g_dense = np.zeros((3, 3))
  update = jax.jit(tx.update)  # one program (op by op: hundreds of small ones)
  for _ in range(6):
    d, g = _random_like(rng, params), _random_like(rng, params)
    out, state = update(g, state, fisher_grads=d)
    g_dense = 0.9 * g_dense + 0.1 * np.outer(d["bias"], d["bias"])
    ref = np.linalg.solve(1e-3 * np.eye(3) + g_dense, np.asarray(g["bias"]))
    np.testing.assert_allclose(out["bias"], ref, rtol=1e-8)


def test_state_shapes_and_dtypes():
  params = {"w": jnp.zeros((4, 5), jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
  tx = ginger.scale_by_ginger(4)
  state = tx.init(params)
  assert state.u["w"].shape == (20, 4) and state.u["w"].dtype == jnp.float32
  assert state.u["b"].shape == (3, 3)
  assert state.sigma["w"].shape == (4,) and state.sigma["b"].shape == (3,)
  glob = ginger.scale_by_ginger(4, block="global").init(params)
  assert glob.u["w"].shape == (20, 4) and glob.u["b"].shape == (3, 4)
  assert glob.sigma.shape == (4,)
  assert state.mu is None and state.mu_count is None  # no b1: no momentum
  for block in ("per_tensor", "global"):  # the momentum: per-leaf vectors in state_dtype
    mu = ginger.scale_by_ginger(4, block=block, b1=0.9).init(params)
    assert mu.mu["w"].shape == (20,) and mu.mu["b"].shape == (3,)
    assert mu.mu["w"].dtype == jnp.float32 and int(mu.mu_count) == 0


# ---- the composed optimizer --------------------------------------------------------------


def test_ginger_composition_matches_manual_chain(x64):
  rng = np.random.default_rng(4)
  params = {"w": jnp.zeros((3, 3), jnp.float64), "b": jnp.zeros(3, jnp.float64)}
  lr, b1, rho = 0.1, 0.9, 0.05
  tx = ginger.ginger(lr, tau=2, alpha=0.9, gamma=1e-2, b1=b1, rho=rho, state_dtype="float64")
  pre = ginger.scale_by_ginger(2, 0.9, 1e-2, state_dtype="float64")
  state, pre_state = tx.init(params), pre.init(params)
  update, pre_update = jax.jit(tx.update), jax.jit(pre.update)
  m = jax.tree.map(jnp.zeros_like, params)
  for t in range(1, 6):
    g, d = _random_like(rng, params), _random_like(rng, params)
    out, state = update(g, state, params, fisher_grads=d)
    m = jax.tree.map(lambda m_, g_: b1 * m_ + (1 - b1) * g_, m, g)
    m_hat = jax.tree.map(lambda x, t=t: x / (1 - b1**t), m)
    u, pre_state = pre_update(m_hat, pre_state, fisher_grads=d)
    expected = jax.tree.map(lambda x: -lr * jnp.clip(x, -rho, rho), u)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-10), out, expected)


def test_ginger_without_fisher_uses_raw_gradient_not_momentum(x64):
  rng = np.random.default_rng(5)
  params = {"w": jnp.zeros(4, jnp.float64)}
  tx = ginger.ginger(0.1, tau=2, state_dtype="float64")
  s_default = s_explicit = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3):
    g = _random_like(rng, params)
    o1, s_default = update(g, s_default, params)
    o2, s_explicit = update(g, s_explicit, params, fisher_grads=g)
    # Two programs (XLA may fuse the shared g differently in the first): the same math to
    # float64 rounding amplified by G's condition number, sigma_max / gamma ~ 0.01 x 4 x 3 /
    # 1e-5 ~ 1e4 here, so ~1e-12 (measured: up to 2e-13). Taking the momentum for d instead
    # of the raw gradient changes the update by O(1).
    np.testing.assert_allclose(o1["w"], o2["w"], rtol=1e-9, atol=0)


def test_works_with_optax_wrappers():
  params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
  grads = jax.tree.map(lambda x: 0.1 * x, params)

  # jit, optax.chain, inject_hyperparams, multi_transform: tests/test_contract.py.
  multi = optax.MultiSteps(ginger.ginger(0.1, tau=2), every_k_schedule=2)
  state = multi.init(params)
  update = jax.jit(multi.update)
  out1, state = update(grads, state, params, fisher_grads=grads)
  assert all(jnp.all(x == 0) for x in jax.tree.leaves(out1))
  out2, state = update(grads, state, params, fisher_grads=grads)
  assert any(jnp.any(x != 0) for x in jax.tree.leaves(out2))

  mask = {"w": True, "b": False}
  masked = optax.masked(ginger.scale_by_ginger(2), mask, mask_compatible_extra_args=True)
  state = masked.init(params)
  out, state = jax.jit(masked.update)(grads, state, params, fisher_grads=grads)
  np.testing.assert_array_equal(out["b"], grads["b"])  # passed through untouched
  assert not np.allclose(out["w"], grads["w"])


def test_learning_rate_schedule():
  params = {"w": jnp.ones(3)}
  tx = ginger.ginger(optax.linear_schedule(0.0, 1.0, 10), tau=1)
  out, _ = jax.jit(tx.update)(params, tx.init(params), params)
  np.testing.assert_array_equal(out["w"], 0.0)  # lr(0) = 0


# ---- curvature every K steps -------------------------------------------------------------


@pytest.mark.parametrize("block", ["per_tensor", "global"])
def test_curvature_every_k_steps_matches_dense(x64, block):
  """With ``curvature_every=3`` the caller passes ``d_t`` on every third step; the other steps
  precondition with the current ``G`` and leave the state exactly as it was."""
  rng = np.random.default_rng(8)
  params = {"w": jnp.zeros((4, 3), jnp.float64), "b": jnp.zeros(5, jnp.float64)}
  tx = ginger.scale_by_ginger(3, 0.9, 1e-2, block, state_dtype="float64", curvature_every=3)
  state = tx.init(params)
  with_d, without_d = jax.jit(tx.update), jax.jit(lambda g, s: tx.update(g, s))
  blocks = _blocks(2, block)
  dense = [
    np.zeros((n, n)) for n in (len(v) for v in block_vectors(jax.tree.leaves(params), blocks))
  ]
  for t in range(9):
    g = _random_like(rng, params)
    if t % 3 == 0:
      d = _random_like(rng, params)
      out, state = with_d(g, state, fisher_grads=d)
      ds = block_vectors(jax.tree.leaves(d), blocks)
      dense = [ginger_step(m, x, 0.9, 3)[0] for m, x in zip(dense, ds, strict=True)]
    else:
      before = state
      out, state = without_d(g, state)
      jax.tree.map(np.testing.assert_array_equal, state, before)
    gs = block_vectors(jax.tree.leaves(g), blocks)
    outs = block_vectors(jax.tree.leaves(out), blocks)
    for m, gv, ov in zip(dense, gs, outs, strict=True):
      np.testing.assert_allclose(ov, ginger_direction(m, gv, 1e-2), rtol=1e-9)
  assert int(state.count) == 3


def test_curvature_every_makes_a_missing_fisher_mean_no_update(x64):
  """In the composed optimizer too: without ``fisher_grads`` the curvature stays as it is
  (here ``S = 0``, so ``G = gamma I``), where ``curvature_every=1`` uses the gradient."""
  params = {"w": jnp.zeros(4, jnp.float64)}
  g = {"w": jnp.asarray([1.0, -2.0, 3.0, 0.5])}
  kwargs = dict(learning_rate=0.1, tau=2, gamma=1e-2, state_dtype="float64")
  skip = ginger.ginger(curvature_every=4, **kwargs)
  out, state = jax.jit(skip.update)(g, skip.init(params), params)
  np.testing.assert_allclose(out["w"], -0.1 * g["w"] / 1e-2, rtol=1e-12)  # m_hat = g
  assert all(float(jnp.max(s)) == 0 for s in ginger.curvature_spectrum(state).values())
  empirical = ginger.ginger(**kwargs)
  _, state = jax.jit(empirical.update)(g, empirical.init(params), params)
  assert float(ginger.curvature_spectrum(state)["['w']"][0]) > 0


# ---- clear errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(tau=0), "tau must be >= 1"),
    (dict(tau=2.5), "tau must be a Python int"),
    (dict(tau=True), "tau must be a Python int"),
    (dict(tau=2, alpha=1.0), "alpha must lie in the open interval"),
    (dict(tau=2, alpha=0.0), "alpha must lie in the open interval"),
    (dict(tau=2, alpha=-0.5), "alpha must lie in the open interval"),
    (dict(tau=2, gamma=0.0), "gamma must be a finite number > 0"),
    (dict(tau=2, gamma=-1e-3), "gamma must be a finite number > 0"),
    (dict(tau=2, gamma=float("nan")), "gamma must be a finite number > 0"),
    (dict(tau=2, block="diagonal"), "block must be one of"),
    (dict(tau=2, eigensolver="jacobi"), "eigensolver must be one of"),
    (dict(tau=2, curvature_every=0), "curvature_every must be a Python int >= 1 or None"),
    (dict(tau=2, curvature_every=2.0), "curvature_every must be a Python int >= 1 or None"),
    (dict(tau=2, reorthonormalise_every=-1), "reorthonormalise_every must be >= 0"),
    (dict(tau=2, reorthonormalise_every=2.5), "reorthonormalise_every must be an int"),
    (dict(tau=2, reorthonormalise_every="10"), "reorthonormalise_every must be an int"),
    (dict(tau=2, reorthonormalise_every=True), "reorthonormalise_every must be an int"),
    (dict(tau=2, b1=1.0), r"b1 must lie in \[0, 1\)"),  # before: 1 - b1^t = 0, a NaN update
    (dict(tau=2, b1=-0.1), r"b1 must lie in \[0, 1\)"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ginger.scale_by_ginger(**kwargs)


@pytest.mark.parametrize("make", [ginger.ginger, ginger.qng])
def test_bad_momentum(make):
  with pytest.raises(ValueError, match=r"b1 must lie in \[0, 1\) \(the momentum\), got 1.0"):
    make(1e-3, tau=2, b1=1.0)


def test_bad_rho():
  with pytest.raises(ValueError, match="rho must be > 0"):
    ginger.ginger(0.1, tau=2, rho=0.0)


def test_fisher_structure_mismatch():
  params = {"w": jnp.ones(3), "b": jnp.ones(2)}
  tx = ginger.scale_by_ginger(2)
  state = tx.init(params)
  with pytest.raises(ValueError, match="same pytree structure"):
    tx.update(params, state, fisher_grads={"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="leaf shapes differ"):
    tx.update(params, state, fisher_grads={"w": jnp.ones(3), "b": jnp.ones(5)})


# ---- the spectrum, for logging -----------------------------------------------------------


def test_curvature_spectrum_finds_the_state_at_any_depth():
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  d = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
  injected = optax.inject_hyperparams(ginger.ginger, static_args=("tau",))(0.1, tau=2)
  chained = optax.chain(optax.clip(1.0), ginger.scale_by_ginger(2, block="global"))
  states = {}
  for name, tx, keys in [
    ("plain", ginger.scale_by_ginger(2), ["['b']", "['w']"]),
    ("injected", injected, ["['b']", "['w']"]),
    ("chained", chained, ["global"]),
  ]:
    # One program per update (op by op: hundreds of small ones); the spectrum found inside it.
    update = jax.jit(lambda s, tx=tx: tx.update(d, s, params, fisher_grads=d))
    _, states[name] = update(tx.init(params))
    spectrum = jax.jit(ginger.curvature_spectrum)(states[name])
    assert sorted(spectrum) == keys
    for key, sigma in spectrum.items():
      assert sigma.shape == (2,) and float(sigma[0]) > 0, key
  w_only = (1 - 0.99) * float(jnp.sum(d["w"] ** 2))
  spectrum = ginger.curvature_spectrum(states["injected"])  # outside jit too
  np.testing.assert_allclose(spectrum["['w']"][0], w_only, rtol=1e-5)
  adam = optax.adam(0.1)
  assert ginger.curvature_spectrum(adam.init(params)) == {}
  two = optax.multi_transform(
    {"a": ginger.scale_by_ginger(2), "b": ginger.scale_by_ginger(1)}, {"w": "a", "b": "b"}
  )
  assert sorted(ginger.curvature_spectrum(two.init(params))) == ["0:['w']", "1:['b']"]


@pytest.mark.parametrize(
  "dtype, block, eigensolver, passes",
  [
    ("bfloat16", "per_tensor", "secular", "jnp"),
    ("bfloat16", "global", "dense", "jnp"),
    ("bfloat16", "per_tensor", "secular", "pallas"),
    # float16 takes the same code path with another rounding: `make test-all`
    pytest.param("float16", "per_tensor", "dense", "jnp", marks=pytest.mark.slow),
    pytest.param("float16", "global", "secular", "jnp", marks=pytest.mark.slow),
  ],
)
def test_half_precision_state_matches_float32(dtype, block, eigensolver, passes):
  """``state_dtype="bfloat16"`` / ``"float16"`` (the configs allow both): ``U`` and ``sigma``
  are stored narrow, the passes compute in float32 inside (kernels) or in the state dtype
  (jnp), and Brand's small eigenproblem, the Cholesky-QR factors and the secular solver's bit
  arithmetic run in float32 (they once raised from numpy's bit view and LAPACK's dtypes).
  Against the same updates with a float32 state: with ``gamma = 1`` and ``sigma <= 0.5`` the
  preconditioner's condition number is at most 1.5, so each step's roundings of the state to the
  unit roundoff ``u`` (U, sigma, the sums) move the update by a few ``u``; 8 steps (Cholesky-QR
  on every other one) stay within ``8 u``."""
  shapes = {"w": (19, 3), "b": (7,)}
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}

  def run(state_dtype):
    tx = ginger.scale_by_ginger(
      3, 0.9, 1.0, block, state_dtype=state_dtype, eigensolver=eigensolver, passes=passes,
      reorthonormalise_every=2,
    )  # fmt: skip
    state, update, rng, outs = tx.init(params), jax.jit(tx.update), np.random.default_rng(0), []
    for _ in range(8):
      g = _random_like(rng, params)
      out, state = update(g, state, fisher_grads=_random_like(rng, params, 0.2))
      outs.append(out)
    return outs, state

  ref, _ = run("float32")
  got, state = run(dtype)
  assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves((state.u, state.sigma)))
  assert max(float(jnp.max(x)) for x in jax.tree.leaves(state.sigma)) <= 0.5
  unit = float(jnp.finfo(dtype).eps) / 2
  for out, want in zip(got, ref, strict=True):
    for k in shapes:
      err = float(jnp.linalg.norm(out[k] - want[k]) / jnp.linalg.norm(want[k]))
      assert err <= 8 * unit, (k, err / unit)


def test_float64_state_needs_x64():
  """A float64 state without JAX's 64-bit mode would silently be float32 (JAX truncates, with a
  warning only): refused when the optimizer is made, naming the setting that enables it."""
  makers = (
    lambda: ginger.scale_by_ginger(2, state_dtype="float64"),
    lambda: ginger.ginger(0.1, state_dtype="float64"),
    lambda: ginger.qng(0.1, state_dtype="float64"),
  )
  with jax.enable_x64(False):
    for make in makers:
      with pytest.raises(ValueError, match="state_dtype='float64' needs JAX's 64-bit mode"):
        make()
  with jax.enable_x64(True):
    for make in makers:
      make()


@pytest.mark.parametrize(
  "every, explicit, keeps",
  [(None, False, True), (1000, False, False), (0, False, False), (0, True, True)],
)
def test_bfloat16_state_reorthonormalises_often_enough(every, explicit, keeps):
  """A bf16 ``U`` is rounded to bf16 every step, so ``U^T U - I`` random-walks by about its
  unit roundoff ``u`` a step (0.03 after 50 steps, 0.12 after 400, against float32's 1e-5):
  float32's period of 1000 steps would let it grow that far. By default a narrow state is
  re-orthonormalised every REORTHONORMALISE_EVERY_NARROW steps, which holds it within a few
  ``u`` over 120 steps of data with a strong low-rank component (measured: at most 5.6 u, the
  peak before each re-orthonormalisation; 1-2.5 u even when it runs every step, since the new
  ``U`` is rounded to bf16 again; every 1000 steps: 19 u after 120 steps). With
  ``reorthonormalise_every=0`` the update never does it; the caller's ``reorthonormalise``
  every ``default_reorthonormalise_every`` updates holds it as well (``explicit``)."""
  shapes = [(500,), (300,)]
  params = [jnp.zeros(s, jnp.float32) for s in shapes]
  tx = ginger.scale_by_ginger(
    8,
    0.99,
    1e-3,
    state_dtype="bfloat16",
    **({} if every is None else {"reorthonormalise_every": every}),
  )
  state, update = tx.init(params), jax.jit(tx.update)
  period = ginger.default_reorthonormalise_every("bfloat16")
  reorthonormalise = jax.jit(ginger.reorthonormalise)
  rng = np.random.default_rng(0)
  bases = [rng.normal(size=(s[0], 12)) for s in shapes]
  worst = 0.0
  for step in range(120):
    d = [
      jnp.asarray(b @ rng.normal(size=12) + 0.3 * rng.normal(size=len(b)), jnp.float32)
      for b in bases
    ]
    _, state = update(d, state, fisher_grads=d)
    if explicit and (step + 1) % period == 0:
      worst = max(worst, *(float(lowrank.orthonormality_error([u])) for u in state.u.stacks))
      state = reorthonormalise(state)
    u32 = [u.astype(jnp.float32) for u in state.u.stacks]
    worst = max(worst, *(float(lowrank.orthonormality_error([u])) for u in u32))
  unit = float(jnp.finfo(jnp.bfloat16).eps) / 2
  assert (worst <= 8 * unit) == keeps, worst / unit


def _dense_curvatures(state, block, n_leaves):
  """``U diag(sigma) U^T`` of every block of a Ginger state, as dense arrays."""
  if block == "global":
    u = jnp.concatenate([state.u.leaf(i) for i in range(n_leaves)])
    return [(u * state.sigma) @ u.T]
  sigmas = jax.tree.leaves(state.sigma.tree())
  return [(state.u.leaf(i) * sigma) @ state.u.leaf(i).T for i, sigma in enumerate(sigmas)]


@pytest.mark.parametrize("block", ["per_tensor", "global"])
def test_reorthonormalise_restores_orthonormality_and_keeps_the_curvature(x64, block):
  """``reorthonormalise`` takes a ``U`` 1e-3 from orthonormal back to ``U^T U = I`` and
  leaves ``S = U diag(sigma) U^T`` as it was, for a Ginger state at any depth. Float64: both
  to a few hundred unit roundoffs (Cholesky-QR of a Gram within 1e-2 of ``I`` loses no more
  than its condition number, ~1, times ``k n u``); the count and momentum are untouched."""
  shapes = [(50,), (30, 4), (3,)]
  params = [jnp.zeros(s, jnp.float64) for s in shapes]
  tx = ginger.ginger(
    0.1, 4, 0.9, 1e-2, block=block, state_dtype="float64", reorthonormalise_every=0
  )
  state, update = tx.init(params), jax.jit(tx.update)
  rng = np.random.default_rng(0)
  for _ in range(6):
    d = _random_like(rng, params)
    _, state = update(d, state, params, fisher_grads=d)
  inner = state[0]
  u = inner.u
  # Perturb every stored row of U (the stacks' zero padding rows stay zero).
  bent = [x + 1e-3 * jnp.asarray(rng.normal(size=x.shape)) * (x != 0) for x in u.stacks]
  state = (inner._replace(u=type(u)(bent, u.layout)), *state[1:])
  assert min(float(lowrank.orthonormality_error([x])) for x in bent) > 1e-3
  before = _dense_curvatures(state[0], block, len(shapes))
  new = jax.jit(ginger.reorthonormalise)(state)
  unit = float(jnp.finfo(jnp.float64).eps)
  for x in new[0].u.stacks:
    assert float(lowrank.orthonormality_error([x])) < 100 * unit
  for got, want in zip(_dense_curvatures(new[0], block, len(shapes)), before, strict=True):
    np.testing.assert_allclose(got, want, atol=500 * unit * float(jnp.max(jnp.abs(want))))
  assert int(new[0].count) == int(state[0].count)
  for got, want in zip(jax.tree.leaves(new[0].mu), jax.tree.leaves(state[0].mu), strict=True):
    np.testing.assert_array_equal(got, want)
  adam = optax.adam(0.1).init(params)  # no Ginger state: unchanged
  assert jax.tree.structure(ginger.reorthonormalise(adam)) == jax.tree.structure(adam)


def test_update_without_reorthonormalisation_multiplies_by_no_identity():
  """With ``reorthonormalise_every=0`` the step's ``Q`` is ``I``, known while tracing: the
  small algebra takes no products with it (on a GPU each was one more small kernel per bucket:
  ResNet-18 tau 8, 7 of them). No product has a ``k x k`` operand; Brand's kept eigenvectors
  (``(k+1) x k``) are applied twice per rank (``V_k^T w`` and ``V_k`` of its damped part);
  with the ``Q = I`` products there were 7 more."""
  k = 3
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros(5)}
  tx = ginger.scale_by_ginger(k, reorthonormalise_every=0)
  jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), fisher_grads=params)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  shapes = [tuple(v.aval.shape[-2:] for v in e.invars) for e in dots]
  assert not [s for s in shapes if (k, k) in s], shapes
  assert len([s for s in shapes if (k + 1, k) in s]) == 2, shapes


@pytest.mark.parametrize("block", ["per_tensor", "global"])
def test_reorthonormalise_then_update_equals_the_update_that_reorthonormalises(x64, block):
  """``reorthonormalise`` before an update with ``reorthonormalise_every=0`` is the same step
  as the in-update re-orthonormalisation (``reorthonormalise_every=N`` on its N-th update):
  the same updates and the same curvature ``S``, in float64 to 1e-10 relative (the two fold
  ``Q`` in at different points: rounding of order ``k u`` per operation, amplified by at most
  ``1 / gamma``-sized entries of the update)."""
  shapes = [(40,), (12, 3)]
  params = [jnp.zeros(s, jnp.float64) for s in shapes]
  every = 4
  inside = ginger.scale_by_ginger(
    3, 0.9, 1e-2, block, state_dtype="float64", reorthonormalise_every=every
  )
  outside = ginger.scale_by_ginger(
    3, 0.9, 1e-2, block, state_dtype="float64", reorthonormalise_every=0
  )
  rng = np.random.default_rng(1)
  state = outside.init(params)
  for _ in range(every - 1):
    d = _random_like(rng, params)
    _, state = jax.jit(outside.update)(d, state, fisher_grads=d)
  u = state.u  # a little off orthonormal, so that the re-orthonormalisation does something
  state = state._replace(u=type(u)([x * (1 + 1e-4 * (x != 0)) for x in u.stacks], u.layout))
  d = _random_like(rng, params)
  want, want_state = jax.jit(inside.update)(d, state, fisher_grads=d)
  got, got_state = jax.jit(outside.update)(d, ginger.reorthonormalise(state), fisher_grads=d)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10 * float(jnp.max(jnp.abs(w))))
  got_s = _dense_curvatures(got_state, block, len(shapes))
  for g, w in zip(got_s, _dense_curvatures(want_state, block, len(shapes)), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-10 * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize(
  ("block", "every"),
  [
    ("per_tensor", 1),
    *(
      pytest.param(b, e, marks=pytest.mark.slow)
      for b, e in [("global", 1), ("per_tensor", 2), ("global", 2)]
    ),
  ],
)
def test_zero_size_leaves_change_nothing_with_the_pallas_passes(block, every):
  """A leaf with no entries (a (0, n) weight) changes no other leaf's update with the Pallas
  passes too (before: per_tensor with them, the default on GPUs, raised a ZeroDivisionError
  from reshaping its empty bucket for a kernel); the jnp passes: tests/test_contract.py."""
  passes = "pallas"
  rng = np.random.default_rng(0)
  full = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.ones(3)}
  empty = dict(full, e=jnp.zeros((0, 4)))
  outs = []
  for params in (full, empty):
    tx = ginger.ginger(1e-3, tau=2, block=block, passes=passes, curvature_every=every)
    state = tx.init(params)
    update = jax.jit(tx.update)  # interpreted Pallas runs faster compiled than op by op
    for _ in range(2):  # with every=2 the second step has no curvature update
      out, state = update(params, state, params, fisher_grads=params)
    outs.append(out)
  assert outs[1]["e"].shape == (0, 4)
  for key in full:
    np.testing.assert_array_equal(outs[1][key], outs[0][key])
