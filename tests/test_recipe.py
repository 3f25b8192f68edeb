"""The recipe beyond the paper's protocol (training/optimizers.py): the warm-up + cosine schedule,
weight decay as an L2 term or decoupled (AdamW's), checked against optax's own optimizers; the
keys' checks; the run identity that keeps recipe runs apart; the recipe sweep's arms."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sweeps.arms import ARMS
from training import run_record
from training.config_check import ConfigError, check_config
from training.optimizers import build_optimizer, decoupled_weight_decay, learning_rate
from training.run_config import parse

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH, TOTAL = 10, 50


def config(*overrides: str):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def run(tx: optax.GradientTransformation, steps: int = 6) -> dict:
  """``steps`` jitted updates of a small problem (a matrix and a bias, a quadratic loss)."""
  keys = jax.random.split(jax.random.key(0), 2)
  params = {"w": jax.random.normal(keys[0], (4, 3)), "b": jax.random.normal(keys[1], (3,))}

  def loss(p):
    return jnp.sum((p["w"] - 0.5) ** 2) + jnp.sum(jnp.sin(p["b"]))

  @jax.jit
  def step(p, state):
    updates, state = tx.update(jax.grad(loss)(p), state, p)
    return optax.apply_updates(p, updates), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params


def schedule_of(*overrides: str) -> optax.Schedule:
  return learning_rate(parse(config(*overrides)), STEPS_PER_EPOCH, TOTAL)


def test_warmup_cosine_is_optaxs_and_peaks_at_lr():
  """Linear warm-up over warmup_epochs from 0 to lr, then a cosine decay to 0 at the last step."""
  lr = schedule_of("lr=0.1", "schedule=warmup_cosine", "warmup_epochs=2")
  want = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2 * STEPS_PER_EPOCH, TOTAL)
  steps = np.arange(TOTAL + 1)
  np.testing.assert_array_equal(jax.vmap(lr)(steps), jax.vmap(want)(steps))
  assert float(lr(0)) == 0.0 and float(lr(20)) == pytest.approx(0.1) and float(lr(TOTAL)) == 0.0


def test_decoupled_decay_after_adam_is_optaxs_adamw():
  """AdamW (Loshchilov & Hutter): the decay leaves the weights beside Adam's normalised step,
  ``-lr_t (m_hat / (sqrt(v_hat) + eps) + wd p)``; chained after optax.adam it is optax.adamw up
  to the one rounding of the sum optax.adamw forms inside the lr product (float32: a relative
  2^-24 of each update, far below the 1e-6 compared)."""
  lr = optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, 8)
  ours = run(optax.chain(optax.adam(lr), decoupled_weight_decay(0.1, lr)))
  want = run(optax.adamw(lr, weight_decay=0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ours, want)
  no_decay = run(optax.adam(lr))
  assert not np.allclose(ours["w"], no_decay["w"], rtol=1e-4)  # the decay moved the weights


@pytest.mark.parametrize(
  ("optimizer", "mode", "want"),
  [
    (
      "adam",
      "decoupled",
      lambda lr, wd: optax.adamw(lr, b1=0.9, b2=0.99, eps=1e-8, weight_decay=wd),
    ),
    (
      "adam",
      "l2",
      lambda lr, wd: optax.chain(optax.add_decayed_weights(wd), optax.adam(lr, b2=0.99)),
    ),
    (
      "schedule_free_adamw",
      "decoupled",
      lambda lr, wd: optax.contrib.schedule_free_adamw(lr, weight_decay=wd),
    ),
  ],
)
def test_train_pys_weight_decay_is_the_libraries(optimizer, mode, want):
  """train.py's ``weight_decay`` with ``weight_decay_mode``: l2 adds ``wd * params`` to the
  gradient before the optimizer; decoupled is AdamW's for Adam, and schedule-free AdamW's own
  decay (its registry entry applies it: a decay after its update would shrink the averaged
  iterate, not z)."""
  overrides = (
    f"optimizer={optimizer}",
    "lr=0.01",
    "schedule=warmup_cosine",
    "warmup_epochs=1",
    "weight_decay=0.2",
    f"weight_decay_mode={mode}",
  )
  rc = parse(config(*overrides))
  lr = learning_rate(rc, STEPS_PER_EPOCH, TOTAL)
  ours = run(build_optimizer(rc, lr))
  theirs = run(want(lr, 0.2))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ours, theirs)


def test_a_bad_weight_decay_mode_is_named():
  with pytest.raises(ConfigError) as info:
    check_config(config("weight_decay_mode=adamw"), overrides=("weight_decay_mode=adamw",))
  message = str(info.value)
  assert "weight_decay_mode" in message and "'adamw'" in message and "decoupled" in message


def test_settings_without_effect_are_warned(caplog):
  overrides = ("weight_decay_mode=decoupled", "schedule=cosine", "warmup_epochs=3")
  with caplog.at_level(logging.WARNING):
    check_config(config(*overrides), overrides=overrides)
  assert "weight_decay_mode is ignored: weight_decay=0" in caplog.text
  assert "warmup_epochs is ignored: schedule=cosine" in caplog.text


def test_the_run_identity_keeps_a_recipe_apart():
  """The paper's protocol (constant lr, no decay) adds nothing to summary.json's "run" block,
  so the committed runs keep their identity; a recipe run records its schedule and decay, and
  its seeds do not pool with the paper's."""
  plain = run_record.identity(config())
  assert run_record.RECIPE not in plain
  recipe = run_record.identity(
    config("schedule=warmup_cosine", "warmup_epochs=2", "weight_decay=0.05")
  )
  assert recipe[run_record.RECIPE] == {
    "schedule": "warmup_cosine",
    "warmup_epochs": 2.0,
    "weight_decay": 0.05,
    "weight_decay_mode": "l2",
  }


def test_recipe_arms_decay_alike_at_their_tuned_lrs():
  """Each recipe arm's weight decay is 5e-5 over its optimizer's ResNet-18 tuned lr (the peak
  its runs take from configs/best_lr/): the same fraction of the weights a step for every
  arm. A retuned lr fails here until sweeps/arms.py follows it."""
  best = yaml.safe_load((ROOT / "configs" / "best_lr" / "cifar10_resnet18_30ep.yaml").read_text())
  recipe = {name: spec for name, spec in ARMS.items() if name.endswith("_recipe")}
  assert len(recipe) == 5
  for name, spec in recipe.items():
    settings = dict(spec.settings)
    assert settings["weight_decay_mode"] == "decoupled"
    lr = best[spec.optimizer]["lr"]
    assert settings["weight_decay"] * lr == pytest.approx(5e-5, rel=1e-2), name


def test_the_recipe_table_compares_each_optimizer_with_its_constant_lr_runs(tmp_path):
  """Adam: three constant-lr seeds (Table 1) and three recipe seeds 1 point higher, Muon: the
  reverse order of means with a recipe seed short. The table gives each protocol's ranks, the
  recipe − constant difference with its Welch interval, the family's simultaneous interval and
  the Holm reading over the table's optimizers; a recipe run never fills a Table 1 cell."""
  from test_results_tables import image, make_run

  from results import recipe
  from results.paper_tables import build_table1
  from results.runs import collect_runs

  root = tmp_path / "multirun"
  decay = {"schedule": "warmup_cosine", "warmup_epochs": 2.0, "weight_decay": 0.05}
  muon = {"optimizer": "muon", "lr": 0.01}
  for seed, (adam, muon_acc) in enumerate(((80.0, 81.0), (80.2, 81.1), (80.1, 80.9))):
    make_run(root, f"t1/adam/{seed}", {"seed": seed}, **image(adam, 1, 1, 1, 1))
    make_run(root, f"t1/muon/{seed}", {**muon, "seed": seed}, **image(muon_acc, 1, 1, 1, 1))
    run = {"seed": seed, "sweep": "recipe", "recipe": decay}
    make_run(root, f"r/adam/{seed}", run, **image(adam + 1.0, 1, 1, 1, 1))
    if seed < 2:
      make_run(root, f"r/muon/{seed}", {**muon, **run}, **image(muon_acc - 0.7, 1, 1, 1, 1))
  runs = collect_runs([root])
  [(name, table)] = recipe.recipe_tables(runs)
  assert name == "recipe_cifar100_200ep"
  rows = {r.label: r.cells for r in table.rows}
  assert list(rows) == ["Adam", "Muon"]
  assert rows["Adam"][:6] == ["3", "80.10 ± 0.10", "2", "3", "81.10 ± 0.10", "1"]
  assert rows["Muon"][:6] == ["3", "81.00 ± 0.10", "1", "2", "80.35 ± 0.07", "2"]
  assert rows["Adam"][6].startswith("+1.00 [") and rows["Adam"][8] == "above"
  assert rows["Muon"][6].startswith("-0.65 [") and rows["Muon"][8] in ("below", "tie")
  # the family's simultaneous interval: each of its two at 1 - 0.05 / 2
  from results import stats

  wide = stats.welch([81.0, 81.2, 81.1], [80.0, 80.2, 80.1], 1 - 0.05 / 2)
  assert rows["Adam"][7] == f"[{wide.low:+.2f}, {wide.high:+.2f}]"
  table1 = build_table1(runs, "cifar100", ["resnet18"])
  adam_cells = next(r.cells for r in table1.rows if r.label == "Adam")
  assert adam_cells[0] == "3" and adam_cells[1].startswith("80.10")


def test_the_l2_default_keeps_the_fingerprints_of_runs_made_before_the_mode():
  """A run dir made before ``weight_decay_mode`` existed resumes: the default ``l2`` is what
  it ran, so its fingerprint is the same; ``decoupled`` is another configuration."""
  base = {"name": "demo", "seed": 0, "weight_decay": 0.1, "optimizer": {"name": "adam"}}
  base |= {"model": {}, "data": {}}
  before = run_record.fingerprint(OmegaConf.create(base))
  l2 = run_record.fingerprint(OmegaConf.create({**base, "weight_decay_mode": "l2"}))
  decoupled = run_record.fingerprint(OmegaConf.create({**base, "weight_decay_mode": "decoupled"}))
  assert l2 == before and decoupled != before
