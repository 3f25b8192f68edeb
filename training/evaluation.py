"""The evaluation of a state on its task's evaluation split (train.py's loop and evaluate.py)."""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np

from data.progress import Ticker
from models.tasks import Task
from training.run_config import RunConfig
from training.steps import TrainState

log = logging.getLogger("train")


def evaluate(
  task: Task,
  eval_step,
  state: TrainState,
  frozen,
  arrays,
  rc: RunConfig,
  eval_weights=None,
  train_arrays=None,
) -> dict:
  """The task's metrics of ``state`` on its evaluation split (``arrays``, placed on the
  devices; its first ``rc.eval_examples`` examples where that is set), in batches of
  ``rc.eval_batch_size``, with a progress line every 10 s; generation-based metrics
  included. ``eval_weights`` (``Setup.eval_weights``; it reads ``train_arrays``): the weights
  to score where the optimizer's are not the trained ones; None: the state's."""
  if eval_weights is not None:
    trainable, rest = eval_weights(state, frozen, train_arrays)
    state = state._replace(trainable=trainable, rest=rest)
  batch_size = rc.eval_batch_size
  total = task.num_val if rc.eval_examples is None else min(task.num_val, rc.eval_examples)
  sums: dict[str, float] = {}
  ticker = Ticker(log, f"evaluating on {task.eval_split}", total, "examples")
  for start in range(0, total, batch_size):
    idx = np.arange(start, min(start + batch_size, total))
    batch = jax.device_get(eval_step(state.trainable, frozen, state.rest, arrays, idx))
    for k, v in batch.items():
      sums[k] = sums.get(k, 0.0) + float(v)
    ticker.tick(int(idx[-1]) + 1)
  metrics = {k: float(v) for k, v in task.eval_metrics(sums).items()}
  model = functools.partial(task.model_with, state.trainable, frozen, state.rest)
  return metrics | task.generation_metrics(model)
