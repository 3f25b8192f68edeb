"""The jobs of a ``train.py -m`` sweep, computed the way Hydra computes them (nothing is trained).

    python -m sweeps.expand +sweep=table1 [scale=smoke] [seed=0,1,2] [other overrides]

prints one line per job: its run dir, learning rate and where that lr came from (configs/best_lr/
or the optimizer config's default). The expansion is Hydra's own: the sweep config's
``hydra.sweeper.params`` plus the command line's overrides (the command line wins for a key in
both), through the basic sweeper's Cartesian product (:func:`cartesian`); each job is then
composed exactly as ``train.py -m`` composes it, so the run dirs are the ones it writes.
sweeps/gpu_pool.py and tests/test_sweeps.py use the functions here.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from training import run_record  # also registers the run_name resolver of the run-dir templates

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
CONFIG_NAME = "config"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass(frozen=True)
class Job:
  """One run of a sweep: the overrides train.py gets, its resolved config and its run dir."""

  overrides: tuple[str, ...]
  config: dict[str, Any]  # the resolved job config (what summary.json's "config" holds)
  run_dir: Path  # hydra.sweep.dir / hydra.sweep.subdir, relative to the repo root

  @property
  def run(self) -> dict[str, Any]:
    """summary.json's "run" block of this job (training/run_record.py)."""
    return run_record.identity(self.config)


_active: list[Path] = []  # config dirs of the hydra_context()s in progress (innermost last)


@contextmanager
def hydra_context(config_dir: str | Path = CONFIG_DIR) -> Iterator[Any]:
  """Hydra initialised on ``config_dir``; re-entrant for the same dir."""
  config_dir = Path(config_dir).resolve()
  if _active and _active[-1] == config_dir:
    yield GlobalHydra.instance().hydra
    return
  if GlobalHydra.instance().is_initialized():
    raise RuntimeError("Hydra is already initialised (by another caller or config dir).")
  with initialize_config_dir(config_dir=str(config_dir), version_base=None):
    _active.append(config_dir)
    try:
      yield GlobalHydra.instance().hydra
    finally:
      _active.pop()


def split_hydra(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
  """(task overrides, hydra.* overrides), as Hydra separates them before sweeping."""
  parsed = OverridesParser.create().parse_overrides(list(overrides))
  task = [o.input_line for o in parsed if not o.is_hydra_override()]
  hydra = [o.input_line for o in parsed if o.is_hydra_override()]
  return task, hydra


def job_overrides(overrides: Sequence[str], config_dir: str | Path = CONFIG_DIR) -> list[list[str]]:
  """The override list of every job that ``train.py -m <overrides>`` launches, in its order.

  Mirrors BasicSweeper.sweep: ``hydra.sweeper.params`` of the config composed for the sweep
  (e.g. +sweep=table1's), then the command line's task overrides, Cartesian product. The
  hydra.* overrides of the command line are appended to every job (Hydra re-applies them).
  """
  task, hydra_overrides = split_hydra(overrides)
  with hydra_context(config_dir) as hydra:
    cfg = hydra.compose_config(
      CONFIG_NAME, list(overrides), run_mode=RunMode.MULTIRUN, from_shell=False
    )
    sweeper = cfg.hydra.sweeper
    if sweeper.get("_target_") != BASIC_SWEEPER:
      raise ValueError(f"only Hydra's basic sweeper is supported, got {sweeper._target_}.")
    params = sweeper.get("params")  # None for a multirun without a sweep config
    params = OmegaConf.to_container(params, resolve=True) if params is not None else {}
    lines = [f"{k}={v}" for k, v in params.items()] + task
    parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(lines)
  return [job + hydra_overrides for job in cartesian(parsed)]


def cartesian(parsed: Sequence[Override]) -> list[list[str]]:
  """The basic sweeper's jobs: one list per key (a later override of a key replaces an
  earlier one, in the earlier one's place), then their Cartesian product, the last key
  varying fastest (``hydra._internal``'s BasicSweeper.split_arguments, with public types)."""
  per_key: dict[str, list[str]] = {}
  for override in parsed:
    key = override.get_key_element()
    if not override.is_sweep_override():
      per_key[key] = [f"{key}={override.get_value_element_as_str()}"]
    elif override.is_discrete_sweep():
      per_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
    else:
      raise ValueError(f"the basic sweeper sweeps only lists (a,b,c), got {override.input_line}")
  return [list(job) for job in itertools.product(*per_key.values())]


def compose_job(overrides: Sequence[str], config_dir: str | Path = CONFIG_DIR) -> Job:
  """One job's config and run dir, composed as train.py -m composes it (RUN mode)."""
  with hydra_context(config_dir) as hydra:
    cfg = hydra.compose_config(CONFIG_NAME, list(overrides), run_mode=RunMode.RUN, from_shell=False)
    return _job(overrides, cfg)


def _job(overrides: Sequence[str], cfg: DictConfig) -> Job:
  run_dir = Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir)
  task = OmegaConf.to_container(cfg, resolve=True)
  del task["hydra"]
  return Job(tuple(overrides), task, run_dir)


def expand(overrides: Sequence[str], config_dir: str | Path = CONFIG_DIR) -> list[Job]:
  """Every job of ``train.py -m <overrides>``, composed."""
  with hydra_context(config_dir):
    return [compose_job(job, config_dir) for job in job_overrides(overrides, config_dir)]


def describe(jobs: Sequence[Job]) -> str:
  """One line per job: run dir, lr and its source; then the count."""
  lines = []
  for job in jobs:
    given = any(o.split("=", 1)[0].lstrip("+~") == "lr" for o in job.overrides)
    source = "command line" if given else job.config.get("lr_from")
    lines.append(f"{job.run_dir}  lr={job.config['lr']} ({source})")
  return "\n".join(lines + [f"{len(jobs)} runs"])


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m sweeps.expand",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "overrides",
    nargs=argparse.REMAINDER,
    help="train.py -m overrides, e.g. +sweep=table1 scale=smoke seed=0,1",
  )
  parser.add_argument(
    "--overrides-only",
    action="store_true",
    help="print each job's overrides instead (one job per line)",
  )
  args = parser.parse_args(argv)
  if args.overrides_only:
    for job in job_overrides(args.overrides):
      print(" ".join(job))
    return 0
  print(describe(expand(args.overrides)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
