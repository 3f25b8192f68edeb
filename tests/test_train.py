"""train.py / evaluate.py end to end on tiny shapes: every experiment config, resume,
NaN handling, clear errors, the Hydra CLI."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from fakes import cifar_pickle_folder, tiny_hf_t5_dir, xsum_jsonl
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import evaluate
import train
from data.images import DatasetUnavailableError

ROOT = Path(__file__).resolve().parents[1]
FAST = ["logger=none", "max_steps=2", "eval_every=2", "log_every=1", "checkpoint_every=2"]


def config(*overrides):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("data")
  cifar_pickle_folder(root / "c100", "cifar100")
  cifar_pickle_folder(root / "c10", "cifar10")
  xsum_jsonl(root / "xsum.jsonl")
  tiny_hf_t5_dir(root / "t5", vocab_size=1024)
  return root


def _image_overrides(data_dir, name):
  sub = "c100/cifar-100-python" if name == "cifar100" else "c10/cifar-10-batches-py"
  return [
    "model=resnet_tiny",
    "data.source=local",
    f"data.path={data_dir / sub}",
    "batch_size=8",
    "eval_batch_size=16",
  ]


def _xsum_overrides(data_dir):
  return [
    f"model.pretrained={data_dir / 't5'}",
    "data.source=local",
    f"data.path={data_dir / 'xsum.jsonl'}",
    "data.tokenizer=demo",
    "data.max_source_len=48",
    "data.max_target_len=12",
    "data.rouge_examples=4",
    "data.max_new_tokens=8",
    "batch_size=4",
    "eval_batch_size=4",
  ]


SUMMARY_KEYS = {
  "steps",
  "step_time_s",
  "flops_per_iter",
  "peak_memory_bytes",
  "min_train_loss",
  "final_train_loss",
  "run",
  "versions",
  "device",
  "git_commit",
  "status",
}


@pytest.mark.parametrize(
  "experiment, optimizer",
  [
    ("demo", "ginger"),
    ("cifar100_resnet18", "qng"),
    ("cifar100_resnet50", "momentum"),
    ("cifar10_resnet18", "adam"),
  ],
)
def test_image_experiments_smoke(tmp_path, data_dir, experiment, optimizer):
  extra = (
    []
    if experiment == "demo"
    else _image_overrides(data_dir, "cifar10" if "cifar10_" in experiment else "cifar100")
  )
  cfg = config(f"experiment={experiment}", f"optimizer={optimizer}", *FAST, *extra)
  summary = train.train(cfg, tmp_path)
  assert SUMMARY_KEYS | {"best_val_accuracy", "val_loss_at_best"} <= set(summary)
  assert summary["steps"] == 2 and summary["status"] == "completed"
  assert summary["flops_per_iter"]["analytic"] > 0
  assert summary["peak_memory_bytes"] is None  # CPU does not report it: never a fake 0
  on_disk = json.loads((tmp_path / "summary.json").read_text())
  assert on_disk["run"]["optimizer"] == optimizer
  events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert {"train", "eval"} <= {e["event"] for e in events}


@pytest.mark.parametrize("experiment", ["demo_xsum", "xsum_t5_full", "xsum_t5_lora"])
def test_seq2seq_experiments_smoke(tmp_path, data_dir, experiment):
  extra = [] if experiment == "demo_xsum" else _xsum_overrides(data_dir)
  cfg = config(f"experiment={experiment}", "optimizer=ginger", "tau=2", *FAST, *extra)
  summary = train.train(cfg, tmp_path)
  assert SUMMARY_KEYS | {"rouge1", "rouge2", "rougeL", "train_perplexity", "val_loss"} <= set(
    summary
  )
  assert summary["run"]["setting"] == ("lora" if "lora" in experiment else "full")
  if experiment == "xsum_t5_lora":
    # Only the adapters are trained: Ginger's d is the LoRA parameter count.
    assert summary["trained_parameters"] < summary["parameters"] / 4


def test_resume_is_bit_for_bit(tmp_path):
  base = [
    "experiment=demo",
    "optimizer=ginger",
    "block=global",
    "logger=none",
    "checkpoint_every=3",
    "log_every=1",
    "eval_every=3",
    "spectrum_every=2",
  ]
  straight = tmp_path / "straight"
  train.train(config(*base, "max_steps=6"), straight)
  resumed = tmp_path / "resumed"
  train.train(config(*base, "max_steps=3"), resumed)  # "killed" after step 3
  train.train(config(*base, "max_steps=6"), resumed)  # same dir: continues from step 3
  from training.checkpoints import Checkpointer

  setup = train.build(config(*base, "max_steps=6"))
  a = Checkpointer(straight).restore(setup.state, 6)
  b = Checkpointer(resumed).restore(setup.state, 6)
  for x, y in zip(
    jax.tree.leaves((a.trainable, a.rest, a.opt_state)),
    jax.tree.leaves((b.trainable, b.rest, b.opt_state)),
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  log_a = [json.loads(s) for s in (straight / "metrics.jsonl").read_text().splitlines()]
  log_b = [json.loads(s) for s in (resumed / "metrics.jsonl").read_text().splitlines()]
  assert [e["step"] for e in log_a] == [e["step"] for e in log_b]
  assert [e.get("train_loss") for e in log_a] == [e.get("train_loss") for e in log_b]


def test_nan_loss_stops_with_clear_error_and_keeps_checkpoint(tmp_path):
  cfg = config(
    "experiment=demo",
    "optimizer=momentum",
    "lr=1e12",
    "logger=none",
    "max_steps=40",
    "checkpoint_every=1",
    "log_every=1",
    "eval_every=100",
  )
  with pytest.raises(train.NonFiniteLossError, match="NaN/Inf.*last good checkpoint"):
    train.train(cfg, tmp_path)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["status"] == "failed"
  from training.checkpoints import Checkpointer

  last = Checkpointer(tmp_path).latest_step()
  state = Checkpointer(tmp_path).restore(train.build(cfg).state, last)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.trainable))


def test_evaluate_reloads_checkpoint(tmp_path):
  cfg = config("experiment=demo", "optimizer=adam", *FAST)
  summary = train.train(cfg, tmp_path)
  (tmp_path / ".hydra").mkdir()
  from omegaconf import OmegaConf

  OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
  result = evaluate.evaluate_run(tmp_path)
  assert result["step"] == 2
  last_eval = [
    json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' in s
  ][-1]
  assert result["val_accuracy"] == pytest.approx(last_eval["val_accuracy"])
  assert summary["best_val_accuracy"] >= result["val_accuracy"] - 1e-9
  assert Path(result["written_to"]).exists()


def test_evaluate_errors(tmp_path):
  with pytest.raises(evaluate.RunDirError, match="not a run dir"):
    evaluate.evaluate_run(tmp_path)
  (tmp_path / ".hydra").mkdir()
  from omegaconf import OmegaConf

  OmegaConf.save(config("experiment=demo"), tmp_path / ".hydra" / "config.yaml")
  from training.checkpoints import CheckpointError

  with pytest.raises(CheckpointError, match="no checkpoint"):
    evaluate.evaluate_run(tmp_path)


@pytest.mark.parametrize(
  "override, error, match",
  [
    ("tau=0", ValueError, "tau must be >= 1"),
    ("alpha=1.5", ValueError, "alpha must lie in the open interval"),
    ("gamma=-1", ValueError, "gamma must be a finite number > 0"),
    ("block=rows", ValueError, "block must be one of"),
    ("schedule=linear", ValueError, "schedule must be one of"),
    ("fisher_forward=both", ValueError, "fisher_forward must be"),
    ("batch_size=100000", ValueError, "larger than the training set"),
  ],
)
def test_bad_values_fail_clearly(tmp_path, override, error, match):
  with pytest.raises(error, match=match):
    train.train(config("experiment=demo", "optimizer=ginger", "logger=none", override), tmp_path)


def test_missing_data_fails_fast_with_instructions(tmp_path):
  cfg = config(
    "data=cifar100",
    "model=resnet_tiny",
    "logger=none",
    "data.source=local",
    f"data.path={tmp_path / 'nope'}",
  )
  with pytest.raises(DatasetUnavailableError, match="data.source=local"):
    train.train(cfg, tmp_path / "run")


def test_unknown_config_group_is_a_hydra_error():
  with pytest.raises(ConfigCompositionException, match="nope"):
    config("optimizer=nope")


def test_cli_help_and_multirun_dirs(tmp_path):
  help_text = subprocess.run(
    [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout
  for group in ("optimizer: adam, ginger, momentum, qng", "experiment:", "logger: none, wandb"):
    assert group in help_text
  out = subprocess.run(
    [
      sys.executable,
      "train.py",
      "-m",
      "experiment=demo",
      "optimizer=adam,momentum",
      "max_steps=1",
      "eval_every=1",
      f"hydra.sweep.dir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  dirs = sorted(p.parent.name for p in tmp_path.glob("*/summary.json"))
  assert dirs == ["optimizer=adam", "optimizer=momentum"]
  bad = subprocess.run(
    [sys.executable, "train.py", "experiment=demo", "tau=0", f"hydra.run.dir={tmp_path / 'bad'}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 1 and "tau must be >= 1" in bad.stdout + bad.stderr
  assert "Traceback" not in bad.stdout + bad.stderr
