"""ginger.scale_by_soap against the SOAP authors' PyTorch implementation, and its properties.

The reference is the authors' ``soap.py``, vendored unchanged in tests/vendored/soap_torch.py
and run on the CPU in float32. Both are fed the same gradients (drawn once, independent of the
parameters), so the comparison is of the optimizers alone: every step's update, over 30 steps
that cross several eigenbasis refreshes.

**Tolerance.** The two compute the same float32 arithmetic in different orders, and their
eigensolvers (PyTorch's and XLA's ``eigh`` and ``qr``) differ by rounding. An eigenvector moves
by about ``u ||F|| / gap`` under a perturbation of ``u ||F||`` (Davis-Kahan; ``u = 6e-8``,
float32's unit roundoff): the factors these gradients make have relative eigengaps of 1-5 %,
so the bases, and the updates they rotate, agree to about ``100 u = 6e-6`` (the largest
relative difference seen is 8e-6). :data:`RTOL` = 1e-4 leaves a margin of 10 over that and is
still a thousand times below what a real difference makes (a refresh one step off, below: a
relative difference of order 0.1). Eigenvectors are fixed only up to sign, and so is each
implementation's: the update is invariant to the signs (a column of ``Q_i`` and the slice of
``m`` it rotates flip together, ``v`` holds squares), which is why updates, not bases, are
compared.

**Shapes.** A factor made from one gradient, ``F = G G^T``, is singular when ``G`` is not square
(a ``7 x 5`` gradient's ``7 x 7`` factor has rank 5): the first ``eigh`` then returns a basis of
its null space that the input does not determine (each library's rounding picks one), and the
two implementations' updates differ by 10 % from the second step on, as the reference differs
from itself under any change of rounding. The comparisons therefore use shapes whose factors
have full rank from the first step (a square matrix, a 3x3x4x8 kernel, an axis above
``max_precond_dim``); for a non-square matrix and a preconditioned 1-D leaf, whose first factor
is singular, the reference's first basis is handed to this implementation
(:func:`test_a_singular_first_factor_with_the_references_first_basis`).
"""

from __future__ import annotations

import math
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import ginger
from ginger._src import soap as soap_src

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-4  # per leaf and step, ||u - u_ref|| / ||u_ref||: see the module docstring
STEPS = 30
# A square matrix, a conv-like kernel (HWIO), a bias (Adam unless precondition_1d) and a
# matrix with one axis above max_precond_dim=10 (a factor on its first axis only).
SHAPES = {"w": (6, 6), "kernel": (3, 3, 4, 8), "bias": (5,), "wide": (4, 12)}


def draw_grads(shapes: dict, steps: int = STEPS, seed: int = 0) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(seed)
  return [
    {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(steps)
  ]


def reference():
  """torch and the authors' ``SOAP``, imported where a test uses them: every pytest-xdist
  worker collects this file, one runs it."""
  import torch
  from vendored.soap_torch import SOAP

  return torch, SOAP


def torch_updates(grads, shapes, first_bases=None, **kwargs):
  """The reference's update of every step (its parameters zeroed before each step and lr = 1,
  so that after the step they hold ``-u_t``; without weight decay the update does not depend
  on the parameters). Also returns the optimizer, for its state."""
  torch, SOAP = reference()
  params = {k: torch.nn.Parameter(torch.zeros(s)) for k, s in shapes.items()}
  opt = SOAP(list(params.values()), lr=1.0, weight_decay=0.0, **kwargs)
  out = []
  for g in grads:
    for k, p in params.items():
      p.data.zero_()
      p.grad = torch.from_numpy(g[k].copy())
    opt.step()
    out.append({k: -p.detach().numpy().astype(np.float64) for k, p in params.items()})
    if first_bases is not None and len(out) == 1:
      first_bases.update({k: opt.state[p]["Q"] for k, p in params.items()})
  return out


def jax_updates(grads, shapes, set_first_bases=None, **kwargs):
  """:func:`ginger.scale_by_soap`'s update of every step, jitted; ``set_first_bases(state)``:
  the state after the first step replaced."""
  tx = ginger.scale_by_soap(**kwargs)
  state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
  update = jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state)
    out.append({k: np.asarray(v, np.float64) for k, v in u.items()})
    if set_first_bases is not None and len(out) == 1:
      state = set_first_bases(state)
  return out


def relative_errors(got, want) -> dict[str, float]:
  """The largest ``||u - u_ref|| / ||u_ref||`` of each leaf over the steps after the first."""
  return {
    k: max(np.linalg.norm(g[k] - w[k]) / np.linalg.norm(w[k]) for g, w in zip(got[1:], want[1:]))
    for k in want[0]
  }


def torch_kwargs(kwargs: dict) -> dict:
  """The reference's names: ``betas`` for ``b1``, ``b2``; -1 for ``shampoo_beta=None``."""
  out = dict(kwargs)
  if "b1" in out or "b2" in out:
    out["betas"] = (out.pop("b1", 0.95), out.pop("b2", 0.95))
  return out


# ----------------------------------------------------------------------------- the reference


CASES = {
  # The authors' defaults, but for max_precond_dim (10: "wide"'s 12 gets no factor): refreshes
  # after steps 10, 20 and 30.
  "defaults": {"max_precond_dim": 10},
  # A refresh every 4 steps, the kernel merged into (9, 4, 8).
  "merge_dims": {"max_precond_dim": 16, "merge_dims": True, "precondition_frequency": 4},
  "options": {
    "b1": 0.9,
    "b2": 0.99,
    "shampoo_beta": 0.8,
    "eps": 1e-6,
    "precondition_frequency": 3,
    "max_precond_dim": 10,
    "normalize_grads": True,
    "correct_bias": False,
  },
}


@pytest.mark.parametrize("case", list(CASES))
def test_updates_match_the_authors_implementation(case):
  kwargs = CASES[case]
  shapes = dict(SHAPES)
  if case == "merge_dims":
    del shapes["wide"]  # merged with max 16 it is (4, 12): a singular first factor
  grads = draw_grads(shapes)
  want = torch_updates(grads, shapes, **torch_kwargs(kwargs))
  got = jax_updates(grads, shapes, **kwargs)
  for k in shapes:  # the first step only sets up the preconditioner
    assert not np.any(got[0][k]) and not np.any(want[0][k]), k
  errors = relative_errors(got, want)
  assert max(errors.values()) < RTOL, errors


def test_a_refresh_one_step_off_is_detected():
  """The comparison can fail: refreshing every 5 steps against the reference's 4 changes the
  updates by far more than :data:`RTOL`."""
  shapes = {"w": SHAPES["w"]}
  grads = draw_grads(shapes, steps=12)
  want = torch_updates(grads, shapes, precondition_frequency=4)
  got = jax_updates(grads, shapes, precondition_frequency=5)
  assert relative_errors(got, want)["w"] > 100 * RTOL


def test_a_singular_first_factor_with_the_references_first_basis():
  """A non-square matrix (a 7 x 5 gradient: its 7 x 7 factor has rank 5 at first) and a 1-D
  leaf with ``precondition_1d`` (rank 1): the first basis is not determined by its input
  (module docstring), so the reference's is handed over; from there the two agree, through the
  refreshes that follow."""
  shapes = {"w": (7, 5), "bias": (6,)}
  kwargs = {"precondition_frequency": 4, "precondition_1d": True}
  grads = draw_grads(shapes, seed=1)
  first = {}
  want = torch_updates(grads, shapes, first_bases=first, **kwargs)

  def with_references_bases(state):
    leaves = sorted(shapes)  # jax.tree.leaves order of a dict: its sorted keys
    bases = [tuple(jnp.asarray(q.numpy()) for q in first[k]) for k in leaves]
    return state._replace(bases=bases)

  got = jax_updates(grads, shapes, set_first_bases=with_references_bases, **kwargs)
  errors = relative_errors(got, want)
  assert max(errors.values()) < RTOL, errors


@settings(max_examples=200, deadline=None)
@given(
  shape=st.lists(st.integers(1, 40), min_size=2, max_size=5),
  max_precond_dim=st.integers(1, 200),
)
def test_merged_shape_is_the_authors(shape, max_precond_dim):
  torch, SOAP = reference()
  authors = SOAP([torch.nn.Parameter(torch.zeros(1))])
  merged = authors.merge_dims(torch.zeros(shape), max_precond_dim).shape
  assert soap_src.merged_shape(tuple(shape), max_precond_dim) == tuple(merged)


# ----------------------------------------------------------------------------- properties


def test_leaves_without_a_factor_get_adams_update_from_the_second_step():
  """A 1-D leaf (without ``precondition_1d``) and a matrix whose axes both exceed
  ``max_precond_dim`` have no factor: SOAP is Adam on them, one step late (its first update
  is zero). With ``eps=0`` the two bias corrections are the same expression; what remains is
  float32 rounding, relative to each moment's terms (an entry of ``m`` that cancels to 1e-3 of
  them carries their rounding, hence norm-wise)."""
  shapes = {"bias": (5,), "big": (4, 3)}
  grads = draw_grads(shapes, steps=8)
  got = jax_updates(grads, shapes, b1=0.9, b2=0.99, eps=0.0, max_precond_dim=2)
  adam = optax.scale_by_adam(b1=0.9, b2=0.99, eps=0.0)
  state = adam.init({k: jnp.zeros(s) for k, s in shapes.items()})
  for g, u in zip(grads[1:], got[1:]):
    want, state = adam.update({k: jnp.asarray(v) for k, v in g.items()}, state)
    for k in shapes:
      assert np.linalg.norm(u[k] - want[k]) < 1e-6 * np.linalg.norm(want[k]), k


@pytest.mark.parametrize("seed", [0, 1])
def test_the_update_turns_with_the_gradients(seed):
  """Rotation equivariance, what sets SOAP apart from Adam: gradients ``U G_t V^T`` (``U``,
  ``V`` orthogonal) make updates ``U u_t V^T`` (the factors become ``U L U^T`` and
  ``V R V^T``, their eigenbases ``U Q_L`` and ``V Q_R``). Adam's element-wise update does not.
  Float32 rounding enters as against the reference (:data:`RTOL`)."""
  rng = np.random.default_rng(seed)
  rotation = lambda n: np.linalg.qr(rng.normal(size=(n, n)))[0].astype(np.float32)
  u_rot, v_rot = rotation(5), rotation(5)
  grads = draw_grads({"w": (5, 5)}, steps=12, seed=seed)
  turned = [{"w": u_rot @ g["w"] @ v_rot.T} for g in grads]
  kwargs = {"precondition_frequency": 3}
  plain = jax_updates(grads, {"w": (5, 5)}, **kwargs)
  got = jax_updates(turned, {"w": (5, 5)}, **kwargs)
  want = [{"w": u_rot @ p["w"] @ v_rot.T} for p in plain]
  assert relative_errors(got, want)["w"] < RTOL
  adam = optax.scale_by_adam()
  state = adam.init(jnp.zeros((5, 5)))
  a_plain, _ = adam.update(jnp.asarray(grads[0]["w"]), state)
  a_turned, _ = adam.update(jnp.asarray(turned[0]["w"]), state)
  a_want = u_rot @ np.asarray(a_plain) @ v_rot.T
  assert np.linalg.norm(np.asarray(a_turned) - a_want) > 0.1 * np.linalg.norm(a_want)


def test_it_trains_a_small_network():
  """A two-layer network on a regression target, its first layer a 4-D (1, 1, 8, 16) kernel:
  SOAP brings the loss down a thousandfold in 150 steps (to 2e-4 of where it starts; Adam at the
  same lr to 1e-3), its state shaped as documented."""
  x = jax.random.normal(jax.random.key(0), (256, 8))
  w_true = jax.random.normal(jax.random.key(1), (8, 3))
  y = jnp.tanh(x @ w_true)
  params = {
    "kernel": 0.3 * jax.random.normal(jax.random.key(2), (1, 1, 8, 16)),
    "bias": jnp.zeros(16),
    "head": 0.3 * jax.random.normal(jax.random.key(3), (16, 3)),
  }

  def loss_fn(p):
    h = jnp.tanh(x @ p["kernel"].reshape(8, 16) + p["bias"])
    return jnp.mean((h @ p["head"] - y) ** 2)

  tx = ginger.soap(learning_rate=3e-2)

  @jax.jit
  def step(p, state):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  state = tx.init(params)
  soap_state = optax.tree.get(state, "ScaleBySoapState")
  # jax.tree.leaves order: bias, head, kernel. The bias has no factor by default.
  assert [[None if f is None else f.shape for f in fs] for fs in soap_state.factors] == [
    [None],
    [(16, 16), (3, 3)],
    [(1, 1), (1, 1), (8, 8), (16, 16)],
  ]
  first = float(loss_fn(params))
  for _ in range(150):
    params, state, loss = step(params, state)
  assert float(loss) < 1e-3 * first, (first, float(loss))


def test_state_bytes_per_parameter():
  """m and v: 8 bytes per parameter; a factor of size d adds 2 d^2 floats (F and Q)."""
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32), "e": jnp.zeros((20000, 8))}
  state = ginger.scale_by_soap().init(params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  # The embedding's 20000 > max_precond_dim: a factor on its 8-axis only.
  factors = 2 * 4 * (64**2 + 32**2 + 8**2)
  assert nbytes == 8 * (64 * 32 + 32 + 20000 * 8) + factors + 4  # + the int32 count


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"b1": 1.0}, r"b1 must lie in \[0, 1\).*got 1.0"),
    ({"b2": -0.1}, r"b2 must lie in \[0, 1\)"),
    ({"shampoo_beta": -1}, r"shampoo_beta must lie in \[0, 1\).*got -1"),
    ({"eps": -1e-8}, r"eps must be a finite number >= 0"),
    ({"precondition_frequency": 0}, r"precondition_frequency must be an int >= 1.*got 0"),
    ({"precondition_frequency": 2.5}, r"precondition_frequency must be an int >= 1"),
    ({"max_precond_dim": 0}, r"max_precond_dim must be an int >= 1"),
    ({"max_precond_dim": 1e4}, r"max_precond_dim must be a Python int >= 1.*static_args"),
    ({"merge_dims": 1}, r"merge_dims must be True or False, got 1"),
  ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ginger.scale_by_soap(**kwargs)


def test_bad_weight_decay_is_refused():
  with pytest.raises(ValueError, match=r"weight_decay must be >= 0, got -0.1"):
    ginger.soap(1e-3, weight_decay=-0.1)


def test_preconditioned_shape():
  shape = soap_src.preconditioned_shape
  assert shape((3, 3, 64, 128), 10000, False, False) == ((3, 3, 64, 128), (True,) * 4)
  assert shape((3, 3, 64, 128), 10000, True, False) == ((576, 128), (True, True))
  assert shape((50000, 512), 10000, False, False) == ((50000, 512), (False, True))
  assert shape((10,), 10000, False, False) == ((10,), (False,))
  assert shape((10,), 10000, False, True) == ((10,), (True,))
  assert shape((0, 4), 10000, False, False) == ((0, 4), (False, False))
  assert shape((), 10000, False, False) == ((), ())
  assert math.prod(shape((7, 11, 13), 100, True, False)[0]) == 7 * 11 * 13


@settings(max_examples=40, deadline=None)
@given(
  shape=st.lists(st.integers(1, 20), min_size=1, max_size=4),
  axis=st.integers(0, 3),
  seed=st.integers(0, 2**31 - 1),
)
def test_axis_second_moment_is_the_float64_contraction(shape, axis, seed):
  """``G_(i) G_(i)^T`` on both of its paths (a sum of products up to NARROW_FACTOR rows, a dot
  above) against float64. Any float32 summation of ``K`` products is within ``gamma_K =
  K u / (1 - K u)`` of the exact sum, relative to ``sum_k |g_ik g_jk|`` (Higham, Accuracy and
  Stability, 3.1; ``u = 2^-24``), whatever the order of the sum."""
  axis %= len(shape)
  g = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  got = np.asarray(jax.jit(soap_src.axis_second_moment, static_argnums=1)(jnp.asarray(g), axis))
  rows = np.moveaxis(g.astype(np.float64), axis, 0).reshape(shape[axis], -1)
  k = rows.shape[1]
  gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
  assert got.shape == (shape[axis], shape[axis])
  assert np.all(np.abs(got - rows @ rows.T) <= gamma * (np.abs(rows) @ np.abs(rows).T) + 1e-30)


# ----------------------------------------------------------------------------- the framework


def test_update_flops_count_every_step_and_the_refresh_amortised():
  """training/registry.py's count (models.flops.soap_update_flops), by hand: a (6, 4) matrix
  (factors 6 and 4), a bias (none), a kernel (3, 3, 2, 8) (factors 3, 3, 2, 8) and an
  embedding (20000, 8) (its 20000 > max_precond_dim: a factor of 8 only)."""
  from hydra import compose, initialize_config_dir

  from training import registry

  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    cfg = compose(config_name="config", overrides=["optimizer=soap"])
  opt = registry.optimizer_config(cfg)
  shapes = [(6, 4), (5,), (3, 3, 2, 8), (20000, 8)]
  sizes = [math.prod(s) for s in shapes]
  factors = [(24, [6, 4]), (5, []), (144, [3, 3, 2, 8]), (160000, [8])]
  f = 10  # precondition_frequency
  want = 10 * sum(sizes)  # Adam's element-wise work
  for n, dims in factors:
    for d in dims:
      want += 2 * 3 * n * d + 3 * d * d + (2 * (2 * d**3 + n * d) + 8 / 3 * d**3) / f
  params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  got = registry.update_flops(opt, params)
  assert got == pytest.approx(want, rel=1e-12)


def test_the_config_check_names_a_bad_soap_key():
  from hydra import compose, initialize_config_dir

  from training.config_check import ConfigError, check_config

  overrides = ["optimizer=soap", "optimizer.precondition_frequency=0", "optimizer.merge_dims=1"]
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    cfg = compose(config_name="config", overrides=overrides)
  with pytest.raises(ConfigError) as info:
    check_config(cfg, overrides=overrides)
  assert "optimizer.precondition_frequency=0: must be an integer >= 1." in str(info.value)
  assert "optimizer.merge_dims=1: must be one of [False, True]." in str(info.value)


# An end-to-end demo run (~15 s on 2 cores): with `make test-all`; the update is checked against
# the authors' code above without a run.
@pytest.mark.slow
def test_train_py_trains_the_demo_with_soap(tmp_path):
  """``train.py experiment=demo optimizer=soap``, 20 steps (a refresh of the bases after step
  11): the digits' validation accuracy climbs from chance (10 %) past 80 % (96 % seen). The
  run's analytic FLOPs count SOAP's update from the trained leaves' shapes (without them the
  count raises and the run would fail)."""
  from hydra import compose, initialize_config_dir

  from training import loop

  overrides = ["experiment=demo", "optimizer=soap", "logger=none", "max_steps=20"]
  overrides += ["eval_every=20", "log_every=5", "checkpoint_every=20"]
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    cfg = compose(config_name="config", overrides=overrides)
  summary = loop.train(cfg, tmp_path / "soap")
  assert summary["status"] == "completed" and summary["steps"] == 20
  assert summary["run"]["optimizer"] == "soap" and summary["run"]["tau"] is None
  assert summary["best_val_accuracy"] > 80, summary["best_val_accuracy"]
  assert summary["min_train_loss"] < 0.5 * math.log(10), summary["min_train_loss"]
  assert summary["flops_per_iter"]["analytic"] > 0
