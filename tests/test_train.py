"""train.py / evaluate.py end to end on tiny shapes: every experiment config, resume,
NaN handling, clear errors, run-dir fingerprints, SIGTERM, the Hydra CLI."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from fakes import cifar_pickle_folder, tiny_hf_t5_dir, xsum_jsonl
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import evaluate
from data.images import DatasetUnavailableError
from training import loop as train
from training import run_record
from training.checkpoints import Checkpointer, CheckpointError
from training.config_check import ConfigError
from training.errors import NonFiniteLossError, TrainingError

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
    pytest.param("cifar100_resnet18", "qng", marks=pytest.mark.slow),  # 60 s: ResNet-18
    # 14 s at -O0; ResNet-50's blocks, parameters and MACs: tests/test_resnet.py
    pytest.param("cifar100_resnet50", "momentum", marks=pytest.mark.slow),
    # ResNet-18 itself: tests/test_resnet.py; the stand-in configs: tests/test_standin_scale.py
    pytest.param("cifar10_resnet18", "adam", marks=pytest.mark.slow),
  ],
)
def test_image_experiments_smoke(request, tmp_path, experiment, optimizer):
  if experiment == "demo":  # the run of RERUN_BASE (this config), trained once for the run-dir
    run_dir, summary = request.getfixturevalue("first_run")  # tests below too
  else:
    sub = "cifar10" if "cifar10_" in experiment else "cifar100"
    extra = _image_overrides(request.getfixturevalue("data_dir"), sub)
    cfg = config(f"experiment={experiment}", f"optimizer={optimizer}", *FAST, *extra)
    run_dir, summary = tmp_path, train.train(cfg, tmp_path)
  assert SUMMARY_KEYS | {"best_val_accuracy", "val_loss_at_best"} <= set(summary)
  assert summary["steps"] == 2 and summary["status"] == "completed"
  assert summary["flops_per_iter"]["analytic"] > 0
  assert summary["peak_memory_bytes"] is None  # CPU does not report it: never a fake 0
  on_disk = json.loads((run_dir / "summary.json").read_text())
  assert on_disk["run"]["optimizer"] == optimizer
  events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert {"train", "eval"} <= {e["event"] for e in events}
  # The curvature optimizers log the share of update entries their clip changes (or would).
  fractions = [e.get("clip_fraction") for e in events if e["event"] == "train"]
  if optimizer in ("ginger", "qng"):
    assert all(0.0 <= f <= 1.0 for f in fractions), fractions
  else:
    assert fractions == [None] * len(fractions)


@pytest.mark.parametrize(
  "experiment",
  [
    # the seq2seq path with LoRA (below) covers demo_xsum's in `make test`
    pytest.param("demo_xsum", marks=pytest.mark.slow),
    pytest.param("xsum_t5_full", marks=pytest.mark.slow),
    "xsum_t5_lora",
  ],
)
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


# The demo's Ginger step (block=global) of the SIGTERM test below, at batch 16: a step takes a
# third of batch 64's at `make test`'s -O0 (0.2 s against 0.6 s), and nothing it checks depends
# on the batch size.
RESUMED = ["experiment=demo", "optimizer=ginger", "block=global", "batch_size=16", "logger=none"]


def _diverging(*overrides):
  """A demo run whose loss becomes NaN/Inf within a few steps (lr 1e12)."""
  base = ["experiment=demo", "lr=1e12", "logger=none", "log_every=1", "eval_every=100"]
  return config(*base, *overrides)


def test_nan_loss_stops_with_clear_error_and_keeps_checkpoint(tmp_path):
  cfg = _diverging("optimizer=momentum", "max_steps=40", "checkpoint_every=1")
  with pytest.raises(NonFiniteLossError, match="NaN/Inf.*last good checkpoint") as e:
    train.train(cfg, tmp_path)
  assert "gamma" not in str(e.value)  # Momentum has none: lower lr or clip
  assert "lower lr (now 1000000000000.0), or clip the gradient (grad_clip=1.0)" in str(e.value)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["status"] == "failed"
  last = Checkpointer(tmp_path).latest_step()
  state = Checkpointer(tmp_path).restore(train.build(cfg).state, last)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.trainable))


ADAM = ["experiment=demo", "optimizer=adam", *FAST]


@pytest.fixture(scope="module")
def adam_run(tmp_path_factory):
  """A finished run dir of ADAM and its summary, trained once for the tests that start from
  one (each works on a copy)."""
  run_dir = tmp_path_factory.mktemp("adam_run")
  return run_dir, train.train(config(*ADAM), run_dir)


def _copy_of(run, tmp_path):
  """``tmp_path`` holding a copy of ``run``'s dir; ``run``'s summary."""
  shutil.copytree(run[0], tmp_path, dirs_exist_ok=True)
  return run[1]


def test_evaluate_reloads_checkpoint(adam_run, tmp_path, monkeypatch):
  cfg = config(*ADAM)
  summary = _copy_of(adam_run, tmp_path)
  (tmp_path / ".hydra").mkdir()
  from omegaconf import OmegaConf

  OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
  # A step without a checkpoint: said at once, with the steps there are (nothing is built).
  monkeypatch.setattr(train, "build", lambda *a, **k: pytest.fail("built before the check"))
  with pytest.raises(CheckpointError, match=r"no checkpoint 1 in .*; available: \[2\]"):
    evaluate.evaluate_run(tmp_path, step=1)
  monkeypatch.undo()
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
  assert evaluate.main([f"run_dir={tmp_path}"]) == 1  # the message, no traceback
  assert evaluate.main([f"run_dir={tmp_path}", "step=last"]) == 2
  (tmp_path / ".hydra").mkdir()
  from omegaconf import OmegaConf

  OmegaConf.save(config("experiment=demo"), tmp_path / ".hydra" / "config.yaml")
  with pytest.raises(CheckpointError, match="no checkpoint"):
    evaluate.evaluate_run(tmp_path)
  # An override of a key the run's config lacks is refused, not added where nothing reads it
  # (an image run has no eval_split; a typo would evaluate with the stored value).
  for bad, match in [
    ("data.eval_split=test", r"data.eval_split=test: the run's config has no key data.eval_"),
    ("data.rouge_exampels=5", r"no key data.rouge_exampels .*; keys under data: .*source"),
    ("bogus=1", r"bogus=1: .* keys at the top level: .*batch_size"),
    ("lr.x=1", r"no key lr.x .*; keys under lr: none \(a value\)"),
  ]:
    with pytest.raises(ConfigError, match=match):
      evaluate.evaluate_run(tmp_path, overrides=[bad])
  assert evaluate.main([f"run_dir={tmp_path}", "data.eval_split=test"]) == 1


@pytest.mark.parametrize(
  "override, error, match",
  [
    ("tau=0", ValueError, "tau=0: must be an integer >= 1"),
    ("alpha=1.5", ValueError, r"alpha=1.5 .*: must be a number in \(0, 1\)"),
    ("gamma=-1", ValueError, "gamma=-1: must be a finite number > 0"),
    ("block=rows", ValueError, "block='rows': must be one of"),
    ("schedule=linear", ValueError, "schedule='linear': must be one of"),
    ("fisher_forward=both", ValueError, "fisher_forward='both': must be one of"),
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


def test_cli_help_and_a_bad_value(tmp_path):
  help_text = subprocess.run(
    [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout
  optimizers = ", ".join(sorted(p.stem for p in (ROOT / "configs" / "optimizer").glob("*.yaml")))
  for group in (f"optimizer: {optimizers}", "experiment:", "logger: none, wandb"):
    assert group in help_text
  bad = subprocess.run(
    [sys.executable, "train.py", "experiment=demo", "tau=0", f"hydra.run.dir={tmp_path / 'bad'}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 1 and "tau=0: must be an integer >= 1" in bad.stdout + bad.stderr
  assert "Traceback" not in bad.stdout + bad.stderr


# Two jobs trained to the end (~15 s on 2 cores): `make test-all`. `make test` runs the CLI's
# multirun, and checks its job dirs' names, in
# test_cli_multirun_with_failing_jobs_exits_nonzero_with_a_list.
@pytest.mark.slow
def test_cli_multirun_dirs(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "train.py",
      "-m",
      "experiment=demo",
      "optimizer=adam",
      "seed=0,1",  # the second job's programs are the first's: read from the compilation cache
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
  assert dirs == [f"eval_every=1,max_steps=1,optimizer=adam,seed={s}" for s in (0, 1)]


# ----------------------------------------------------------------------------- run dirs


def _hydra_writes(run_dir, cfg):
  """What Hydra does before main(): (over)writes the run dir's .hydra/config.yaml."""
  from omegaconf import OmegaConf

  (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
  OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")


def _files(run_dir):
  return {
    p.relative_to(run_dir): p.read_bytes()
    for p in sorted(run_dir.rglob("*"))
    if p.is_file() and "checkpoints" not in p.parts and p.name != run_record.LOCK
  }


# The config of test_image_experiments_smoke[demo-ginger], which checks this very run (a Ginger
# step of another lr would be another program to compile: ~25 s).
RERUN_BASE = ["experiment=demo", "optimizer=ginger", *FAST]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  """A finished run dir of RERUN_BASE and its summary (trained once for the smoke test above
  and the cases below)."""
  run_dir = tmp_path_factory.mktemp("first_run")
  first = config(*RERUN_BASE)
  _hydra_writes(run_dir, first)
  summary = train.train(first, run_dir)
  (run_dir / "eval_step2_test.json").write_text("{}")  # what evaluate.py would have written
  return run_dir, summary


@pytest.mark.parametrize(
  "changed, named",
  [
    (["data.source=hf"], "data.source: 'local' -> 'hf'"),
    (["max_steps=3"], "max_steps: 2 -> 3"),
    (["lr=0.01"], "lr: 0.0002 -> 0.01"),  # 2e-4: configs/optimizer/ginger.yaml
    (["optimizer=adam"], "optimizer.name: 'ginger' -> 'adam'"),
    (["tau=8"], "tau: 4 -> 8"),
  ],
)
def test_rerun_with_another_config_is_refused_and_changes_nothing(
  first_run, tmp_path, monkeypatch, changed, named
):
  base, first = RERUN_BASE, config(*RERUN_BASE)
  shutil.copytree(first_run[0], tmp_path, dirs_exist_ok=True)  # a copy: each case changes it
  before = _files(tmp_path)
  assert json.loads((tmp_path / "run.json").read_text())["fingerprint"] == (
    run_record.fingerprint(first)
  )

  other = config(*base, *changed)
  _hydra_writes(tmp_path, other)  # Hydra overwrites .hydra/config.yaml before main() runs
  monkeypatch.setattr(train, "build", lambda *a, **k: pytest.fail("built before the check"))
  with pytest.raises(run_record.RunDirError, match="holds another run") as e:
    train.train(other, tmp_path)
  assert named in str(e.value) and "hydra.run.dir=" in str(e.value)
  assert "left no checkpoint" not in str(e.value)
  assert _files(tmp_path) == before  # .hydra/config.yaml restored; summary, evals, log kept


def test_rerun_after_an_attempt_that_left_nothing_takes_the_dir_over(tmp_path, monkeypatch, caplog):
  """An attempt that stopped before its first log (here: its data could not be built, as
  offline data fails) leaves only run.json: nothing to protect. The corrected rerun (another
  config) takes the dir over, saying so, and records its own fingerprint; no process can still
  be running the old one (it would hold the dir's lock)."""

  def no_data(*args, **kwargs):
    raise RuntimeError("no data")

  monkeypatch.setattr(train, "build", no_data)
  with pytest.raises(RuntimeError, match="no data"):
    train.train(config(*RERUN_BASE), tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == [run_record.LOCK, "run.json"]
  fixed = config(*RERUN_BASE, "lr=0.01")
  with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="no data"):
    train.train(fixed, tmp_path)  # got past the claim: to the build again
  assert "left no checkpoint, metrics or summary" in caplog.text and "lr: 0.0002 -> 0.01" in (
    caplog.text
  )
  record = json.loads((tmp_path / "run.json").read_text())
  assert record["fingerprint"] == run_record.fingerprint(fixed)


def test_rerun_with_other_logging_continues(adam_run, tmp_path):
  summary = _copy_of(adam_run, tmp_path)
  again = train.train(
    config(*ADAM, "log_every=2", "checkpoint_every=5", "spectrum_every=0"), tmp_path
  )
  assert again == summary  # complete: the same run, its summary kept


def test_a_run_dir_without_run_json_is_refused(adam_run, tmp_path):
  """A dir that holds a run but no run.json: nothing says which run it is, so a rerun there
  (even of the same config) is refused and changes nothing; resume=false starts over."""
  _copy_of(adam_run, tmp_path)
  (tmp_path / "run.json").unlink()
  before = _files(tmp_path)
  with pytest.raises(run_record.RunDirError, match="but no run.json.*resume=false"):
    train.train(config(*ADAM), tmp_path)
  assert _files(tmp_path) == before
  assert train.train(config(*ADAM, "resume=false"), tmp_path)["steps"] == 2
  assert (tmp_path / "run.json").exists()


def test_resume_false_discards_the_old_run(adam_run, tmp_path):
  _copy_of(adam_run, tmp_path)
  summary = train.train(
    config("experiment=demo", "optimizer=momentum", *FAST, "resume=false"), tmp_path
  )
  assert summary["run"]["optimizer"] == "momentum" and summary["steps"] == 2


def test_nan_before_any_checkpoint_says_so(tmp_path):
  # The program of the test above (checkpoint_every is not part of it): compiled once.
  cfg = _diverging("optimizer=momentum", "max_steps=40", "checkpoint_every=100")
  with pytest.raises(NonFiniteLossError, match="No checkpoint was saved before it") as e:
    train.train(cfg, tmp_path)
  assert "(checkpoint_every=100)" in str(e.value)
  assert "last good checkpoint" not in str(e.value)
  assert Checkpointer(tmp_path).latest_step() is None


def test_divergence_advice_names_the_optimizers_own_knobs():
  """The advice that a NaN/Inf loss's error gives (the tests above show it reaches the error):
  Ginger's gamma, its update clip only where it is off, the gradient clip only where it is
  off; no gamma for an optimizer without one."""
  from training.optimizers import divergence_advice
  from training.run_config import parse

  def advice(*o):
    return divergence_advice(parse(config("experiment=demo", "lr=0.001", *o), overrides=()))

  unclipped = advice("optimizer=ginger", "rho=null")
  assert unclipped == (
    "lower lr (now 0.001), raise gamma (now 1e-05) or clip the update (rho=1), "
    "or clip the gradient (grad_clip=1.0)"
  )
  clipped = advice("optimizer=ginger", "grad_clip=1.0")
  assert "gamma" in clipped and "rho=" not in clipped and "grad_clip" not in clipped
  momentum = advice("optimizer=momentum")
  assert momentum == "lower lr (now 0.001), or clip the gradient (grad_clip=1.0)"


@pytest.mark.slow
def test_ginger_divergence_before_any_checkpoint_says_so(tmp_path):
  """Unclipped Ginger at lr 1e12 end to end (a Ginger step of its own to compile, ~20 s): the
  NaN/Inf loss stops the run with Ginger's advice. In `make test`:
  test_nan_before_any_checkpoint_says_so (the error without a checkpoint) and
  test_divergence_advice_names_the_optimizers_own_knobs (Ginger's advice)."""
  cfg = _diverging("optimizer=ginger", "rho=null", "max_steps=20", "checkpoint_every=100")
  with pytest.raises(NonFiniteLossError, match="No checkpoint was saved before it") as e:
    train.train(cfg, tmp_path)
  assert "raise gamma (now 1e-05) or clip the update (rho=1)" in str(e.value)
  assert "last good checkpoint" not in str(e.value)


def _logged_steps(metrics: Path) -> list[int]:
  """The steps of the train events in ``metrics`` (metrics.jsonl) so far (a line being
  written is left out)."""
  steps = []
  for line in metrics.read_text().splitlines() if metrics.exists() else []:
    try:
      event = json.loads(line)
    except json.JSONDecodeError:
      continue
    if event.get("event") == "train":
      steps.append(event["step"])
  return steps


# The preempted run: enough steps that the signal, sent once step 5 is logged (after the step-4
# checkpoint), lands mid-run: the 13 steps after it take about 0.5 s at XLA:CPU's default -O3
# (2.5 s at `make test`'s -O0); the loop checks for it between steps. A multiple of eval_every,
# as the expected events below assume (the last step is evaluated anyway).
PREEMPTED_STEPS = 18
PREEMPTED = [
  *RESUMED,
  f"max_steps={PREEMPTED_STEPS}",
  "checkpoint_every=4",
  "log_every=1",
  "eval_every=6",
  "spectrum_every=2",
]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
  """train.py in a real process, sent SIGTERM mid-run after a periodic checkpoint, then the
  same command rerun: (run dir, the step it stopped at, the first process's output and exit
  code, the summary it left, the rerun's completed process)."""
  run_dir = tmp_path_factory.mktemp("preempted") / "run"
  command = [sys.executable, "train.py", *PREEMPTED, f"hydra.run.dir={run_dir}"]
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  metrics = run_dir / "metrics.jsonl"
  deadline = time.time() + 300
  while 5 not in _logged_steps(metrics):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=300)[0].decode()
  steps = Checkpointer(run_dir).steps()
  summary = run_record.read_summary(run_dir)
  rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  return {
    "run_dir": run_dir,
    "out": out,
    "returncode": proc.returncode,
    "checkpoints": steps,
    "summary": summary,
    "rerun": rerun,
  }


def test_sigterm_checkpoints_and_a_rerun_continues(preempted):
  """A real process, preempted with SIGTERM mid-run after a periodic checkpoint: it saves a
  checkpoint at the step it reached, writes summary.json (status "interrupted") and exits 143;
  rerunning the command continues from that checkpoint to the end: every step and evaluation
  logged once, in order, and the curvature spectrum (spectrum.jsonl.gz, cut back to the
  checkpoint on resume, then appended to) once per logged step. That the continued run is the
  uninterrupted one bit for bit: the next test (``make test-all``) and, in process,
  tests/test_curvature_every.py and tests/test_checkpoints.py."""
  out, run_dir = preempted["out"], preempted["run_dir"]
  assert preempted["returncode"] == 128 + signal.SIGTERM, out[-3000:]
  # The checkpoint of the step it stopped at, and a periodic one before it (orbax keeps two).
  *earlier, stopped = preempted["checkpoints"]
  assert 4 < stopped < PREEMPTED_STEPS and earlier and earlier[-1] % 4 == 0, (earlier, out)
  summary = preempted["summary"]
  assert summary["status"] == "interrupted" and summary["steps"] == stopped
  assert "Traceback" not in out
  assert f"stopped by SIGTERM at step {stopped} of {PREEMPTED_STEPS}" in out

  rerun = preempted["rerun"]
  assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
  assert f"at step {stopped}" in rerun.stdout + rerun.stderr  # "resumed from ... at step N"
  assert run_record.read_summary(run_dir)["status"] == "completed"
  expected = [
    (event, step)
    for step in range(1, PREEMPTED_STEPS + 1)
    for event in ("train", "eval")
    if event == "train" or step % 6 == 0
  ]
  assert [(e["event"], e["step"]) for e in run_record.read_events(run_dir)] == expected
  spectrum = [e["step"] for e in run_record.read_spectrum(run_dir, strict=True)]
  assert spectrum == list(range(2, PREEMPTED_STEPS + 1, 2))


@pytest.mark.slow  # an uninterrupted run and two restores beside the preempted one, ~10 s
def test_the_preempted_and_rerun_process_is_the_uninterrupted_run_bit_for_bit(preempted, tmp_path):
  """The run preempted with SIGTERM and rerun (above) against the same run never interrupted:
  every step's loss and gradient norm, every evaluation, the spectrum and the final state
  (parameters, BatchNorm statistics, optimizer state), bit for bit."""
  run_dir = preempted["run_dir"]
  assert preempted["rerun"].returncode == 0
  straight = tmp_path / "straight"  # in this process: what train.py runs, without a start-up
  train.train(config(*PREEMPTED), straight)
  logs = [list(run_record.read_events(d)) for d in (straight, run_dir)]
  assert [(e["event"], e["step"]) for e in logs[0]] == [(e["event"], e["step"]) for e in logs[1]]
  for a, b in zip(*logs):
    for key in ("train_loss", "grad_norm", "min_train_loss", "val_loss", "val_accuracy"):
      assert a.get(key) == b.get(key), (a["step"], key)
  spectra = [
    [(e["step"], e["sigma"]) for e in run_record.read_spectrum(d, strict=True)]
    for d in (straight, run_dir)
  ]
  assert spectra[0] == spectra[1]
  like = train.build(config(*PREEMPTED)).state
  a, b = (Checkpointer(d).restore(like, PREEMPTED_STEPS) for d in (straight, run_dir))
  for x, y in zip(
    jax.tree.leaves((a.trainable, a.rest, a.opt_state)),
    jax.tree.leaves((b.trainable, b.rest, b.opt_state)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# train.py in a process whose orbax meets a full disk from checkpoint argv[1] on (tests/fakes.py).
FULL_DISK_CLI = (
  "import runpy, sys; sys.path.insert(0, 'tests'); import fakes; "
  "fakes.disk_full_from(int(sys.argv[1])); sys.argv = ['train.py', *sys.argv[2:]]; "
  "runpy.run_path('train.py', run_name='__main__')"
)
FULL_DISK = [
  "experiment=demo",
  "optimizer=momentum",
  "logger=none",
  "max_steps=16",
  "checkpoint_every=2",
  "log_every=1",
  "eval_every=16",
  "spectrum_every=0",
]


@pytest.mark.slow  # a train.py process and its rerun (~30 s); the checkpoint layer's and the
# metrics' full-disk tests are fast
def test_a_full_disk_ends_the_run_in_one_line_and_a_rerun_resumes(tmp_path, caplog):
  """train.py whose checkpoint 4 meets a full disk (tensorstore's ENOSPC inside orbax's
  writer, its other writes still running): the run stops at once, exit status 1, with one
  error line naming checkpoint 4, the checkpoints dir, the free space there and the last good
  checkpoint, 2, and saying what to do; no traceback, no "Event loop is closed" (one per
  array write that outlived orbax's event loop). summary.json says "failed" with that line;
  the partial checkpoint is not taken for a good one: a rerun resumes from 2 and finishes."""
  run_dir = tmp_path / "run"
  command = [sys.executable, "-c", FULL_DISK_CLI, "4", *FULL_DISK, f"hydra.run.dir={run_dir}"]
  out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  text = out.stdout + out.stderr
  assert out.returncode == 1, text[-3000:]
  assert "Traceback" not in text and "Event loop" not in text, text[-3000:]
  errors = [line for line in text.splitlines() if "rror" in line or "failed" in line]
  directory = run_dir / "checkpoints"
  assert len(errors) == 1, text[-3000:]
  assert errors[0].startswith(
    f"DiskFullError: no space left on device: writing checkpoint 4 to {directory} failed ("
  ), errors
  assert errors[0].endswith(
    " free on that filesystem); the last good checkpoint there is step 2. Free space there, or"
    " move the run dir to another filesystem and point hydra.run.dir at it; then rerun the same"
    " command to resume from step 2."
  ), errors
  summary = run_record.read_summary(run_dir)
  assert summary["status"] == "failed" and summary["error"] in errors[0]
  assert 4 <= summary["steps"] < 16  # stopped at once, not at the end
  assert Checkpointer(run_dir).steps() == [2]

  with caplog.at_level("INFO", logger="train"):
    rerun = train.train(config(*FULL_DISK), run_dir)
  assert f"resumed from {directory} at step 2" in caplog.text
  assert rerun["status"] == "completed" and rerun["steps"] == 16


def test_a_full_disk_under_the_metrics_ends_the_run_in_one_error(tmp_path):
  """metrics.jsonl meets a full disk at step 5 (from then on it is /dev/full, which refuses
  every write with ENOSPC): the run stops there with a :class:`TrainingError` of one line
  naming the file, the step and the last good checkpoint, 4 (the last one written by then),
  and summary.json says "failed" with it."""
  if not Path("/dev/full").exists():
    pytest.skip("no /dev/full")
  metrics = tmp_path / "metrics.jsonl"

  def full_from_5(done):
    if done == 5:
      metrics.unlink()
      metrics.symlink_to("/dev/full")

  with pytest.raises(TrainingError) as failed:
    train.train(config(*FULL_DISK), tmp_path, stop=full_from_5)
  message = str(failed.value)
  assert message.startswith(f"no space left on device: writing step 5 to {metrics} failed ("), (
    message
  )
  assert f"the last good checkpoint is step 4 in {tmp_path / 'checkpoints'}." in message
  assert "\n" not in message
  summary = run_record.read_summary(tmp_path)
  assert summary["status"] == "failed" and summary["error"] == message and summary["steps"] == 5


def test_cli_multirun_with_failing_jobs_exits_nonzero_with_a_list(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "train.py",
      "-m",
      "experiment=demo",
      "optimizer=ginger",
      "tau=0,-1",
      f"hydra.sweep.dir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  text = out.stdout + out.stderr
  assert out.returncode == 1, text[-3000:]
  assert "2 of 2 jobs failed" in text and "tau=0" in text and "tau=-1" in text
  listed = text[text.index("2 of 2 jobs failed") :]  # the list itself says why, line by line
  assert "tau=0: must be an integer >= 1" in listed, listed
  assert "tau=-1: must be an integer >= 1" in listed, listed
  assert "Traceback" not in text
  # each job has its own dir, named by its overrides (a sweep's job: configs/config.yaml)
  jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
  assert jobs == ["optimizer=ginger,tau=-1", "optimizer=ginger,tau=0"], jobs


@pytest.mark.parametrize("passes, warned", [("pallas", True), ("auto", False), ("jnp", False)])
def test_pallas_passes_off_gpus_are_warned_about(caplog, passes, warned):
  """passes=pallas on a CPU interprets the kernels (~20x slower): said before anything is
  built, not left to be found in the step time."""
  with caplog.at_level("WARNING", logger="train"):
    train.check(config("experiment=demo", "optimizer=ginger", f"passes={passes}"))
  assert ("the Pallas kernels run in JAX's interpreter" in caplog.text) == warned
