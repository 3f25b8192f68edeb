"""The sweep layer (configs/sweep/, sweeps/): what each table's multirun expands to, the lr
protocol (sweeps/best_lr.py), the GPU pool's device pinning, and one tiny end-to-end sweep."""

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from results import paper_tables, records, render, selection, tables
from sweeps import arms as sweep_arms
from sweeps import best_lr, gpu_pool
from sweeps.expand import compose_job, expand, hydra_context, job_overrides

ROOT = Path(__file__).resolve().parents[1]
TAUS = (1, 2, 4, 8, 16, 32)
ARMS = {("momentum", None), ("adam", None)} | {(o, t) for o in ("qng", "ginger") for t in TAUS}


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
  """configs/ without any tuned lr (configs/best_lr/*.yaml), so lrs are the defaults."""
  out = tmp_path_factory.mktemp("cfg") / "configs"
  shutil.copytree(ROOT / "configs", out, ignore=shutil.ignore_patterns("*.pyc"))
  for f in (out / "best_lr").glob("*.yaml"):
    f.unlink()
  return out


def test_the_arm_files_are_what_arms_writes(tmp_path):
  """configs/sweep/arm/ holds one file per line of sweeps/sweep_arms.py's ARMS, as it writes them;
  a hand edit, a missing arm or a stray file is reported."""
  assert sweep_arms.stale() == []
  assert sorted(p.stem for p in sweep_arms.ARM_DIR.glob("*.yaml")) == sorted(sweep_arms.ARMS)
  sweep_arms.write(tmp_path)
  (tmp_path / "ginger_tau4.yaml").write_text("arm: ginger_tau4\n")
  (tmp_path / "adam_tau4.yaml").write_text("arm: adam_tau4\n")
  (tmp_path / "soap.yaml").unlink()
  problems = "\n".join(sweep_arms.stale(tmp_path))
  assert "ginger_tau4.yaml" in problems and "soap.yaml" in problems
  assert "adam_tau4.yaml: no arm of ARMS" in problems


def test_an_arm_sets_its_optimizer_and_settings():
  text = sweep_arms.render("ginger_tau64", sweep_arms.arm("ginger", tau=64))
  assert text.startswith("# @package _global_\n# Sweep arm: ginger with tau = 64 (see ginger")
  assert text.endswith(
    "defaults:\n  - /optimizer@default_hparams: ginger\n  - override /optimizer: ginger\n"
    "arm: ginger_tau64\ntau: 64\n"
  )


@pytest.fixture(scope="module")
def table1(cfg_dir):
  return expand(["+sweep=table1"], cfg_dir)


@pytest.fixture(scope="module")
def table34(cfg_dir):
  return expand(["+sweep=table34"], cfg_dir)


@pytest.fixture(scope="module")
def ablation(cfg_dir):
  return expand(["+sweep=ablation"], cfg_dir)


def _default_lr(optimizer):
  return float(OmegaConf.load(ROOT / "configs" / "optimizer" / f"{optimizer}.yaml").lr)


# ----------------------------------------------------------------------------- composition


def test_layout_excludes_at_least_what_config_yaml_excludes():
  base = OmegaConf.load(ROOT / "configs" / "config.yaml")
  layout = OmegaConf.load(ROOT / "configs" / "sweep" / "common" / "layout.yaml")
  ours = set(layout.hydra.job.config.override_dirname.exclude_keys)
  assert set(base.hydra.job.config.override_dirname.exclude_keys) <= ours


def test_table1_is_14_configurations_per_model(table1):
  assert len(table1) == 28
  by_model = {}
  for job in table1:
    run = job.run
    assert run["sweep"] == "table1" and run["dataset"] == "cifar100"
    assert job.config["epochs"] == 200 and job.config["batch_size"] == 128
    by_model.setdefault(run["model"], []).append((run["optimizer"], run["tau"]))
    if run["optimizer"] in ("qng", "ginger"):
      assert run["alpha"] == 0.99  # the paper's second moment: Table 1's cells need it
    else:
      assert run["tau"] is None  # no tau sweep for Momentum / Adam
    assert run["lr"] == _default_lr(run["optimizer"])  # nothing tuned in cfg_dir
    assert job.config["lr_from"].startswith("optimizer default")
  assert sorted(by_model) == ["resnet18", "resnet50"]
  for arms in by_model.values():
    assert len(arms) == 14 and set(arms) == ARMS
  assert len({job.run_dir for job in table1}) == 28  # no two runs share a dir


def test_table2_is_14_configurations_per_setting(cfg_dir):
  overrides = job_overrides(["+sweep=table2"], cfg_dir)
  assert len(overrides) == 28
  arms = Counter(o for job in overrides for o in job if o.startswith("+sweep/arm="))
  assert len(arms) == 14 and set(arms.values()) == {2}  # each arm once per setting
  for i in (0, 1, 14, 27):  # Momentum and Adam of one setting, the ends of both
    job = compose_job(overrides[i], cfg_dir)
    assert job.run["sweep"] == "table2" and job.run["dataset"] == "xsum"
    assert job.config["grad_clip"] == 1.0 and job.config["batch_size"] == 4
    setting = "lora" if job.config["model"]["lora"] else "full"
    assert setting == ("lora" if i < 14 else "full")
    assert (job.run["optimizer"], job.run["tau"]) in ARMS


def test_tables_3_4_are_9_configurations(cfg_dir, table34):
  jobs = table34
  assert len(jobs) == 9
  assert {(j.run["alpha"], j.run["tau"]) for j in jobs} == {
    (a, t) for a in (0.9, 0.99, 0.999) for t in (2, 4, 8)
  }
  assert {(j.run["optimizer"], j.run["model"], j.run["dataset"], j.run["sweep"]) for j in jobs} == {
    ("ginger", "resnet18", "cifar100", "table34")
  }
  assert {j.run["sweep"] for j in jobs} <= set(selection.TABLE_SWEEPS["table3"])
  # +sweep=table3 and +sweep=table4 are the same runs, in the same dirs.
  for alias in ("table3", "table4"):
    jobs = job_overrides([f"+sweep={alias}"], cfg_dir)
    assert len(jobs) == 9
    assert compose_job(jobs[-1], cfg_dir).run_dir == table34[-1].run_dir


def test_ablation_is_clip_x_block(ablation):
  jobs = ablation
  assert {(j.run["rho"], j.run["block"]) for j in jobs} == {
    (1.0, "per_tensor"),
    (1.0, "global"),
    (None, "per_tensor"),
    (None, "global"),
  }
  assert len(jobs) == 4 and {j.run["tau"] for j in jobs} == {4}
  assert {j.run["sweep"] for j in jobs} == {"ablation"}
  # results/tables.py's ablation: one base (dataset, model, setting, tau, alpha), 4 variants.
  assert len({tuple(j.run[k] for k in ("dataset", "model", "tau", "alpha")) for j in jobs}) == 1


def test_lr_tune_protocol(cfg_dir):
  jobs = job_overrides(["+sweep=lr_tune"], cfg_dir)
  assert len(jobs) == 4 * 4 * 8  # experiments x optimizers x the paper's 8 lrs
  lrs = {float(o.split("=")[1]) for job in jobs for o in job if o.startswith("lr=")}
  assert lrs == set(best_lr.LR_GRID) and len(best_lr.LR_GRID) == 8
  image = compose_job(
    ["+sweep=lr_tune", "+sweep/exp=full/cifar100_resnet18", "+sweep/arm=ginger", "lr=0.05"], cfg_dir
  )
  assert image.run["sweep"] in selection.EXCLUDED_SWEEPS
  assert image.config["data"]["holdout"] == 5000  # held-out training images, not test
  assert image.run["lr"] == 0.05 and image.run["tau"] == 4  # ginger's config default tau
  smoke = compose_job(
    [
      "+sweep=lr_tune",
      "scale=smoke",
      "+sweep/exp=smoke/cifar100_resnet50",
      "+sweep/arm=qng",
      "lr=0.5",
    ],
    cfg_dir,
  )
  assert smoke.config["data"]["holdout"] == 300 and smoke.run["dataset"] == "digits"


def test_steptime_runs_time_the_cells_of_their_configuration(cfg_dir):
  """The steptime sweep's short runs (every profiled optimizer on both ResNets) have the step
  key of their Table 1 cell: only the length and the evaluation spacing differ, which leave
  the step's program as it is; no table takes them."""
  jobs = job_overrides(["+sweep=steptime"], cfg_dir)
  assert len(jobs) == 2 * 8
  for arm in ("muon", "ginger_tau8", "kfac"):
    exp = ["+sweep/exp=standin/cifar100_resnet50", f"+sweep/arm={arm}", "scale=standin"]
    short = compose_job(["+sweep=steptime", *exp], cfg_dir)
    cell = compose_job(["+sweep=table1", *exp], cfg_dir)
    assert short.config["max_steps"] == 600 and short.run["sweep"] in selection.EXCLUDED_SWEEPS
    short, cell = as_loaded(short), as_loaded(cell)
    assert short["run"]["length"] == "600steps" and cell["run"]["length"] == "30ep"
    assert selection.config_key(short) != selection.config_key(cell)
    assert selection.step_key(short) == selection.step_key(cell)


def as_loaded(job):
  """The job's run block as results.runs.load_summary reads it back: with its length and its
  settings (derived from the config)."""
  from results.runs import run_length, settings_of
  from training import run_record

  settings = json.dumps(run_record.canonical(settings_of(job.config)), sort_keys=True)
  return {"run": {**job.run, "length": run_length({"config": job.config}), "settings": settings}}


def test_qng_control_is_clipped_per_tensor_qng_with_its_own_lr(cfg_dir, tmp_path):
  tune = job_overrides(["+sweep=lr_tune", "+sweep/arm=qng_clip"], cfg_dir)
  assert len(tune) == 4 * 8  # experiments x lrs, the one arm
  jobs = expand(["+sweep=qng_control"], cfg_dir)
  assert len(jobs) == 6 and len({j.run_dir for j in jobs}) == 6
  assert sorted((j.run["tau"], j.run["seed"]) for j in jobs) == [
    (t, s) for t in (4, 8) for s in (0, 1, 2)
  ]
  for job in jobs:
    assert job.run["optimizer"] == "qng" and job.run["sweep"] == "qng_control"
    assert (job.run["rho"], job.run["block"]) == (1.0, "per_tensor")
    assert job.run["lr"] == _default_lr("qng")  # nothing tuned in cfg_dir
  own = tmp_path / "configs"
  shutil.copytree(cfg_dir, own)
  (own / "best_lr" / "cifar100_resnet18.yaml").write_text(
    "qng: {lr: 0.1}\nqng_clipped: {lr: 0.002, source: test}\n"
  )
  job = compose_job(
    ["+sweep=qng_control", "+sweep/exp=full/cifar100_resnet18", "+sweep/arm=qng_clip_tau8"], own
  )
  assert job.run["lr"] == 0.002  # the clipped variant's own entry, not unclipped QNG's


def test_seeds_are_a_sweep_axis(cfg_dir):
  jobs = expand(["+sweep=table34", "seed=0,1,2", "tau=4", "alpha=0.9"], cfg_dir)
  assert sorted(j.run["seed"] for j in jobs) == [0, 1, 2]
  assert len({j.run_dir for j in jobs}) == 3


def test_smoke_scale_swaps_in_embedded_data_and_tiny_models(cfg_dir, table1):
  overrides = job_overrides(["+sweep=table1", "scale=smoke"], cfg_dir)
  assert len(overrides) == 28
  full_dirs = {j.run_dir for j in table1}
  for i, experiment in ((0, "smoke_cifar100_resnet18"), (-1, "smoke_cifar100_resnet50")):
    job = compose_job(overrides[i], cfg_dir)
    assert (job.run["dataset"], job.run["model"]) == ("digits", "resnet_tiny")
    assert job.run["experiment"] == experiment and job.config["epochs"] == 2
    assert job.run_dir not in full_dirs
    assert job.run_dir.parts[:3] == ("multirun", "table1", experiment)
  xsum = compose_job(
    ["+sweep=table2", "scale=smoke", "+sweep/exp=smoke/xsum_t5_lora", "+sweep/arm=ginger_tau2"],
    cfg_dir,
  )
  assert xsum.run["dataset"] == "xsum_demo"  # never counted as an XSUM cell of Table 2
  assert xsum.config["model"]["name"] == "t5-tiny" and xsum.config["data"]["source"] == "demo"
  lora = OmegaConf.load(ROOT / "configs" / "model" / "t5_small_lora.yaml").lora
  assert xsum.config["model"]["lora"] == OmegaConf.to_container(lora)


def test_sweeps_never_share_run_dirs(cfg_dir, table1, table34, ablation):
  dirs = [j.run_dir for j in table1 + table34 + ablation]
  assert len(dirs) == len(set(dirs))
  # The experiment is part of the subdir, so an overridden hydra.sweep.dir keeps runs apart.
  moved = expand(["+sweep=table2", "+sweep/arm=adam", "hydra.sweep.dir=/elsewhere"], cfg_dir)
  assert sorted(str(j.run_dir) for j in moved) == [
    "/elsewhere/xsum_t5_full/adam,lr=0.001/seed=0",
    "/elsewhere/xsum_t5_lora/adam,lr=0.001/seed=0",
  ]
  # A single job without -m (hydra.run.dir) keeps the arm and lr in its path too.
  with hydra_context(cfg_dir) as hydra:
    single = [
      hydra.compose_config(
        "config",
        ["+sweep=table1", f"+sweep/arm={arm}", "+sweep/exp=full/cifar100_resnet18"],
        run_mode=RunMode.RUN,
        from_shell=False,
      ).hydra.run.dir
      for arm in ("adam", "ginger_tau4")
    ]
  assert single == [
    "outputs/table1/cifar100_resnet18/adam,lr=0.001/default",
    "outputs/table1/cifar100_resnet18/ginger_tau4,lr=0.0002/default",
  ]


def test_cartesian_is_the_basic_sweepers(cfg_dir):
  from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
  from hydra.core.override_parser.overrides_parser import OverridesParser

  from sweeps.expand import cartesian

  lines = ["tau=1,2", "seed=0", "alpha=0.9,0.99,0.999", "tau=4,8", "+x=a,b"]
  parsed = OverridesParser.create().parse_overrides(lines)
  assert cartesian(parsed) == BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def test_job_run_is_the_run_record_identity(cfg_dir, table1):
  """sweeps and train.py write and read one "run" block (training/run_record.py)."""
  from training import run_record

  ginger = next(j for j in table1 if j.run["optimizer"] == "ginger")
  assert ginger.run == run_record.identity(ginger.config)
  assert ginger.run["gamma"] == ginger.config["gamma"] and ginger.run["fisher"] == "sampled"
  assert ginger.run["setting"] is None  # no fine-tuning setting for a ResNet
  adam = next(j for j in table1 if j.run["optimizer"] == "adam")
  assert adam.run["gamma"] is None and adam.run["fisher"] is None
  lora = compose_job(
    ["+sweep=table2", "+sweep/exp=full/xsum_t5_lora", "+sweep/arm=ginger_tau4"], cfg_dir
  )
  assert lora.run["setting"] == "lora"


# ----------------------------------------------------------------------------- best lr


def _summary(
  root,
  name,
  *,
  experiment,
  optimizer,
  lr,
  seed=0,
  sweep="lr_tune",
  status="completed",
  family="resnet",
  holdout=5000,
  rho=None,
  **metrics,
):
  run_dir = root / name
  run_dir.mkdir(parents=True)
  summary = {
    "run": {
      "experiment": experiment,
      "optimizer": optimizer,
      "lr": lr,
      "seed": seed,
      "sweep": sweep,
      "tau": None,
      "alpha": None,
      "model": "m",
      "dataset": "d",
      "rho": rho,
    },
    "config": {"model": {"family": family}, "data": {"holdout": holdout}},
    "status": status,
    **metrics,
  }
  (run_dir / "summary.json").write_text(json.dumps(summary))


def test_best_lr_picks_writes_and_falls_back(tmp_path, cfg_dir, capsys):
  runs = tmp_path / "runs"
  c18 = dict(experiment="cifar100_resnet18")
  for seed, (a, b) in enumerate([(50.0, 60.0), (52.0, 58.0)]):
    _summary(
      runs, f"adam01-{seed}", optimizer="adam", lr=0.01, seed=seed, best_val_accuracy=a, **c18
    )
    _summary(
      runs, f"adam001-{seed}", optimizer="adam", lr=0.001, seed=seed, best_val_accuracy=b, **c18
    )
  _summary(runs, "adam05", optimizer="adam", lr=0.5, status="failed", **c18)
  _summary(
    runs, "adam-test-split", optimizer="adam", lr=0.1, holdout=0, best_val_accuracy=99.0, **c18
  )
  _summary(
    runs, "adam-table1", optimizer="adam", lr=0.05, sweep="table1", best_val_accuracy=99.0, **c18
  )
  _summary(runs, "ginger-ok", optimizer="ginger", lr=0.0005, rho=1.0, best_val_accuracy=70.0, **c18)
  _summary(
    runs, "ginger-unstable-0", optimizer="ginger", lr=0.005, rho=1.0, best_val_accuracy=71.0, **c18
  )
  _summary(
    runs, "ginger-unstable-1", optimizer="ginger", lr=0.005, rho=1.0, seed=1, status="failed", **c18
  )
  lora = dict(experiment="xsum_t5_lora", family="t5", holdout=0)
  _summary(runs, "qng-a", optimizer="qng", lr=0.01, rougeL=20.0, val_loss=2.0, **lora)
  _summary(runs, "qng-b", optimizer="qng", lr=0.001, rougeL=25.0, val_loss=2.5, **lora)
  full = dict(experiment="xsum_t5_full", family="t5", holdout=0)
  _summary(runs, "adam-x1", optimizer="adam", lr=0.001, val_loss=3.0, **full)
  _summary(runs, "adam-x2", optimizer="adam", lr=0.0001, val_loss=2.5, **full)

  out = cfg_dir / "best_lr"
  assert best_lr.main([str(runs), "--out", str(out), "--config-dir", str(cfg_dir)]) == 0
  printed = capsys.readouterr().out
  c18_file = OmegaConf.load(out / "cifar100_resnet18.yaml")
  assert c18_file.adam.lr == 0.001 and c18_file.adam.score == pytest.approx(59.0)
  assert c18_file.adam.metric == "best_val_accuracy"
  assert {c.lr: c.diverged for c in c18_file.adam.candidates}[0.5] == 1
  assert c18_file.ginger.lr == 0.0005  # 0.005 scored higher once but diverged on seed 1
  assert "momentum" not in c18_file and "qng" not in c18_file
  assert OmegaConf.load(out / "xsum_t5_lora.yaml").qng.lr == 0.001  # highest ROUGE-L
  assert OmegaConf.load(out / "xsum_t5_full.yaml").adam.lr == 0.0001  # lowest val loss
  assert "test split" in printed
  assert "cifar100_resnet18 momentum: no finished lr_tune run -> the default lr 0.1" in printed

  try:  # the table sweeps read the file; optimizers without an entry keep their default
    adam = compose_job(
      ["+sweep=table1", "+sweep/exp=full/cifar100_resnet18", "+sweep/arm=adam"], cfg_dir
    )
    assert adam.run["lr"] == 0.001 and adam.config["lr_from"].startswith("lr_tune")
    assert "lr=0.001" in str(adam.run_dir)
    momentum = compose_job(
      ["+sweep=table1", "+sweep/exp=full/cifar100_resnet18", "+sweep/arm=momentum"], cfg_dir
    )
    assert momentum.run["lr"] == 0.1
    assert momentum.config["lr_from"] == "optimizer default (no lr_tune result)"
    smoke = compose_job(
      ["+sweep=table1", "scale=smoke", "+sweep/exp=smoke/cifar100_resnet18", "+sweep/arm=adam"],
      cfg_dir,
    )
    assert smoke.run["lr"] == _default_lr("adam")  # smoke runs have their own best_lr

    # Runs gone: earlier results are kept (and said so), never dropped silently.
    shutil.rmtree(runs / "ginger-ok")
    best_lr.main([str(runs), "--out", str(out), "--config-dir", str(cfg_dir)])
    assert OmegaConf.load(out / "cifar100_resnet18.yaml").ginger.lr == 0.0005
    assert "ginger: lr 0.0005 kept from" in capsys.readouterr().out
  finally:
    for f in out.glob("*.yaml"):
      f.unlink()


def test_unclipped_ginger_gets_its_own_tuned_lr(tmp_path, cfg_dir, capsys):
  """Unclipped Ginger (rho=null) steps ~lr/gamma along directions outside span U, a scale
  ~1e5 away from the clipped update's (at most lr per entry): its lr_tune runs make their own
  entry, ginger_unclipped, which the ablation's rho=null arms read; they never average into the
  clipped ginger entry that Tables 1-4 read."""
  runs = tmp_path / "runs"
  c18 = dict(experiment="cifar100_resnet18")
  _summary(runs, "g-clip-a", optimizer="ginger", lr=5e-4, rho=1.0, best_val_accuracy=80.0, **c18)
  _summary(runs, "g-clip-b", optimizer="ginger", lr=1e-4, rho=1.0, best_val_accuracy=79.0, **c18)
  _summary(runs, "g-free-a", optimizer="ginger", lr=1e-4, rho=None, best_val_accuracy=85.0, **c18)
  _summary(runs, "g-free-b", optimizer="ginger", lr=5e-7, rho=None, best_val_accuracy=82.0, **c18)
  _summary(runs, "g-free-c", optimizer="ginger", lr=5e-4, rho=None, status="failed", **c18)
  out = cfg_dir / "best_lr"
  try:
    assert best_lr.main([str(runs), "--out", str(out), "--config-dir", str(cfg_dir)]) == 0
    assert "cifar100_resnet18 ginger_unclipped: lr 0.0001" in capsys.readouterr().out
    tuned = OmegaConf.load(out / "cifar100_resnet18.yaml")
    assert tuned.ginger.lr == 0.0005 and len(tuned.ginger.candidates) == 2
    assert tuned.ginger_unclipped.lr == 0.0001 and len(tuned.ginger_unclipped.candidates) == 3
    jobs = expand(["+sweep=ablation", "+sweep/exp=full/cifar100_resnet18"], cfg_dir)
    lrs = {(j.run["rho"], j.run["block"]): j.run["lr"] for j in jobs}
    assert lrs == {
      (1.0, "per_tensor"): 0.0005,
      (1.0, "global"): 0.0005,
      (None, "per_tensor"): 0.0001,
      (None, "global"): 0.0001,
    }
    unclipped = next(j for j in jobs if j.run["rho"] is None)
    assert unclipped.config["lr_from"] == tuned.ginger_unclipped.source
  finally:
    for f in out.glob("*.yaml"):
      f.unlink()


def test_unclipped_ginger_without_its_own_tuning_runs_at_the_default_lr(ablation):
  """No ginger_unclipped entry: the optimizer config's lr, said so in lr_from (not the clipped
  variant's tuned lr, which is a different scale)."""
  for job in (j for j in ablation if j.run["rho"] is None):
    assert job.run["lr"] == _default_lr("ginger")
    assert job.config["lr_from"] == "optimizer default (no lr_tune result)"


# ----------------------------------------------------------------------------- GPU pool

FAKE = """
import json, os, sys, time
start = time.time()
time.sleep(0.2)
record = {"device": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time(),
          "args": sys.argv[1:], "shared": os.environ.get("GINGER_DEVICE_SHARED"),
          "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps(record) + "\\n")
sys.exit(1 if any("fail" in a for a in sys.argv[1:]) else 0)
"""


def _records(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _most_at_once(records, device=None):
  """The most jobs that ran at the same time (on ``device``; None: on any)."""
  mine = [r for r in records if device is None or r["device"] == device]
  events = sorted([(r["start"], 1) for r in mine] + [(r["end"], -1) for r in mine])
  return max(sum(d for _, d in events[: i + 1]) for i in range(len(events)))


def _assert_no_shared_device(records):
  for device in {r["device"] for r in records}:
    assert _most_at_once(records, device) == 1, (device, records)


def test_gpu_pool_pins_distinct_devices(tmp_path, monkeypatch):
  fake = tmp_path / "fake.py"
  fake.write_text(FAKE)
  record = tmp_path / "record.jsonl"
  monkeypatch.setenv("FAKE_RECORD", str(record))
  commands = [[sys.executable, str(fake), f"job{i}"] for i in range(7)]
  codes = gpu_pool.run_pool(commands, ["0", "1", "2"], cwd=tmp_path)
  assert codes == [0] * 7
  records = _records(record)
  assert sorted(r["args"][0] for r in records) == sorted(f"job{i}" for i in range(7))
  assert {r["device"] for r in records} == {"0", "1", "2"}
  _assert_no_shared_device(records)
  assert 2 <= _most_at_once(records) <= 3  # really in parallel, never more jobs than devices
  with pytest.raises(ValueError, match="distinct"):
    gpu_pool.run_pool(commands, ["0", "0"])


def test_gpu_pool_shares_a_device_only_when_asked(tmp_path, monkeypatch):
  """``jobs_per_device=2``: at most two jobs on a device at once, spread over the devices,
  each told it shares its device (GINGER_DEVICE_SHARED=1: the run record keeps its times out
  of the tables) and not to preallocate the device's memory; one job per device says neither."""
  fake = tmp_path / "fake.py"
  fake.write_text(FAKE.replace("time.sleep(0.2)", "time.sleep(0.5)"))
  record = tmp_path / "record.jsonl"
  monkeypatch.setenv("FAKE_RECORD", str(record))
  monkeypatch.delenv("GINGER_DEVICE_SHARED", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  commands = [[sys.executable, str(fake), f"job{i}"] for i in range(8)]
  codes = gpu_pool.run_pool(commands, ["0", "1"], cwd=tmp_path, jobs_per_device=2)
  assert codes == [0] * 8
  records = _records(record)
  assert {r["device"] for r in records} == {"0", "1"}
  assert {_most_at_once(records, "0"), _most_at_once(records, "1")} == {2}
  assert {(r["shared"], r["preallocate"]) for r in records} == {("1", "false")}

  record.unlink()
  assert gpu_pool.run_pool(commands[:2], ["0"], cwd=tmp_path) == [0, 0]
  records = _records(record)
  assert _most_at_once(records, "0") == 1
  assert {(r["shared"], r["preallocate"]) for r in records} == {(None, None)}
  with pytest.raises(ValueError, match="jobs_per_device must be at least 1, got 0"):
    gpu_pool.run_pool(commands, ["0"], jobs_per_device=0)


def test_gpu_pool_refuses_a_bad_jobs_per_device(capsys):
  with pytest.raises(SystemExit) as e:
    gpu_pool.main(["--jobs-per-device", "0", "--dry-run", "--", "+sweep=table1"])
  assert e.value.code == 2
  assert "--jobs-per-device must be at least 1, got 0" in capsys.readouterr().err


def test_gpu_pool_runs_a_sweep(tmp_path, cfg_dir, monkeypatch, capsys):
  fake = tmp_path / "fake.py"
  fake.write_text(FAKE)
  record = tmp_path / "record.jsonl"
  monkeypatch.setenv("FAKE_RECORD", str(record))
  monkeypatch.setattr(gpu_pool, "expand", lambda overrides: expand(overrides, cfg_dir))
  overrides = ["+sweep=table34", "scale=smoke", f"hydra.sweep.dir={tmp_path / 'mr'}"]
  jobs = expand(overrides, cfg_dir)
  done = jobs[0]  # a completed run of the same config is skipped
  done.run_dir.mkdir(parents=True)
  (done.run_dir / "summary.json").write_text(
    json.dumps({"status": "completed", "config": done.config})
  )
  argv = ["--devices", "3,5", "--command", f"{sys.executable} {fake}", "--", *overrides]
  assert gpu_pool.main(argv) == 0
  assert "9 jobs, 1 already completed" in capsys.readouterr().out
  records = _records(record)
  assert sorted(tuple(r["args"]) for r in records) == sorted(j.overrides for j in jobs[1:])
  assert {r["device"] for r in records} == {"3", "5"}
  _assert_no_shared_device(records)
  assert all((j.run_dir / "train.log").exists() for j in jobs[1:])

  # A failing job makes the pool fail; a diverged one (summary status "failed") does not.
  assert (
    gpu_pool.main([*argv[:4], "--rerun", "--", *overrides, "tau=2", "alpha=0.9", "+fail=1"]) == 1
  )
  (done.run_dir / "summary.json").write_text(
    json.dumps({"status": "failed", "config": done.config})
  )
  assert gpu_pool.diverged_run(done)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow  # 2 train.py processes (~2 min); pool and tables have fast tests
def test_smoke_sweep_end_to_end_gives_table_rows(tmp_path, capsys):
  """Two Table 3/4 runs at scale=smoke, each `python train.py -m <job>` (so train.train under
  Hydra's own multirun) in the GPU pool, two at a time on the CPU; then results.tables."""
  overrides = [
    "+sweep=table34",
    "scale=smoke",
    "tau=2",
    "alpha=0.9,0.99",
    "max_steps=2",
    "eval_every=2",
    "log_every=1",
    "checkpoint_every=2",
    "spectrum_every=0",
    f"hydra.sweep.dir={tmp_path}",
  ]
  jobs = expand(overrides)  # the repo's configs/, which the train.py children read too
  assert len(jobs) == 2
  assert gpu_pool.main(["--devices", "0,1", "--", *overrides]) == 0, capsys.readouterr().out
  runs = tables.collect_runs([tmp_path])
  assert sorted(Path(r["path"]) for r in runs) == sorted(j.run_dir for j in jobs)
  for run, job in zip(
    sorted(runs, key=lambda r: r["path"]), sorted(jobs, key=lambda j: str(j.run_dir))
  ):
    assert run["status"] == "completed" and run["steps"] == 2
    assert run["config"] == job.config  # Hydra composed what sweeps.expand predicted
    assert tables.rfield(run, "sweep") == "table34"
    assert (tables.rfield(run, "dataset"), tables.rfield(run, "model")) == ("digits", "resnet_tiny")
  # The cell a Table 3 would take for alpha 0.9, tau 2 (at the smoke stand-ins) ...
  cell = selection.select_runs(
    runs,
    {"dataset": "digits", "model": "resnet_tiny", "optimizer": "ginger", "tau": 2, "alpha": 0.9},
    selection.TABLE_SWEEPS["table3"],
  )
  assert len(cell.runs) == 1 and cell.note is None
  # ... and a rendered partial table: Table 1's Ginger (tau=2) row from the alpha=0.99 run.
  table = paper_tables.build_table1(runs, dataset="digits", models=("resnet_tiny",))
  row = next(r for r in table.rows if r.label == "Ginger (τ=2)")
  assert row.cells[0] == "1" and row.cells[1]  # n = 1 and an accuracy
  assert all(r.cells[0] == "" for r in table.rows if r.label != "Ginger (τ=2)")
  assert "Ginger (τ=2) | 1 |" in render.to_markdown(table)


def test_best_lr_skips_tuning_runs_in_narrow_numerics(tmp_path, cfg_dir, capsys):
  """An lr_tune run with a bf16 state or bf16 compute is another setting: it never picks the
  lr the float32 tables run at (it is skipped, and the output says so)."""
  runs = tmp_path / "runs"
  c18 = dict(experiment="cifar100_resnet18", rho=1.0)
  _summary(runs, "f32", optimizer="ginger", lr=0.0005, best_val_accuracy=70.0, **c18)
  _summary(runs, "bf16", optimizer="ginger", lr=0.005, best_val_accuracy=75.0, **c18)
  summary = json.loads((runs / "bf16" / "summary.json").read_text())
  summary["run"]["state_dtype"] = "bfloat16"
  (runs / "bf16" / "summary.json").write_text(json.dumps(summary))
  out = cfg_dir / "best_lr"
  try:
    assert best_lr.main([str(runs), "--out", str(out), "--config-dir", str(cfg_dir)]) == 0
    assert OmegaConf.load(out / "cifar100_resnet18.yaml").ginger.lr == 0.0005
    assert "state_dtype=bfloat16 (the tuned lr is the float32 runs')" in capsys.readouterr().out
  finally:
    for f in out.glob("*.yaml"):
      f.unlink()


def test_best_lr_refuses_a_missing_root(tmp_path: Path, capsys) -> None:
  """A root named on the command line that does not exist would read as "no lr_tune runs" and
  fall back to the default lrs: refused instead."""
  out = tmp_path / "best"
  assert best_lr.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
  assert "no such run root(s)" in capsys.readouterr().err and not out.exists()


def test_best_lr_reads_archived_lr_tune_runs(tmp_path: Path) -> None:
  """lr_tune runs packed into an archive (results/records.py) pick what their run dirs pick,
  diverged and newer reruns included."""
  runs = tmp_path / "runs" / "lr_tune"
  c18 = dict(experiment="cifar100_resnet18")
  for lr, accuracy in ((0.01, 50.0), (0.001, 60.0)):
    for seed in (0, 1):
      name = f"cifar100_resnet18/adam,lr={lr}/seed={seed}"
      _summary(runs, name, optimizer="adam", lr=lr, seed=seed, best_val_accuracy=accuracy, **c18)
  _summary(
    runs, "cifar100_resnet18/adam,lr=0.5/seed=0", optimizer="adam", lr=0.5, status="failed", **c18
  )
  plain = best_lr.best_lrs(tables.collect_runs([tmp_path / "runs"]))
  assert plain["cifar100_resnet18"]["adam"]["lr"] == 0.001
  archive = runs / ("cifar100_resnet18" + records.SUFFIX)
  records.add(archive, tables.find_run_dirs([runs]))
  shutil.rmtree(runs / "cifar100_resnet18")
  assert best_lr.best_lrs(tables.collect_runs([tmp_path / "runs"])) == plain


def test_best_lr_of_the_committed_lr_tune_runs_is_the_committed_file(tmp_path: Path) -> None:
  """configs/best_lr/cifar10_resnet18_30ep.yaml is what the committed lr_tune archive gives."""
  committed = ROOT / "results" / "cifar10" / "runs" / "lr_tune"
  assert best_lr.main([str(committed), "--out", str(tmp_path)]) == 0
  name = "cifar10_resnet18_30ep.yaml"
  assert (tmp_path / name).read_text() == (ROOT / "configs" / "best_lr" / name).read_text()


def _make_sweep(*args: str) -> list[str]:
  """The overrides ``make -n <args>`` hands the GPU pool in its first sweep command."""
  import shlex
  import subprocess

  done = subprocess.run(
    ["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
  )
  line = next(ln for ln in done.stdout.splitlines() if "sweeps.gpu_pool" in ln)
  words = shlex.split(line)
  return words[words.index("--") + 1 :]


def test_make_lr_tune_at_the_stand_in_scale_tunes_both_resnets_or_the_one_named():
  """Each stand-in ResNet runs at lrs tuned on itself (configs/sweep/exp/standin/): make
  lr_tune SCALE=standin tunes both, LR_TUNE_EXP names one; every job composes."""
  both = {job.config["name"] for job in expand(_make_sweep("lr_tune", "SCALE=standin"))}
  assert both == {"cifar10_resnet18_30ep", "cifar10_resnet50_30ep"}
  one = expand(_make_sweep("lr_tune", "SCALE=standin", "LR_TUNE_EXP=standin/cifar100_resnet50"))
  assert {job.config["name"] for job in one} == {"cifar10_resnet50_30ep"}
  assert len(one) == 4 * 8  # the paper's four optimizers x its eight lrs


def test_the_campaign_phases_of_the_tuning_and_todays_optimizers_compose():
  """sweeps/standin_campaign.sh's lr_tune, newcomers and steptime phases, with `echo` standing
  in for python: every pool command they give composes, each ResNet tuned on itself and the
  newcomers' ResNet-50 runs at that model's tuned lrs."""
  import os
  import shlex
  import subprocess

  done = subprocess.run(
    ["bash", "sweeps/standin_campaign.sh", "lr_tune", "newcomers", "steptime"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "PY": "echo", "SEEDS": "0,1"},
    check=True,
    timeout=60,
  ).stdout
  commands = [shlex.split(ln) for ln in done.splitlines() if "sweeps.gpu_pool" in ln]
  assert len(commands) == 7
  jobs = [expand(words[words.index("--") + 1 :]) for words in commands]
  tune_both, ginger_edge, tune_new18, tune_new50, table18, table50, steptime = jobs
  names = lambda js: {j.config["name"] for j in js}  # noqa: E731
  assert names(tune_both) == {"cifar10_resnet18_30ep", "cifar10_resnet50_30ep"}
  assert {j.run["lr"] for j in ginger_edge} == {5e-5, 1e-5}
  assert {j.run["optimizer"] for j in tune_new18} == {"kfac", "soap", "muon", "schedule_free_adamw"}
  assert names(tune_new50) == {"cifar10_resnet50_30ep"} and len(tune_new50) == 2 * 8
  assert len(table18) == 4 * 2 and {j.run["sweep"] for j in table18} == {"table1"}
  assert names(table50) == {"cifar10_resnet50_30ep"} and len(table50) == 2 * 2
  assert {j.run["sweep"] for j in steptime} == {"steptime"}
