"""Evaluate a run dir's checkpoint on its validation split (accuracy/loss, or loss + ROUGE).

    python evaluate.py run_dir=outputs/demo/optimizer=ginger
    python evaluate.py run_dir=... step=400 data.rouge_examples=1000
    python evaluate.py run_dir=outputs/xsum_t5_lora/... data.eval_split=test   # XSUM test split

Reads the run's resolved config (``.hydra/config.yaml``), rebuilds the model and data exactly
as training did, restores the checkpoint (the latest unless ``step=``) and writes
``eval_step<N>_<split>.json`` into the run dir. Any other ``key=value`` overrides the stored
config (e.g. ``data.path=...`` on another machine); a key the stored config lacks is refused.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from training.run_record import RunDirError

log = logging.getLogger("evaluate")


def load_run_config(run_dir: Path, overrides: list[str]):
  """The run's stored config with ``overrides`` (``key=value``) applied. Each key must exist
  there: a key it lacks would be added where nothing reads it (a typo, or ``data.eval_split``
  for an image run), and the evaluation would silently run as stored."""
  config_file = run_dir / ".hydra" / "config.yaml"
  if not config_file.exists():
    raise RunDirError(f"{run_dir} is not a run dir: {config_file} is missing.")
  cfg = OmegaConf.load(config_file)
  from training.run_record import ABSENT_AT

  for key, value in ABSENT_AT.items():  # keys newer than the run, at the value it ran with
    if key not in cfg:
      cfg[key] = value
  for override in overrides:
    _check_key(cfg, override, config_file)
  return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))


def _check_key(cfg, override: str, config_file: Path) -> None:
  from training.config_check import ConfigError

  path = override.split("=", 1)[0]
  node, walked = cfg, []
  for name in path.split("."):
    if not (OmegaConf.is_dict(node) and name in node):
      where = f"under {'.'.join(walked)}" if walked else "at the top level"
      keys = ", ".join(sorted(map(str, node))) if OmegaConf.is_dict(node) else "none (a value)"
      raise ConfigError(
        f"{override}: the run's config has no key {path} ({config_file}); keys {where}: {keys}."
      )
    node = node.get(name)
    walked.append(name)


def evaluate_run(run_dir: Path, step: int | None = None, overrides: list[str] = ()) -> dict:
  from training import evaluation, run_setup, sharding
  from training.checkpoints import Checkpointer

  cfg = load_run_config(run_dir, list(overrides))
  checkpointer = Checkpointer(run_dir)
  step = checkpointer.check_step(step)  # before any data is loaded or compiled
  setup = run_setup.build(cfg, materialize=False)  # no fresh optimizer state beside the saved one
  state = checkpointer.restore(
    setup.init_state,
    step,
    fix=lambda s: f"evaluate it with: evaluate.py run_dir={run_dir} step={s}",
  )
  metrics = evaluation.evaluate(
    setup.task,
    setup.eval_step,
    state,
    setup.frozen,
    sharding.put(setup.task.val_arrays, setup.plan.replicated),
    setup.rc,
    setup.eval_weights,
    None
    if setup.eval_weights is None
    else sharding.put(setup.task.train_arrays, setup.plan.replicated),
  )
  split = setup.task.eval_split
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
  if not args.get("step", "0").isdigit():
    log.error("step=%s: must be a checkpoint's step number (an integer >= 0).", args["step"])
    return 2
  from training.errors import user_errors

  try:
    result = evaluate_run(
      Path(args["run_dir"]), int(args["step"]) if "step" in args else None, overrides
    )
  except user_errors() as e:
    log.error("%s: %s", type(e).__name__, e)
    return 1
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
