"""Evaluate a run dir's checkpoint on its validation split (accuracy/loss, or loss + ROUGE).

    python evaluate.py run_dir=outputs/demo/optimizer=ginger
    python evaluate.py run_dir=... step=400 data.rouge_examples=1000
    python evaluate.py run_dir=outputs/xsum_t5_lora/... data.eval_split=test   # XSUM test split

Reads the run's resolved config (``.hydra/config.yaml``), rebuilds the model and data exactly
as training did, restores the checkpoint (the latest unless ``step=``) and writes
``eval_step<N>.json`` into the run dir. Any other ``key=value`` overrides the stored config
(e.g. ``data.path=...`` on another machine).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger("evaluate")


class RunDirError(RuntimeError):
  """A run dir without the files evaluation needs."""


def load_run_config(run_dir: Path, overrides: list[str]):
  config_file = run_dir / ".hydra" / "config.yaml"
  if not config_file.exists():
    raise RunDirError(f"{run_dir} is not a run dir: {config_file} is missing.")
  cfg = OmegaConf.load(config_file)
  return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))


def evaluate_run(run_dir: Path, step: int | None = None, overrides: list[str] = ()) -> dict:
  import train
  from training import sharding
  from training.checkpoints import Checkpointer, CheckpointError

  cfg = load_run_config(run_dir, list(overrides))
  checkpointer = Checkpointer(run_dir)
  if checkpointer.latest_step() is None:
    raise CheckpointError(f"no checkpoint in {checkpointer.directory}: was the run started?")
  setup = train.build(cfg)
  state = checkpointer.restore(setup.state, step)
  metrics = train.evaluate(
    setup.task,
    setup.eval_step,
    state,
    setup.frozen,
    sharding.put(setup.task.val_arrays, setup.plan.replicated),
    cfg,
  )
  split = cfg.data.get("eval_split") or (
    "validation" if cfg.model.family == "t5" else getattr(setup.task, "info", {}).get("val_split")
  )
  result = {"run_dir": str(run_dir), "step": int(state.step), "split": split} | metrics
  out = run_dir / f"eval_step{int(state.step)}_{split}.json"
  out.write_text(json.dumps(result, indent=2))
  result["written_to"] = str(out)
  return result


def main(argv: list[str]) -> int:
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  for noisy in ("absl", "orbax", "jax._src"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  args = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in ("run_dir", "step"))
  overrides = [a for a in argv if a.split("=", 1)[0] not in ("run_dir", "step")]
  if "run_dir" not in args:
    print(__doc__)
    return 2
  from data.images import DatasetUnavailableError
  from training.checkpoints import CheckpointError

  try:
    result = evaluate_run(
      Path(args["run_dir"]), int(args["step"]) if "step" in args else None, overrides
    )
  except (RunDirError, CheckpointError, DatasetUnavailableError, ValueError) as e:
    log.error("%s: %s", type(e).__name__, e)
    return 1
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
