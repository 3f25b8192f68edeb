"""The run list that results/ and sweeps/ both read: every run dir (plain, or packed by
results/records.py) under some roots, as its summary.json with a few derived fields, and the
checks that keep a damaged record out of a table. No JAX."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from results import records
from training import run_record

DEFAULT_ROOTS = ("outputs", "multirun")
DONE_STATUSES = ("completed", None)  # a summary without "status" counts as completed

# Config keys (dotted) that differ between the runs of one configuration: the seed, the sweep
# that ran it and the sweep's labels and bookkeeping (arm, scale, sweep_epochs; default_hparams:
# the optimizer's defaults kept for the lr fallback), the length (the "length" field says it),
# the experiment's name (the "experiment" field) and where the data lies. Every other key
# run_record fingerprints is a setting: runs that differ in one are two configurations
# (settings_of).
NOT_SETTINGS = frozenset(
  {
    "seed",
    "sweep",
    "arm",
    "scale",
    "sweep_epochs",
    "default_hparams",
    "epochs",
    "max_steps",
    "name",
    "data.path",
  }
)

Run = dict[str, Any]


def find_run_dirs(roots: Iterable[str | Path]) -> list[Path]:
  """Every dir under `roots` holding a summary.json or a metrics.jsonl, and every run of the
  archives there (results/records.py), sorted."""
  return records.find_run_dirs(roots)


def run_length(summary: dict[str, Any]) -> str | None:
  """How long the run was configured to train: "<max_steps>steps", else "<epochs>ep"
  (None without a recorded config)."""
  config = summary.get("config")
  if not isinstance(config, dict):
    return None
  if config.get("max_steps") is not None:
    return f"{config['max_steps']}steps"
  return f"{config['epochs']}ep" if config.get("epochs") is not None else None


def length_text(length: str | None) -> str:
  """ "30ep" -> "30 epochs", "450steps" -> "450 steps"."""
  if length is None:
    return "any length"
  number, unit = re.fullmatch(r"(\d+)(ep|steps)", length).groups()
  return f"{number} {'epoch' if unit == 'ep' else 'step'}{'' if number == '1' else 's'}"


def load_summary(run_dir: str | Path) -> Run | None:
  """The run's summary.json plus "path", "mtime" and the derived ``run["length"]``; None if
  absent, unreadable or without a "run" block."""
  data = records.read_summary(run_dir)
  if data is None or not isinstance(data.get("run"), dict):
    return None
  data["path"] = str(run_dir)
  data["mtime"] = records.summary_mtime(run_dir)
  data["run"]["length"] = run_length(data)
  data["settings"] = settings_of(data.get("config"))
  data["run"]["settings"] = json.dumps(run_record.canonical(data["settings"]), sort_keys=True)
  return data


def settings_of(config: Any) -> dict[str, Any]:
  """A run's settings: its fingerprinted config (``run_record.fingerprinted``: what changes its
  result) as dotted keys, without :data:`NOT_SETTINGS`; {} without a config."""
  if not isinstance(config, dict):
    return {}

  def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
      name = prefix + str(key)
      if name in NOT_SETTINGS:
        continue
      out.update(flat(value, name + ".") if isinstance(value, dict) else {name: value})
    return out

  return flat(run_record.fingerprinted(config))


# summary.json's numbers: a present value of another type is a damaged record, not a blank.
NUMBER_KEYS = (
  "best_val_accuracy",
  "val_loss_at_best",
  "min_train_loss",
  "final_train_loss",
  "step_time_s",
  "peak_memory_bytes",
  "step_memory_bytes",
  "rouge1",
  "rouge2",
  "rougeL",
  "train_perplexity",
)


class DamagedRecordError(ValueError):
  """A summary.json whose value has the wrong type (a table would show it as a blank)."""


def check_numbers(run: Run) -> None:
  """Every :data:`NUMBER_KEYS` value of ``run`` is a number or null, else
  :class:`DamagedRecordError` naming the file and the key."""
  for key in NUMBER_KEYS:
    value = run.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
      where = Path(run["path"]) / run_record.SUMMARY
      raise DamagedRecordError(f"{where}: {key} is {value!r}, not a number")


def skip_reason(run_dir: str | Path) -> str:
  """Why a run dir has no usable summary.json."""
  if not records.has_summary(run_dir):
    return "no summary.json (a run still going, or killed)"
  if records.read_summary(run_dir) is None:
    return "summary.json is not a readable JSON object"
  return 'summary.json has no "run" block'


def collect_runs(roots: Iterable[str | Path]) -> list[Run]:
  """Summaries of all run dirs under `roots`; dirs without a usable summary.json are skipped
  (:func:`run_report` names them); a damaged value raises :class:`DamagedRecordError`."""
  runs = [r for r in (load_summary(d) for d in find_run_dirs(roots)) if r is not None]
  for run in runs:
    check_numbers(run)
  return runs


def rfield(run: Run, key: str) -> Any:
  """A field of the run's "run" block (None when missing)."""
  return (run.get("run") or {}).get(key)


def is_done(run: Run) -> bool:
  """Whether the run finished (status "completed", or no status recorded)."""
  return run.get("status") in DONE_STATUSES


def is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def missing_roots(roots: Sequence[str]) -> str | None:
  """The error for roots named on the command line that do not exist (a typo would otherwise
  give blank tables); None if all exist. The default roots may be absent: no runs yet."""
  missing = [r for r in roots if not Path(r).exists()]
  if not missing:
    return None
  return f"no such run root(s): {', '.join(missing)} (give dirs that hold run dirs)"
