"""A device trace of a window of training steps (config ``profile_steps``, ``profile_start``).

The loop calls :meth:`StepTrace.before` ahead of every step and :meth:`StepTrace.after` behind
it; between steps ``start`` and ``start + steps`` :mod:`jax.profiler` records every kernel, copy
and collective of every local device into ``<run dir>/profile`` (an XSpace ``*.xplane.pb``, for
TensorBoard's or XProf's profile viewer, or ``python -m bench.profile_summary <run dir>``).
The window starts and ends on a finished step (the state is waited for), so that it holds
exactly ``steps`` steps and none of their neighbours'; those two waits and the tracer itself
slow the traced steps, so take step times from outside the window.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax

log = logging.getLogger(__name__)

FOLDER = "profile"


class StepTrace:
  """Traces steps ``[start, start + steps)`` into ``folder`` (``steps=0``: never)."""

  def __init__(self, folder: Path, start: int, steps: int):
    self.folder, self.start, self.stop = Path(folder), int(start), int(start) + int(steps)
    self.steps = int(steps)
    self.active = False

  def before(self, step: int, state) -> None:
    """Before step ``step`` (0-based) runs: starts the trace at the window's first step."""
    if self.steps and step == self.start and not self.active:
      jax.block_until_ready(state)
      jax.profiler.start_trace(str(self.folder))
      self.active = True

  def after(self, done: int, state) -> None:
    """After ``done`` steps: ends the trace once the window's last step has finished."""
    if self.active and done >= self.stop:
      jax.block_until_ready(state)
      self.close()

  def close(self) -> None:
    """Ends a trace still running (the run stopped inside the window)."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      log.info("device trace of steps %d-%d in %s", self.start, self.stop - 1, self.folder)
