"""What every optimizer of the library promises as an optax transformation, checked once for
all of them (as optax's ``contrib/_common_test.py`` does for its contributed optimizers): jit,
``optax.chain``, ``optax.inject_hyperparams``, ``optax.multi_transform``, optax's tree
utilities on the state, zero-size and scalar leaves, bfloat16 params, a donated state, integer
params refused, and updates that are finite and shaped and typed as the params.

Each optimizer takes the sampled-Fisher vector ``d_t`` as the extra argument ``fisher_grads``
of ``update``. The math of each one is checked in its own file (tests/test_ginger.py,
tests/test_qng.py, ...)."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ginger

# name: (factory, arguments, the name of the state class the optimizer keeps). Tiny taus and
# shapes: each check compiles a few small programs.
OPTIMIZERS = {
  "ginger": (ginger.ginger, {"learning_rate": 0.1, "tau": 2}, "ScaleByGingerState"),
  "ginger_global": (
    ginger.ginger,
    {"learning_rate": 0.1, "tau": 3, "block": "global", "state_dtype": "float32", "rho": 1.0},
    "ScaleByGingerState",
  ),
  "scale_by_ginger": (
    ginger.scale_by_ginger,
    {"tau": 2, "b1": 0.9, "curvature_every": 2},
    "ScaleByGingerState",
  ),
  "qng": (ginger.qng, {"learning_rate": 0.1, "tau": 2, "rho": 1.0}, "ScaleByQNGState"),
  "scale_by_qng": (ginger.scale_by_qng, {"tau": 2, "block": "per_tensor"}, "ScaleByQNGState"),
  # SOAP: a refresh of the eigenbases at the second step (the first sets them up). With
  # max_precond_dim=3 the (4, 3) matrix has only its 3 x 3 factor, of full rank from the first
  # gradient (its 4 x 4 one would have rank 3: an eigenbasis of the null space that rounding
  # picks, so that hyperparameters in float32 arrays would change the update).
  "soap": (
    ginger.soap,
    {"learning_rate": 0.1, "precondition_frequency": 1, "max_precond_dim": 3},
    "ScaleBySoapState",
  ),
  "scale_by_soap": (
    ginger.scale_by_soap,
    {"b1": 0.9, "max_precond_dim": 3, "merge_dims": True},
    "ScaleBySoapState",
  ),
}
# tau and max_precond_dim fix the state's array shapes and curvature_every the program, so they
# are static under inject_hyperparams (as are the string, bool and None arguments, which it
# leaves alone).
STATIC = ("tau", "curvature_every", "max_precond_dim")

parametrize = pytest.mark.parametrize("name", list(OPTIMIZERS))


def _make(name: str) -> optax.GradientTransformationExtraArgs:
  factory, kwargs, _ = OPTIMIZERS[name]
  return factory(**kwargs)


def _injected(name: str) -> optax.GradientTransformationExtraArgs:
  factory, kwargs, _ = OPTIMIZERS[name]
  static = tuple(k for k in STATIC if k in kwargs)
  return optax.inject_hyperparams(factory, static_args=static)(**kwargs)


def _params(dtype=jnp.float32) -> dict:
  """A matrix and a scalar leaf."""
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.normal(size=(4, 3)), dtype),
    "s": jnp.asarray(rng.normal(), dtype),
  }


def _grads(params: dict, seed: int) -> tuple[dict, dict]:
  """A gradient and a sampled-Fisher vector shaped and typed as ``params``, each leaf's drawn
  by its key alone (the same whatever other leaves the tree has)."""

  def draw(key, p, which):
    rng = np.random.default_rng([seed, which, zlib.crc32(key.encode())])
    return jnp.asarray(rng.normal(size=p.shape), p.dtype)

  return tuple({k: draw(k, p, which) for k, p in params.items()} for which in (0, 1))


def _steps(tx, params, update=None, steps: int = 2, state=None):
  """``steps`` updates (the default: ``tx.update`` jitted); the last updates and state."""
  update = update or jax.jit(tx.update)
  state = tx.init(params) if state is None else state
  for t in range(steps):
    g, d = _grads(params, t)
    updates, state = update(g, state, params, fisher_grads=d)
  return updates, state


@functools.cache
def _reference(name: str):
  """The updates of two jitted steps of the optimizer alone on :func:`_params`."""
  return _steps(_make(name), _params())[0]


def _assert_close(got, want, rtol=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol)


def _assert_like_params(updates, params):
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
    assert u.shape == p.shape and u.dtype == p.dtype, (u.shape, u.dtype, p.shape, p.dtype)
    assert np.all(np.isfinite(np.asarray(u, np.float32)))


@parametrize
def test_jit_gives_finite_updates_like_the_params(name):
  updates = _reference(name)
  _assert_like_params(updates, _params())
  assert any(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(updates))


@parametrize
def test_inside_chain(name):
  """``fisher_grads`` reaches the optimizer through ``optax.chain``."""
  tx, params = _make(name), _params()
  chained = optax.chain(optax.scale(1.0), tx, optax.scale(1.0))
  _assert_close(_steps(chained, params)[0], _reference(name))


@parametrize
def test_inject_hyperparams(name):
  injected, params = _injected(name), _params()
  updates, state = _steps(injected, params)
  _assert_close(updates, _reference(name))
  kwargs = OPTIMIZERS[name][1]
  numeric = {k for k, v in kwargs.items() if isinstance(v, float)}
  assert numeric <= set(state.hyperparams), (numeric, state.hyperparams)


@parametrize
def test_multi_transform(name):
  """On a part of the params, next to another transformation: the optimizer's updates are
  those it gives on that part alone, and the rest goes to the other."""
  tx = _make(name)
  params = dict(_params(), x=jnp.ones(2))
  labels = {"w": "curvature", "s": "curvature", "x": "sgd"}
  multi = optax.multi_transform(
    {"curvature": tx, "sgd": optax.sgd(0.1)}, labels, mask_compatible_extra_args=True
  )
  updates, _ = _steps(multi, params)
  g, _ = _grads(params, 1)  # the last step's
  np.testing.assert_allclose(updates.pop("x"), -0.1 * g["x"], rtol=1e-6)
  _assert_close(updates, _reference(name))


@parametrize
@pytest.mark.parametrize("injected", [False, True])
def test_optax_tree_utilities_on_the_state(name, injected):
  """``optax.tree.map_params`` finds no params-shaped tree in a stacked state (Ginger's ``U``,
  ``sigma`` and momentum reach ``transform_non_params`` whole) and maps as on Adam's, also
  under ``inject_hyperparams``; ``optax.tree.get`` / ``set`` read and write the count."""
  tx, params = (_injected if injected else _make)(name), _params()
  state_name = OPTIMIZERS[name][2]
  state = tx.init(params)
  same = optax.tree.map_params(tx, lambda p: p, state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)
  marked = optax.tree.map_params(tx, lambda p: p, state, transform_non_params=lambda _: "x")
  inner = optax.tree.get(marked, state_name)
  if state_name == "ScaleByGingerState":  # no params-shaped tree: all of it reached the transform
    assert inner.u == inner.sigma == inner.count == "x", inner
  own = optax.tree.get(state, state_name)
  bumped = optax.tree.set(own, count=own.count + 5)
  assert int(optax.tree.get(bumped, "count")) == int(own.count) + 5


@parametrize
def test_zero_size_leaf_changes_no_other_update(name):
  """A leaf with no entries (a ``(0, n)`` weight) is an empty piece of its block: its update is
  empty and every other leaf's is the one without it, to rounding. The two are different
  programs (one more leaf to lay out), and XLA may order a block's sums differently in them:
  a sum of n terms reordered moves by at most about n eps of its terms' magnitude (Higham),
  n <= 12 here, so 16 eps of the leaf's largest entry bounds it (the differences seen: 1 ulp)."""
  tx, params = _make(name), _params()
  with_empty = dict(params, e=jnp.zeros((0, 4)))
  updates, _ = _steps(tx, with_empty)
  assert updates["e"].shape == (0, 4)
  for key in params:
    reference = np.asarray(_reference(name)[key])
    bound = 16 * np.finfo(np.float32).eps * np.abs(reference).max()
    np.testing.assert_allclose(updates[key], reference, rtol=0, atol=bound)


@parametrize
def test_bfloat16_params(name):
  """The curvature state stays in float32 (the default ``state_dtype``) for bfloat16 params,
  and the updates come back in bfloat16."""
  tx, params = _make(name), _params(jnp.bfloat16)
  updates, state = _steps(tx, params)
  _assert_like_params(updates, params)
  own = optax.tree.get(state, OPTIMIZERS[name][2])
  floats = [x for x in jax.tree.leaves(own) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.float32 for x in floats), {x.dtype for x in floats}


@parametrize
def test_donated_state(name):
  """With the state donated to the jitted update (as the training loop does), the update is
  the same and the old state's buffers are given to the new one."""
  tx, params = _make(name), _params()
  donating = jax.jit(tx.update, donate_argnums=(1,))
  state = tx.init(params)
  first = jax.tree.leaves(state)
  updates, _ = _steps(tx, params, update=donating, state=state)
  assert all(x.is_deleted() for x in first if x.size)
  _assert_close(updates, _reference(name))


@parametrize
def test_integer_params_are_refused_naming_the_leaf(name):
  params = {"w": jnp.ones(3), "steps": jnp.zeros(2, jnp.int32)}
  with pytest.raises(ValueError, match=r"\['steps'\] \(int32\).*optax.masked"):
    _make(name).init(params)
