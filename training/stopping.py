"""Stopping a run early and cleanly: the stop requests the training loop asks after its steps.

A run stops at a step boundary, saves a checkpoint there and exits, so that a rerun continues
it bit for bit: on SIGTERM or SIGINT (:func:`stop_on_signals`), and in a multi-host run where
JAX's distributed runtime has agreed on the step to stop at after a preemption
(:func:`preempted`); all processes stop at the same step (:func:`agreed`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator

import jax
import numpy as np

log = logging.getLogger("train")

# A stop request: called with the number of steps done, returns the signal that asks the run
# to stop (checkpoint and exit), or None to go on.
StopRequest = Callable[[int], "int | None"]


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT)) -> Iterator[StopRequest]:
  """A stop request that SIGTERM or SIGINT sets (the first one; a second one stops at once).

  Clusters preempt with SIGTERM: the run then saves a checkpoint after the step in flight and
  exits, and a rerun continues it. Before the request is first asked (the loop asks just
  before its first step: while the run is built and compiled) either signal stops the
  process at once, as without a handler: there is nothing to save yet. Outside the main
  thread (where Python cannot install handlers) nothing is installed and the request never
  fires.
  """
  received: list[int] = []
  if threading.current_thread() is not threading.main_thread():
    yield lambda step: None
    return

  def handler(signum, frame):
    del frame
    if received:  # asked twice: stop now, as if no handler were installed
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    received.append(signum)
    log.warning(
      "%s: saving a checkpoint after this step, then stopping (send it again to stop at once)",
      signal.Signals(signum).name,
    )

  # Until the loop first asks (just before its first step) there is nothing to save: the
  # signals keep their default action and stop the process at once, also inside a minutes-long
  # compilation, where a Python handler would only run when it returns.
  previous = {s: signal.signal(s, signal.SIG_DFL) for s in signals}

  def request(step: int) -> int | None:
    del step
    if not armed:
      armed.append(True)
      for s in signals:
        signal.signal(s, handler)
    return received[0] if received else None

  armed: list[bool] = []
  try:
    yield request
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def agreed(signum: int | None) -> int | None:
  """The stop request of any process (all must stop at the same step of a multi-host run)."""
  if jax.process_count() == 1:
    return signum
  from jax.experimental import multihost_utils

  every = multihost_utils.process_allgather(np.int32(signum or 0))
  return next((int(s) for s in np.ravel(every) if s), None)


def preempted(step: int) -> bool:
  """Multi-host: whether every process has reached the step at which to stop after a SIGTERM.

  JAX's distributed runtime takes SIGTERM for itself (its preemption notifier), so Python's
  handler never sees it; the runtime instead agrees on a step at which all processes stop,
  which every process must ask about at every step.
  """
  from jax.experimental import multihost_utils

  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # launched without the runtime's preemption service
    return False
