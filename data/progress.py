"""Progress lines for long host-side work (decoding images, evaluating): a line every
``interval_s`` seconds while it lasts (and, with ``announce``, one when it starts), so that
minutes of work never pass without a sign and short work prints nothing (or one line)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Ticker:
  """Logs ``<what>: <done>/<total> <unit> (<seconds> s)`` to ``log`` at :meth:`tick` calls
  that come ``interval_s`` or more after the start or the last line, and at the last call
  after such a line; ``announce``: ``<what>: <total> <unit>`` at the start too."""

  def __init__(
    self,
    log: logging.Logger,
    what: str,
    total: int,
    unit: str,
    *,
    interval_s: float = 10.0,
    announce: bool = False,
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.log, self.what, self.total, self.unit = log, what, total, unit
    self.interval_s, self.clock = interval_s, clock
    self.began = self.last = clock()
    if announce:
      log.info("%s: %d %s", what, total, unit)

  def tick(self, done: int) -> None:
    """``done`` of the ``total`` are done: a line if one is due (or all are done after a
    line in between)."""
    now = self.clock()
    if now - self.last >= self.interval_s or (done >= self.total and self.last > self.began):
      self.last = now
      self.log.info(
        "%s: %d/%d %s (%.0f s)", self.what, done, self.total, self.unit, now - self.began
      )
