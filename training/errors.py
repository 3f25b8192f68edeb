"""The framework's user-facing errors: train.py and evaluate.py print their message and exit
non-zero without a traceback. Anything else is a bug and raises with its traceback."""

from __future__ import annotations


class TrainingError(Exception):
  """A failure the user must act on: a run dir of another run, an unreadable checkpoint, a
  diverged or interrupted run."""


class NonFiniteLossError(TrainingError):
  """The training loss became NaN or Inf."""


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
  run dir, checkpoint, divergence, interruption)."""
  from data.images import DatasetUnavailableError
  from models.t5_convert import ModelUnavailableError
  from training.config_check import ConfigError

  return (TrainingError, ConfigError, DatasetUnavailableError, ModelUnavailableError)
