"""metrics.jsonl and spectrum.jsonl.gz, wandb, progress output and the run's provenance
(versions, device, commit)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from training import run_record
from training.choices import LOGGERS


def _plain(value):
  """JSON-ready Python scalars from numpy/JAX values."""
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None if math.isnan(value) else value
  return value


class MetricsLog:
  """Appends one JSON object per event to ``metrics.jsonl`` and mirrors it to wandb; "spectrum"
  events (large: every tensor's sigma) go to ``spectrum.jsonl.gz`` instead, not to wandb.

  On resume both files are truncated to the events at or before the checkpoint's step, so the
  log of a resumed run equals that of an uninterrupted one. In a multi-host run only process 0
  writes (the files and wandb); the others return the same records.

  ``logger``: the run's ``training.run_config.LoggerConfig`` (``name``, wandb's ``project`` and
  ``mode``); ``config``: the run's resolved config as plain containers, which wandb records.
  """

  def __init__(self, run_dir: Path, logger, config: dict, resume_step: int | None):
    self.run_dir = run_dir
    self.path = run_dir / run_record.METRICS
    self.start = time.time()
    self.wall_offset = 0.0
    self.writer = jax.process_index() == 0
    self.wandb = None
    if logger.name not in LOGGERS:
      raise ValueError(f"logger must be one of {LOGGERS}, got {logger.name!r}.")
    if not self.writer:
      return
    if resume_step is not None:
      kept = self._keep(resume_step) if self.path.exists() else []
      # The clock continues from the last event kept, in either file (a spectrum event
      # follows the train event of its step).
      last = kept[-1:] + run_record.keep_spectrum(run_dir, resume_step)[-1:]
      self.wall_offset = max((e.get("wall_time_s", 0.0) or 0.0 for e in last), default=0.0)
    else:
      self.path.unlink(missing_ok=True)
      (run_dir / run_record.SPECTRUM).unlink(missing_ok=True)
    if logger.name == "wandb":
      import wandb

      # One wandb run per run dir: the id is derived from its absolute path, so a resumed run
      # continues its wandb run and two dirs with the same name (e.g. "default") never merge.
      run_id = hashlib.sha1(str(run_dir.absolute()).encode()).hexdigest()[:16]
      self.wandb = wandb.init(
        project=logger.project,
        mode=logger.mode,
        config=config,
        dir=str(run_dir),
        id=run_id,
        name=str(run_dir),
        resume="allow",
        reinit="finish_previous",
      )

  def _keep(self, step: int) -> list[dict]:
    """Cuts metrics.jsonl back to its events at or before ``step``; returns them.

    Each event is one write ending in a newline: a last line without one is a write cut short
    (SIGKILL, power loss), dropped. Any other line that is not JSON stops the resume, naming
    the file and line.
    """
    text = self.path.read_text()
    if not text.endswith("\n") and text:
      logging.warning("%s: dropping a partial last line (a write cut short)", self.path)
      self.path.write_text(text[: text.rfind("\n") + 1])
    events = run_record.read_events(self.run_dir, strict=True)
    kept = [e for e in events if e.get("step", 0) <= step]
    self.path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    return kept

  def wall_time(self) -> float:
    return self.wall_offset + time.time() - self.start

  def write(self, event: str, step: int, **values: Any) -> dict:
    record = {"event": event, "step": int(step), "wall_time_s": round(self.wall_time(), 3)}
    record.update({k: _plain(v) for k, v in values.items()})
    if not self.writer:
      return record
    path = self.run_dir / run_record.SPECTRUM if event == "spectrum" else self.path
    try:
      if event == "spectrum":
        run_record.append_spectrum(self.run_dir, [record])
        return record
      with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    except OSError as e:  # a failed write (a full disk) names its file
      e.filename = e.filename or str(path)
      raise
    if self.wandb is not None:
      self.wandb.log(
        {
          f"{event}/{k}": v
          for k, v in record.items()
          if isinstance(v, (int, float)) and k != "step"
        },
        step=int(step),
      )
    return record

  def close(self) -> None:
    if self.wandb is not None:
      self.wandb.finish()


class Progress:
  """A tqdm bar on a terminal; plain, greppable lines otherwise (CI, log files, SLURM).

  Without a terminal, :meth:`update` prints a train line at its first call and then at most
  every ``interval_s`` seconds (and at the last step)::

    train step 300/7800 (3.8%) loss=3.912 | 2.41 steps/s | ETA 0:51:52

  The rate is measured over the steps since the previous line, so it follows the current
  speed, and the first line (whose interval includes compilation) gives none. A loop whose
  log steps are far apart can ask :meth:`due` whether a line is wanted and call
  :meth:`update` then.
  """

  def __init__(
    self,
    total: int,
    initial: int,
    *,
    interval_s: float = 30.0,
    tty: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.quiet = jax.process_index() != 0  # multi-host: process 0 reports for all
    self.tty = (sys.stderr.isatty() if tty is None else tty) and not self.quiet
    self.total, self.interval_s, self.clock = total, interval_s, clock
    self.last: tuple[int, float] | None = None  # (step, time) of the last plain line
    self.bar = None
    if self.tty:
      from tqdm import tqdm

      self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True)

  def due(self) -> bool:
    """Whether a plain line is wanted now (never on a terminal, where the bar runs)."""
    if self.tty or self.quiet:
      return False
    return self.last is None or self.clock() - self.last[1] >= self.interval_s

  def update(self, step: int, **postfix) -> None:
    if self.bar is not None:
      self.bar.n = step
      self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=True)
    elif self.due() or (step >= self.total and not self.quiet):
      now = self.clock()
      print(self.train_line(step, now, postfix), flush=True)
      self.last = (step, now)

  def train_line(self, step: int, now: float, postfix: dict[str, float]) -> str:
    parts = [f"train step {step}/{self.total} ({100.0 * step / max(self.total, 1):.1f}%)"]
    parts[0] += "".join(f" {k}={v:.4g}" for k, v in postfix.items())
    if self.last is not None and step > self.last[0] and now > self.last[1]:
      rate = (step - self.last[0]) / (now - self.last[1])
      parts.append(f"{rate:.3g} steps/s")
      parts.append(f"ETA {format_duration((self.total - step) / rate)}")
    return " | ".join(parts)

  def line(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(text)
    elif not self.quiet:
      print(text, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def format_duration(seconds: float) -> str:
  """``h:mm:ss`` (days as ``Nd h:mm:ss``)."""
  seconds = max(0, int(round(seconds)))
  days, seconds = divmod(seconds, 86400)
  hours, seconds = divmod(seconds, 3600)
  minutes, seconds = divmod(seconds, 60)
  return (f"{days}d " if days else "") + f"{hours}:{minutes:02d}:{seconds:02d}"


def git_commit() -> str | None:
  """The checkout's HEAD, or ``GINGER_GIT_COMMIT`` when set (a snapshot without ``.git``)."""
  if os.environ.get("GINGER_GIT_COMMIT"):
    return os.environ["GINGER_GIT_COMMIT"]
  try:
    out = subprocess.run(
      ["git", "rev-parse", "HEAD"],
      capture_output=True,
      text=True,
      cwd=Path(__file__).parent,
      timeout=5,
    )
    return out.stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def versions() -> dict[str, str]:
  import flax
  import optax

  out = {
    "python": sys.version.split()[0],
    "jax": jax.__version__,
    "flax": flax.__version__,
    "optax": optax.__version__,
  }
  try:
    import jaxlib

    out["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  return out


def device_info() -> dict[str, Any]:
  dev = jax.devices()[0]
  return {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count()}


def device_memory() -> dict[str, int]:
  """The largest ``bytes_in_use`` and ``peak_bytes_in_use`` of this process's devices (one
  device's figures, also on a mesh); each key absent where the backend does not report it
  (CPU)."""
  out: dict[str, int] = {}
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    for key in ("bytes_in_use", "peak_bytes_in_use"):
      if key in stats:
        out[key] = max(out.get(key, 0), int(stats[key]))
  return out


def peak_memory_bytes() -> int | None:
  """The largest ``peak_bytes_in_use`` of this process's devices; None where the backend does
  not report it (CPU)."""
  return device_memory().get("peak_bytes_in_use")


def d_pass_lines(rc, fisher_backward: str | None) -> list[str]:
  """The start-up's lines on how the d-pass runs: a shared forward's backward
  (``Setup.fisher_backward``), a sub-batch of ``fisher_batch`` examples."""
  from training.steps import fisher_sub_batch

  lines = []
  if fisher_backward is not None:
    lines.append(f"d-pass: shared forward, {fisher_backward} backward")
  if fisher_sub_batch(rc) is not None:
    mode = "inference" if rc.fisher_forward == "eval" else "training"
    lines.append(
      f"d-pass: the batch's first {fisher_sub_batch(rc)} of {rc.batch_size} examples, "
      f"{mode}-mode forward and backward of its own"
    )
  return lines
