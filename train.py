"""Train any model of models/ with any optimizer, configured by Hydra (configs/).

    python train.py optimizer=ginger tau=8                    # CIFAR-100 / ResNet-18 (Table 1)
    python train.py experiment=demo                           # offline: digits, tiny ResNet
    python train.py -m optimizer=ginger,qng tau=1,2,4         # one run dir per combination
    python train.py experiment=xsum_t5_lora optimizer=ginger tau=8

Each run writes to its own dir (outputs/<name>/<overrides>/): ``.hydra/config.yaml``,
``run.json`` (the run's fingerprint), ``metrics.jsonl``, ``spectrum.jsonl.gz`` (Ginger's
curvature spectrum), ``summary.json`` and orbax ``checkpoints/``. Rerunning the same command
continues from the last checkpoint; a rerun with another configuration in the same dir is
refused. SIGTERM/SIGINT save a checkpoint and stop (before the first step, with nothing to
save, they stop at once). A ``key=value`` whose key the config lacks (a typo: ``optimzer=adam``)
and a ``+key=value`` that adds a key nothing reads (``+tua=8``) are refused, naming the nearest
keys; ``+group=option`` (``+sweep=``) adds a config group as usual. A misspelled key and a run
dir another process holds are refused before JAX is imported, in about a second.
Exit status: 0, 1 (a failed run: the message says why; with -m, after every job ran, with a
list of the failed ones), or 128 + the signal number (stopped by SIGTERM or SIGINT). With
``hydra/launcher=submitit_slurm`` (one SLURM job per run, one GPU each) or ``submitit_local``
each job runs in a process of its own, and the launching process reports them the same way
(training/launchers.py).

The loop itself is training/loop.py; this file is only the command line.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

# No JAX here: a refused command (a misspelled key, a run dir another process holds) answers
# before JAX is imported, which takes seconds; training.loop imports it when a run starts.
from training import config_check, launchers, multirun, run_record
from training.errors import Interrupted, NonFiniteLossError, user_errors

# The loop's API, re-exported for scripts that `import train` (tests/test_sharding.py).
_LAZY = {
  "evaluate": "training.loop",
  "train": "training.loop",
  "build": "training.run_setup",
  "TrainState": "training.steps",
  "initial_stats": "training.steps",
}
__all__ = ["NonFiniteLossError", *_LAZY]


def __getattr__(name: str):
  """The re-exported names of the loop, imported (with JAX) when first asked for."""
  if name not in _LAZY:
    raise AttributeError(f"module 'train' has no attribute {name!r}")
  import importlib

  return getattr(importlib.import_module(_LAZY[name]), name)


log = logging.getLogger("train")
SHOWN = (
  "best_val_accuracy",
  "val_loss_at_best",
  "rouge1",
  "rouge2",
  "rougeL",
  "train_perplexity",
  "min_train_loss",
  "final_train_loss",
  "steps",
  "step_time_s",
)


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
  for noisy in ("absl", "orbax", "jax._src"):  # checkpoint/compile chatter at INFO
    logging.getLogger(noisy).setLevel(logging.WARNING)
  run_dir = Path(HydraConfig.get().runtime.output_dir)
  multirun.jobs.append(str(run_dir))
  try:
    config_check.check_added_keys(HydraConfig.get().overrides.task, cfg)
    with run_record.exclusive(run_dir):  # a live run there refuses this one before JAX loads
      pass
    from training import loop

    summary = loop.train(cfg, run_dir)
  except Interrupted as e:  # preempted: stop, also a multirun's remaining jobs
    log.error("%s", e)
    sys.exit(e.exit_code)
  except (config_check.ConfigError, run_record.RunDirBusy) as e:  # before JAX is imported
    _refused(run_dir, e)
    return
  except user_errors() as e:  # the message is all the user needs; the other jobs go on
    _refused(run_dir, e)
    return
  except Exception:  # a bug: Hydra shows its traceback; the list below names the job too
    multirun.failed.append(f"{run_dir}: raised an unexpected error (traceback above)")
    raise
  shown = {k: summary.get(k) for k in SHOWN if summary.get(k) is not None}
  log.info("done: %s -> %s", json.dumps(shown), run_dir / "summary.json")


def _refused(run_dir: Path, e: Exception) -> None:
  """Logs a user error's message, and lists the job as failed (with -m, the other jobs go on)."""
  log.error("%s: %s", type(e).__name__, e)
  why = "\n    ".join(str(e).splitlines())  # the whole message, its lines indented
  multirun.failed.append(f"{run_dir}: {type(e).__name__}: {why}")


def cli() -> None:
  """main(), then the exit status: non-zero if any job failed, with a list of them."""
  launchers.register()
  try:
    config_check.check_command_line_keys(sys.argv[1:])
  except config_check.ConfigError as e:  # before Hydra, whose advice would be "+key=value"
    log.error("ConfigError: %s", e)
    sys.exit(1)
  try:
    main()
  finally:
    multirun.report()
  if multirun.exit_status():
    sys.exit(multirun.exit_status())


if __name__ == "__main__":
  cli()
