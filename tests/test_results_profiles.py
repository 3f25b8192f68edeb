"""AlgoPerf's performance profiles (results/profiles.py): the ratios, the profile and the score
against hand-worked cases and the score's definition as an integral, and the profile of the
committed runs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from results import profiles
from results.runs import collect_runs

COMMITTED = Path(__file__).resolve().parents[1] / "results" / "cifar10" / "runs"
INF = math.inf


def test_ratios_and_scores_by_hand():
  """Two workloads: a fastest on one and 5x the fastest (past r_max = 4: unscored) on the
  other; b 2x then fastest; c misses one and is 4.5x on the other."""
  times = {"w1": {"a": 10.0, "b": 20.0, "c": INF}, "w2": {"a": 50.0, "b": 10.0, "c": 45.0}}
  ratios = profiles.performance_ratios(times)
  assert ratios == {
    "a": {"w1": 1.0, "w2": INF},
    "b": {"w1": 2.0, "w2": 1.0},
    "c": {"w1": INF, "w2": INF},
  }
  assert profiles.score(ratios["a"]) == pytest.approx(0.5)  # (4 - 1) / 3 on one of two
  assert profiles.score(ratios["b"]) == pytest.approx((2 / 3 + 1) / 2)
  assert profiles.score(ratios["c"]) == 0.0
  xs = np.array([1.0, 1.5, 2.0, 4.0])
  np.testing.assert_array_equal(profiles.profile(ratios["b"], xs), [0.5, 0.5, 1.0, 1.0])


def test_a_workload_nobody_reaches_scores_nobody():
  ratios = profiles.performance_ratios({"w": {"a": INF, "b": INF}})
  assert ratios == {"a": {"w": INF}, "b": {"w": INF}}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(1.0, 6.0), st.just(INF)), min_size=1, max_size=6))
def test_score_is_the_profiles_area(ratios):
  """B = integral over [1, r_max] of the profile P / (r_max - 1): the step function's area,
  within the grid's resolution (each workload's step moves the area by at most one cell)."""
  r = {f"w{i}": (x if x <= profiles.R_MAX else INF) for i, x in enumerate(ratios)}
  xs = np.linspace(1.0, profiles.R_MAX, 30_001)
  p = profiles.profile(r, xs)
  area = float(np.sum(p[:-1] * np.diff(xs))) / (profiles.R_MAX - 1.0)
  assert profiles.score(r) == pytest.approx(area, abs=2 * (xs[1] - xs[0]))


@pytest.fixture(scope="module")
def committed():
  return collect_runs([COMMITTED])


def test_profile_of_the_committed_runs(tmp_path, committed):
  """ResNet-18 at 85 % and the T5 stand-in at a validation loss of 6: every optimizer with a
  run alone on its GPU gets a time (from the step-time sweep's runs alone), the fastest a ratio
  of 1 (schedule-free AdamW on both), K-FAC, which cannot run T5, a miss there; ResNet-50, where
  SOAP and K-FAC have no runs, is named in the notes and enters the second profile of the six
  optimizers timed on all three workloads."""
  written = profiles.write_profiles(committed, "cifar10", "30ep", tmp_path)
  md = (tmp_path / "profile_cifar10_30ep.md").read_text()
  assert written[0].name == "profile_cifar10_30ep.md" and written[1].suffix == ".png"
  # the workloads every optimizer is timed on
  assert "### Targets: 85 % (ResNet-18), validation loss 6 (T5 stand-in)" in md
  assert "| SF-AdamW | 13 | 1.00 | 0.8 | 1.00 | 1.00 |" in md
  assert "| Adam | 26 | 2.06 | 0.8 | 1.06 | 0.81 |" in md
  assert "| K-FAC | 115 | ∞ | not reached | ∞ | 0.00 |" in md
  assert "- T5 stand-in: evaluated every 45 steps, the resolution of its times." in md
  # every step time comes from one step-time sweep per workload at one commit: no commit note
  assert "step times alone from runs at different commits" not in md
  assert "- ResNet-50, no time for: SOAP (no runs); K-FAC (no runs)." in md
  assert "- ResNet-18: evaluated every 390 steps, the resolution of its times." in md
  # the second profile: the optimizers timed on every workload, ResNet-50 among them
  assert (
    "### Targets: 85 % (ResNet-18, ResNet-50), validation loss 6 (T5 stand-in), 3 workloads" in md
  )
  assert "| SF-AdamW | 13 | 1.00 | 49 | 1.00 | 0.8 | 1.00 | 1.00 |" in md


def test_a_workload_missing_one_optimizer_is_left_out_not_the_optimizer():
  """The profile keeps the optimizers timed on the first workload and drops a workload where
  one of them has no time (T5 before the newer optimizers ran there), not the optimizer; an
  optimizer timed elsewhere only is not in it."""
  times = {
    "ResNet-18": {"adam": 10.0, "muon": 5.0},
    "ResNet-50": {"adam": 20.0, "muon": 30.0, "soap": 1.0},
    "T5": {"adam": 3.0},
  }
  assert profiles.complete(times) == {
    "ResNet-18": {"adam": 10.0, "muon": 5.0},
    "ResNet-50": {"adam": 20.0, "muon": 30.0},
  }
  assert profiles.complete({"ResNet-18": {}, "T5": {"adam": 3.0}}) == {}


def test_a_workload_only_some_ran_enters_a_second_profile_of_those_timed_everywhere():
  """ResNet-50 run by the paper's arms and two newer optimizers only: the first profile leaves
  it out; the second keeps every workload with times and the optimizers timed on each (an
  optimizer that cannot run a workload is timed there, at inf), its ratios to the fastest among
  them. Fewer than two such optimizers give no second profile."""
  times = {
    "ResNet-18": {"adam": 10.0, "muon": 5.0, "soap": 4.0, "kfac": 40.0},
    "ResNet-50": {"adam": 20.0, "muon": 30.0},
    "T5": {"adam": 3.0, "muon": 2.0, "soap": 1.0, "kfac": INF},
  }
  assert list(profiles.complete(times)) == ["ResNet-18", "T5"]
  wide = profiles.everywhere(times)
  assert wide == {
    "ResNet-18": {"adam": 10.0, "muon": 5.0},
    "ResNet-50": {"adam": 20.0, "muon": 30.0},
    "T5": {"adam": 3.0, "muon": 2.0},
  }
  assert profiles.performance_ratios(wide)["adam"] == {
    "ResNet-18": 2.0,
    "ResNet-50": 1.0,
    "T5": 1.5,
  }
  assert profiles.everywhere({**times, "ResNet-50": {"adam": 20.0}}) == {}
  assert profiles.everywhere({"ResNet-18": {}, "T5": {}}) == {}
  with_empty = {**times, "ResNet-50": {}}  # a workload without times (T5 at mixed spacings)
  assert list(profiles.everywhere(with_empty)) == ["ResNet-18", "T5"]


def test_the_written_profiles_add_the_second_profile_where_a_workload_is_left_out(
  tmp_path, monkeypatch
):
  """write_profiles: the first profile's tables per level, then the second's over every
  workload, with its note naming its optimizers; the plot has a panel for each (four)."""
  r18 = {"Adam": 26.0, "Muon": 15.0, "SOAP": 33.0, "K-FAC": 124.0}
  r50 = {"Adam": 80.0, "Muon": 60.0}
  timing = profiles.Timing(
    [{"ResNet-18": r18, "ResNet-50": r50, "T5 stand-in": {}} for _ in profiles.TARGETS],
    {"ResNet-50": ["SOAP (no runs)", "K-FAC (no runs)"]},
    {
      "ResNet-18": {n: (390,) for n in r18},
      "ResNet-50": {n: (390,) for n in r50},
      "T5 stand-in": {},
    },
    {
      "ResNet-18": dict.fromkeys(r18, "NVIDIA H200"),
      "ResNet-50": dict.fromkeys(r50, "NVIDIA H200"),
      "T5 stand-in": {},
    },
    {
      "ResNet-18": dict.fromkeys(r18, "64d18e614a"),
      "ResNet-50": dict.fromkeys(r50, "64d18e614a"),
      "T5 stand-in": {},
    },
  )
  monkeypatch.setattr(profiles, "workload_times", lambda *args: timing)
  written = profiles.write_profiles([], "cifar10", "30ep", tmp_path)
  md = written[0].read_text()
  assert "### Targets: 85 % (ResNet-18)\n" in md and "### Targets: 88 % (ResNet-18)\n" in md
  assert "### Targets: 85 % (ResNet-18, ResNet-50), 2 workloads\n" in md
  assert "| Muon | 15 | 1.00 | 60 | 1.00 | 1.00 |" in md
  assert "- Left out of the first profiles (not every optimizer timed on ResNet-18 is timed" in md
  assert "- Over 2 workloads (ResNet-18, ResNet-50): the optimizers timed on each of them, " in md
  assert "Adam, Muon; each ratio to the fastest among them." in md
  assert "- ResNet-50: evaluated every 390 steps, the resolution of its times." in md
  assert "different commits" not in md  # every step time from runs at one commit
  import matplotlib.image

  height, width = matplotlib.image.imread(written[1]).shape[:2]
  # two rows of two 5.5 x 4 inch panels and a 1.6 inch legend at 110 dpi
  assert (width, height) == (1386, 880)


def test_the_t5_workload_times_its_validation_loss_down_to_the_target(committed):
  """T5's targets are on the validation loss, lower is better: the profiled arms' committed
  seeds 0, 1 and 3 evaluate every 45 steps (Adam's and Ginger tau 8's seed 2 once an epoch, 225
  steps, a configuration of its own that the cell leaves out); Adam reaches 6.0 at step 90 and
  4.5 at step 315 on every seed, Ginger tau 8 6.0 at step 360-405 and 4.5 never."""
  t5 = profiles.workloads("cifar10", "30ep")[-1]
  assert (t5.name, t5.metric, t5.targets, t5.lower_is_better) == (
    "T5 stand-in",
    "val_loss",
    (6.0, 4.5),
    True,
  )
  from results import selection

  def cell(optimizer, tau=None):
    criteria = selection.cell_criteria(optimizer, tau, **t5.criteria)
    return selection.select_runs(committed, criteria, (t5.sweep,)).runs

  adam, ginger = cell("adam"), cell("ginger", 8)
  assert len(adam) == 3 and len(ginger) == 3
  assert [profiles.steps_to(r, 6.0, t5) for r in adam] == [90.0] * 3
  assert [profiles.steps_to(r, 4.5, t5) for r in adam] == [315.0] * 3
  assert sorted(profiles.steps_to(r, 6.0, t5) for r in ginger) == [360.0, 405.0, 405.0]
  assert all(profiles.steps_to(r, 4.5, t5) == INF for r in ginger)
  assert profiles.evaluation_spacings([profiles.eval_series(r, t5) for r in adam]) == (45,)


def test_a_configurations_step_time_is_its_newest_runs_alone(committed):
  """The step time that turns steps into seconds is the configuration's current one: the
  median of its runs alone on their GPU at the newest commit among them, from any sweep (Ginger
  tau 8's Table 1 runs alone are older code, 12 ms a step; its cold race's, 9.02 ms; the
  step-time sweep's, the newest, 8.92 ms)."""
  from results import selection
  from results.runs import rfield

  runs = committed
  protocol = {**selection.image_protocol("cifar10", "30ep"), "model": "resnet18"}
  cell = selection.table1_cell(runs, "ginger", 8, **protocol).runs
  key = selection.step_key(cell[0])
  same = [r for r in runs if selection.step_key(r) == key and not r.get("device_shared")]
  race = [r["step_time_s"] for r in same if str(r.get("git_commit")).startswith("ad3d018")]
  sweep = [r["step_time_s"] for r in same if rfield(r, "sweep") == "steptime"]
  older = [r["step_time_s"] for r in same if rfield(r, "sweep") == "table1"]
  assert len(race) == 5 and len(sweep) == 1 and older
  step = profiles.alone_step_time(cell, runs)
  assert step == pytest.approx(sweep[0]) and step != pytest.approx(float(np.median(race)))
  assert step < min(older)


def test_a_workload_an_optimizer_cannot_run_is_never_reached(committed):
  """K-FAC's entry runs ResNets only (kfac-jax does not support T5's shared weights): on the T5
  workload it counts as never reaching the target, as AlgoPerf scores a method that cannot run
  a workload, not as one still waiting for runs."""
  from results.runs import rfield

  t5 = profiles.workloads("cifar10", "30ep")[-1]
  paper_t5 = [  # T5 at one spacing and timed on one device: Adam's and Momentum's runs only
    r
    for r in committed
    if rfield(r, "sweep") != "table2" or rfield(r, "optimizer") in ("adam", "momentum")
  ]
  timing = profiles.workload_times(paper_t5, "cifar10", "30ep")
  assert profiles.comparable(timing.spacings[t5.name], timing.devices[t5.name])
  assert timing.times[0][t5.name]["K-FAC"] == INF and timing.times[0][t5.name]["Adam"] < INF
  assert not any("K-FAC" in why for why in timing.missing.get(t5.name, []))
  assert timing.times[0]["ResNet-18"]["K-FAC"] < INF  # a workload of its family is timed


def test_optimizers_evaluated_at_different_spacings_are_not_timed_against_each_other():
  """A time is the step of the first evaluation at the target: runs evaluated every 225 steps
  would be timed up to 225 steps late beside runs evaluated every 45, so such a workload gets no
  times, and the notes group its optimizers by spacing."""
  assert profiles.same_resolution({"Adam": (390,), "Muon": (390,)})
  assert profiles.same_resolution({})
  assert not profiles.same_resolution({"Adam": (225,), "Muon": (45,)})
  assert not profiles.same_resolution({"Adam": (45,), "Muon": (45, 225)})  # seeds that differ
  assert profiles.spacing_text({"Muon": (45,), "Adam": (225,), "SOAP": (45,)}) == (
    "every 45 steps: Muon, SOAP; every 225: Adam"
  )


def test_t5_runs_at_two_spacings_leave_t5_out(tmp_path, committed, monkeypatch):
  """Where the paper's arms' T5 stand-in runs evaluate once an epoch (225 steps; here their
  committed evaluations every 45 steps thinned to those) and the newer optimizers' every 45
  steps, T5 is out of the profiles, and the notes say why."""
  from results.runs import rfield

  every_45 = profiles.eval_series
  paper_arms = {"adam", "momentum", "ginger", "qng"}

  def once_an_epoch(run, workload=profiles.IMAGE):
    evals = every_45(run, workload)
    if workload.name != "T5 stand-in" or rfield(run, "optimizer") not in paper_arms:
      return evals
    kept = evals["step"] % 225 == 0
    return {key: values[kept] for key, values in evals.items()}

  monkeypatch.setattr(profiles, "eval_series", once_an_epoch)
  t5 = profiles.workloads("cifar10", "30ep")[-1]
  timing = profiles.workload_times(committed, "cifar10", "30ep")
  assert timing.spacings[t5.name]["Adam"] == (225,) and timing.spacings[t5.name]["Muon"] == (45,)
  assert all(times[t5.name] == {} for times in timing.times)
  profiles.write_profiles(committed, "cifar10", "30ep", tmp_path)
  md = (tmp_path / "profile_cifar10_30ep.md").read_text()
  assert "### Targets: 85 % (ResNet-18)\n" in md and "### Targets: 88 % (ResNet-18)\n" in md
  assert (
    "- Left out of the profiles: T5 stand-in, its optimizers evaluated at different spacings "
    "(every 45 steps: Muon, SF-AdamW, SOAP; every 225: Adam, Momentum, Ginger (τ=8), QNG (τ=8))"
  ) in md


def test_a_short_run_alone_times_its_configurations_cells(committed):
  """A configuration's step time alone may come from a short run of the step-time sweep: the
  same configuration but for its length and evaluation spacing (neither changes the step's
  program). A run of another lr times nothing else; a step-time run never fills a table cell."""
  import copy
  import json

  from results import selection
  from results.runs import rfield

  protocol = {**selection.image_protocol("cifar10", "30ep"), "model": "resnet18"}
  cell = selection.table1_cell(committed, "muon", **protocol).runs
  short = copy.deepcopy(next(r for r in cell if not r.get("device_shared")))
  settings = json.loads(short["run"]["settings"])
  settings["eval_every"] = 100
  short["run"].update(sweep="steptime", length="600steps", seed=0, settings=json.dumps(settings))
  short.update(step_time_s=1e-3, mtime=1e12, git_commit="f" * 40, path="steptime/muon")
  other_lr = copy.deepcopy(short)
  other_lr["run"]["lr"], other_lr["step_time_s"], other_lr["mtime"] = 0.5, 9.0, 2e12
  pool = [*committed, short, other_lr]
  assert profiles.alone_step_time(cell, pool) == 1e-3
  assert selection.step_key(short) == selection.step_key(cell[0])
  assert selection.step_key(other_lr) != selection.step_key(cell[0])
  assert selection.table1_cell(pool, "muon", **protocol).runs == cell
  assert rfield(short, "sweep") in selection.EXCLUDED_SWEEPS


def _on_device(run, kind):
  import copy

  out = copy.deepcopy(run)
  out["device"] = {**out.get("device", {}), "kind": kind}
  return out


def test_step_times_from_different_devices_are_not_compared(committed):
  """A time is steps times the step time alone, and an H100's step is not an H200's: a
  configuration is timed by its newest run's device only, and a workload whose optimizers were
  timed on different devices gets no times (the notes group them by device); today's
  optimizers' table gives such a row no reading against Adam, and says why."""
  from results import newcomers, selection

  protocol = {**selection.image_protocol("cifar10", "30ep"), "model": "resnet18"}
  muon = selection.table1_cell(committed, "muon", **protocol).runs
  alone = profiles.current_alone_runs(muon, committed)
  assert alone and {profiles.table_model.device_name(r) for r in alone} == {"NVIDIA H200"}
  moved = {id(r): _on_device(r, "NVIDIA H100 80GB HBM3") for r in alone}
  runs = [moved.get(id(r), r) for r in committed]

  older = {**_on_device(alone[0], "NVIDIA H100 80GB HBM3"), "mtime": 0, "path": "old/h100"}
  assert profiles.current_alone_runs(muon, [*committed, older]) == alone  # newest device only

  timing = profiles.workload_times(runs, "cifar10", "30ep")
  assert timing.devices["ResNet-18"]["Muon"] == "NVIDIA H100 80GB HBM3"
  assert timing.devices["ResNet-18"]["Adam"] == "NVIDIA H200"
  assert all(times["ResNet-18"] == {} for times in timing.times)
  assert not profiles.comparable(timing.spacings["ResNet-18"], timing.devices["ResNet-18"])
  assert profiles.grouped_text({"Adam": "H200", "Muon": "H100", "SOAP": "H200"}) == (
    "H100: Muon; H200: Adam, SOAP"
  )

  table = newcomers.build_newcomers(runs, "cifar10", "resnet18", "30ep")
  row = next(r for r in table.rows if r.label == "Muon")
  texts = dict(zip([c.header() for c in table.columns], row.cells, strict=True))
  assert texts["s to 85 %"].endswith("(9/9)") and texts["s to 85 % − Adam, Holm"] == ""
  assert (
    "Step time measured on NVIDIA H100 80GB HBM3, Adam's on NVIDIA H200: Muon's times are "
    "not compared with Adam's."
  ) in table.notes


def test_a_set_without_targets_has_no_profile(tmp_path, committed, capsys):
  """Targets are fixed per set from its baselines' runs (IMAGE_TARGETS): the paper's CIFAR-100
  at 200 epochs has none here, so no workload, no profile, and the command says why."""
  assert [w.name for w in profiles.workloads("cifar10", "30ep")] == [
    "ResNet-18",
    "ResNet-50",
    "T5 stand-in",
  ]
  assert profiles.workloads("cifar100", "200ep") == []
  assert profiles.image_workload("cifar100", "resnet18", "200ep").targets == ()
  assert profiles.write_profiles(committed, "cifar100", "200ep", tmp_path) == []
  argv = [str(COMMITTED), "--out", str(tmp_path), "--dataset", "cifar100", "--length", "200ep"]
  assert profiles.main(argv) == 0
  assert (
    "cifar100 200ep has no targets (sets with targets: cifar10 30ep)" in capsys.readouterr().out
  )
