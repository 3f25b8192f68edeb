"""The framework's user-facing errors: train.py and evaluate.py print their message and exit
non-zero without a traceback. Anything else is a bug and raises with its traceback."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class TrainingError(Exception):
  """A failure the user must act on: a run dir of another run, an unreadable checkpoint, a
  diverged or interrupted run, a full disk."""


class NonFiniteLossError(TrainingError):
  """The training loss became NaN or Inf."""


class DiskFullError(TrainingError):
  """A write of the run (a checkpoint, metrics, summary.json) found no space left on its
  filesystem: :func:`disk_full` words it."""


# How tensorstore (orbax's writer) reports an OSError: a ValueError whose text ends so.
_TENSORSTORE_CODES = tuple(f"[os_error_code='{code}']" for code in (errno.ENOSPC, errno.EDQUOT))


def no_space(error: BaseException) -> bool:
  """Whether ``error``, or one it was raised from, says a filesystem is full (ENOSPC) or a
  quota used up (EDQUOT): an ``OSError`` with that errno, or tensorstore's ValueError naming
  it, as orbax passes it on."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if any(code in str(error) for code in _TENSORSTORE_CODES):
      return True
    error = error.__cause__ or error.__context__
  return False


def disk_full(
  path: str | Path, what: str | None, last_good: int | None, checkpoints: Path
) -> DiskFullError:
  """The one-line error of a write to ``path`` (of ``what``, e.g. "checkpoint 50") that found
  no space: the free space left there, the last good checkpoint in ``checkpoints`` (the newest
  complete one, None if there is none) and what to do."""
  path = Path(path)
  written = f"{what} to {path}" if what else str(path)
  there = path == checkpoints
  if last_good is None:
    good = "there is no checkpoint " + ("there" if there else f"in {checkpoints}") + " yet"
    then = "start the run again"
  else:
    good = f"the last good checkpoint {'there ' if there else ''}is step {last_good}"
    good += "" if there else f" in {checkpoints}"
    then = f"resume from step {last_good}"
  return DiskFullError(
    f"no space left on device: writing {written} failed ({_free(path)} free on that "
    f"filesystem); {good}. Free space there, or move the run dir to another filesystem and "
    f"point hydra.run.dir at it; then rerun the same command to {then}."
  )


def _free(path: Path) -> str:
  """The free space of the filesystem of ``path`` (or of its nearest existing parent)."""
  for folder in (path, *path.parents):
    try:
      free = float(shutil.disk_usage(folder).free)
    except OSError:
      continue
    unit = "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
      if free < 1024:
        break
      free, unit = free / 1024, larger
    return f"{free:.0f} B" if unit == "B" else f"{free:.1f} {unit}"
  return "unknown space"


class Interrupted(TrainingError):
  """SIGTERM or SIGINT: the run saved a checkpoint and stopped; a rerun continues it."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum

  @property
  def exit_code(self) -> int:
    """128 + the signal number, as a shell reports a process ended by that signal."""
    return 128 + int(self.signum)


def user_errors() -> tuple[type[Exception], ...]:
  """Every error class whose message is the whole story for the user (config, data, weights,
  run dir, checkpoint, divergence, full disk, interruption)."""
  from data.images import DatasetUnavailableError
  from models.t5_convert import ModelUnavailableError
  from training.config_check import ConfigError

  return (TrainingError, ConfigError, DatasetUnavailableError, ModelUnavailableError)
