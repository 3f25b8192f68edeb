"""``sigma_max * eps / gamma`` (``kappa eps``): where a Ginger state's precision runs out.

The float32 direction's error bound (docs/ginger-math.md, section 6) has the term ``eps theta
kappa``, ``kappa = sigma_max / gamma`` and ``theta`` the part of the gradient outside ``span U``
when the step starts: pass 3's difference of two vectors of size ``theta |g|``, rounded along
directions that then carry curvature ``sigma``. Past ``kappa eps = 1`` a gradient far from
``span U`` gets a direction of no accuracy. ``ginger.kappa_eps`` reports it per block; the
training log records the largest every log step and warns once past 1.
"""

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_float32_exactness import _objectives

import ginger
from training import kappa, run_record
from training import loop as train
from training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
EPS32 = float(np.finfo(np.float32).eps)


def test_kappa_eps_is_sigma_max_times_eps_over_gamma(x64):
  """From a fresh state, one update with ``d = g`` gives ``sigma_max = (1 - alpha) |g|^2`` per
  leaf; ``kappa_eps`` is that times the state dtype's eps over ``gamma``, under ``jit`` and on
  the state fetched to the host alike; a fresh state's is 0."""
  alpha, gamma = 0.5, 1e-4
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  grads = {"w": jnp.ones((3, 2)), "b": 2 * jnp.ones(2)}
  for dtype in ("float32", "float64"):
    tx = ginger.ginger(0.1, tau=2, alpha=alpha, gamma=gamma, state_dtype=dtype)
    p = jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), params)
    state = tx.init(p)
    assert ginger.kappa_eps(state, gamma) == {"['b']": 0.0, "['w']": 0.0}
    # One program, not Ginger's update op by op (hundreds of small compilations).
    update = jax.jit(tx.update)
    _, state = update(jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), grads), state, p)
    eps = float(np.finfo(dtype).eps)
    want = {"['b']": (1 - alpha) * 8 * eps / gamma, "['w']": (1 - alpha) * 6 * eps / gamma}
    on_device = jax.jit(ginger.kappa_eps, static_argnums=1)(state, gamma)
    on_host = ginger.kappa_eps(jax.device_get(state), gamma)
    assert isinstance(on_host["['w']"], np.generic)  # numpy arithmetic: no device program
    for got in (on_device, on_host):
      assert set(got) == set(want)
      for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=4 * eps)  # a few roundings


def _direction_errors(gamma: float, steps: int = 200):
  """A 12-entry leaf at tau 2 fed a new random direction every step (``d = g``, ``theta`` near
  ``sqrt(10 / 12)``), ``|g| ~ 100``: the float32 direction's G-norm error against the float64
  state's, relative to that direction, and the float32 state's ``kappa_eps``, per step."""
  n, tau, alpha, scale = 12, 2, 0.99, 30.0
  tx32 = ginger.scale_by_ginger(tau, alpha, gamma, state_dtype="float32")
  tx64 = ginger.scale_by_ginger(tau, alpha, gamma, state_dtype="float64")

  def step(carry, key):
    s32, s64 = carry
    g32 = {"w": (scale * jax.random.normal(key, (n,))).astype(jnp.float32)}
    g64 = jax.tree.map(lambda x: x.astype(jnp.float64), g32)  # the same numbers
    u32, s32 = tx32.update(g32, s32, fisher_grads=g32)
    u64, s64 = tx64.update(g64, s64, fisher_grads=g64)
    u, sigma = s64.u["w"], s64.sigma["w"]
    norm = lambda x: jnp.sqrt(gamma * x @ x + jnp.sum(sigma * (u.T @ x) ** 2))  # noqa: E731
    err = norm(u32["w"].astype(jnp.float64) - u64["w"]) / norm(u64["w"])
    return (s32, s64), (err, ginger.kappa_eps(s32, gamma)["['w']"])

  init = (tx32.init({"w": jnp.zeros(n, jnp.float32)}), tx64.init({"w": jnp.zeros(n)}))
  keys = jax.random.split(jax.random.key(0), steps)
  _, (err, kappa_eps) = jax.jit(lambda keys: jax.lax.scan(step, init, keys))(keys)
  return np.asarray(err), np.asarray(kappa_eps)


def test_the_direction_loses_its_accuracy_where_kappa_eps_passes_1(x64):
  """The same gradients at gamma 1e-5 (``kappa eps`` ~ 10) and 1e-3 (~ 0.1): the float32
  direction's error grows with ``eps theta kappa``. Past 1 it exceeds the direction itself (no
  digit left); at 100 times the damping it keeps more than one digit."""
  err, kappa_eps = _direction_errors(1e-5)
  assert np.max(kappa_eps) > 5
  assert np.max(err) > 1
  err, kappa_eps = _direction_errors(1e-3)
  assert np.max(kappa_eps) < 0.2
  assert np.max(err) < 0.1


def _final_loss_and_kappa_eps(loss, p0, tx, dtype, gamma, steps):
  """Loss after ``steps`` steps with the empirical Fisher, and the largest ``kappa_eps`` on
  the way."""
  p0 = jax.tree.map(lambda x: x.astype(dtype), p0)

  def step(carry, _):
    p, s = carry
    u, s = tx.update(jax.grad(loss)(p), s, p)
    largest = jnp.max(jnp.stack(list(ginger.kappa_eps(s, gamma).values())))
    return (optax.apply_updates(p, u), s), largest

  (p, _), largest = jax.lax.scan(step, (p0, tx.init(p0)), None, length=steps)
  return loss(p), jnp.max(largest)


def _run(name: str, gamma: float, steps: int = 1000) -> dict[str, tuple[float, float]]:
  """``{state_dtype: (final loss, largest kappa_eps)}`` of Ginger at tau 2 with the clip, the
  empirical Fisher and lr 1e-2 on one of optax's objectives (test_float32_exactness)."""
  p0, loss = _objectives()[name]
  out = {}
  for dtype, state in ((jnp.float32, "float32"), (jnp.float64, "float64")):
    tx = ginger.ginger(1e-2, tau=2, gamma=gamma, rho=1.0, state_dtype=state)
    run = jax.jit(_final_loss_and_kappa_eps, static_argnums=(0, 2, 3, 4, 5))
    final, largest = run(loss, p0, tx, dtype, gamma, steps)
    out[state] = (float(final), float(largest))
  return out


def test_small_quadratics_part_where_kappa_eps_passes_1(x64):
  """Tau 2, the clip, the empirical Fisher, lr 1e-2, 1,000 steps, a float32 against a float64
  state. At gamma 1e-3 the quadratics stay below ``kappa eps = 1`` and the two states end at
  the same loss to four digits (while still far from converged); Rosenbrock's curvature
  (``sigma`` ~ 3e3) takes it past 1 there and at gamma 1e-5 (~ 300), and there the two part
  (about twice the loss apart at gamma 1e-5)."""
  for name in ("parabola", "matrix_parabola", "mixed"):
    run = _run(name, 1e-3)
    assert run["float32"][1] < 1, (name, run)
    f32, f64 = run["float32"][0], run["float64"][0]
    assert abs(f32 - f64) <= 1e-4 * max(abs(f64), 1e-6), (name, run)
  for gamma in (1e-3, 1e-5):
    run = _run("rosenbrock", gamma)
    assert run["float32"][1] > 1, (gamma, run)
    f32, f64 = run["float32"][0], run["float64"][0]
    assert abs(f32 - f64) > 1e-4 * abs(f64), (gamma, run)


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


BASE = [
  "experiment=demo",
  "optimizer=ginger",
  "logger=none",
  "log_every=1",
  "spectrum_every=1",
  "eval_every=100",
  "checkpoint_every=100",
  "max_steps=2",
  "batch_size=16",
]


def test_the_training_log_warns_once_past_1(tmp_path, caplog):
  """The train records hold the largest block's ``kappa_eps`` and the spectrum events every
  block's; at gamma 1e-9 (the demo's sigma ~ 1e-2 and up: far past 1) the log warns once over
  two log steps, naming gamma and state_dtype."""
  gamma = 1e-9
  with caplog.at_level(logging.WARNING, logger="train"):
    train.train(config(*BASE, f"gamma={gamma}"), tmp_path)
  warnings = [r.getMessage() for r in caplog.records if "sigma_max * eps / gamma" in r.getMessage()]
  events = list(run_record.read_events(tmp_path, strict=True))
  kappa_eps = [e["kappa_eps"] for e in events if e["event"] == "train"]
  spectra = list(run_record.read_spectrum(tmp_path, strict=True))
  assert len(kappa_eps) == 2 and len(spectra) == 2
  for event, largest in zip(spectra, kappa_eps, strict=True):
    assert set(event["kappa_eps"]) == set(event["sigma"])
    assert max(event["kappa_eps"].values()) == largest
  assert min(kappa_eps) > 1
  assert len(warnings) == 1
  assert f"gamma {gamma:g}" in warnings[0] and "state_dtype float32" in warnings[0]
  assert "raise gamma" in warnings[0]


@pytest.mark.parametrize(
  ("ratios", "warns"), [({}, False), ({"a": 0.5, "b": 1.0}, False), ({"a": 0.5, "b": 1.5}, True)]
)
def test_the_warning_needs_a_block_above_1(caplog, ratios, warns):
  """``warn_once`` stays quiet without Ginger blocks and at or below 1 (the gamma 1e-3 regime of
  the demo), and names the block above 1 with the gamma that would bring it to 1."""
  rc = RunConfig.from_resolved(OmegaConf.to_container(config(*BASE, "gamma=1e-3"), resolve=True))
  with caplog.at_level(logging.WARNING, logger="train"):
    assert kappa.warn_once(rc, ratios, done=7) is warns
  messages = [r.getMessage() for r in caplog.records]
  if warns:
    assert len(messages) == 1 and "step 7" in messages[0] and " in b " in messages[0]
    assert "at least 0.0015" in messages[0]
  else:
    assert not messages
