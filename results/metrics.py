"""The numbers a table reports: the metrics read from a run's summary.json, their mean ± sample
std over seeds, their text, and the columns that show the paper's number beside ours."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from results.runs import Run, is_number


@dataclass(frozen=True)
class Stat:
  """Mean, sample std (None for fewer than two values) and count of one metric."""

  mean: float | None
  std: float | None
  n: int


def aggregate(values: Iterable[Any]) -> Stat:
  """Mean ± sample std of the numeric values (None and non-numbers are ignored)."""
  xs = [float(v) for v in values if is_number(v)]
  if not xs:
    return Stat(None, None, 0)
  std = statistics.stdev(xs) if len(xs) > 1 else None
  return Stat(statistics.fmean(xs), std, len(xs))


def fmt_num(x: float | None, style: str, signed: bool = False) -> str:
  """Format `x` as "f2"/"f3" (fixed decimals) or "sci" ("2.21e9"); blank for None."""
  if x is None:
    return ""
  if not math.isfinite(x):
    return str(x)
  sign = "+" if signed else ""
  if style == "sci":
    mantissa, exponent = f"{x:{sign}.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"
  return f"{x:{sign}.{int(style[1:])}f}"


def fmt_stat(stat: Stat, style: str) -> str:
  """ "mean ± std", or just the mean for one seed, or blank."""
  if stat.mean is None:
    return ""
  text = fmt_num(stat.mean, style)
  return text if stat.std is None else f"{text} ± {fmt_num(stat.std, style)}"


def summary_number(key: str, scale: float = 1.0) -> Callable[[Run], float | None]:
  """Getter for a top-level summary number, multiplied by `scale`."""

  def get(run: Run) -> float | None:
    value = run.get(key)
    return value * scale if is_number(value) else None

  return get


def is_shared(run: Run) -> bool:
  """Whether the run shared its device (summary.json's ``device_shared``): its accuracy counts,
  its times and memory do not."""
  return bool(run.get("device_shared"))


def number_alone(key: str, scale: float = 1.0) -> Callable[[Run], float | None]:
  """:func:`summary_number` for a time or memory figure: None for a run that shared its device."""
  get = summary_number(key, scale)
  return lambda run: None if is_shared(run) else get(run)


def flops_number(source: str) -> Callable[[Run], float | None]:
  """Getter for flops_per_iter[source] ("analytic" or "xla")."""

  def get(run: Run) -> float | None:
    flops = run.get("flops_per_iter")
    value = flops.get(source) if isinstance(flops, dict) else None
    return value if is_number(value) else None

  return get


def first_number(*keys: str) -> Callable[[Run], float | None]:
  """Getter for the first of `keys` that the summary has as a number."""

  def get(run: Run) -> float | None:
    values = (summary_number(k)(run) for k in keys)
    return next((v for v in values if v is not None), None)

  return get


primary_number = first_number(
  "best_val_accuracy", "rougeL"
)  # image runs: accuracy; seq2seq: ROUGE-L


@dataclass(frozen=True)
class Metric:
  """One reported number: label, getter (display units), paper CSV column, format style, and
  the part of a table too wide for one (results.render.MAX_COLUMNS) it goes to
  (:data:`QUALITY`, ...)."""

  label: str
  value: Callable[[Run], float | None]
  paper_key: str | None
  style: str
  paired: bool = True  # False: only our column (no paper/difference columns)
  part: str = ""


# The parts a table wider than render.MAX_COLUMNS is split into, by what its columns measure.
QUALITY = "accuracy and loss"
COST = "cost"
ROUGE = "ROUGE"
PERPLEXITY_AND_COST = "perplexity and cost"


@dataclass(frozen=True)
class PaperColumns:
  """How a table shows the paper's number beside ours: the paper column's sub-label ("" for
  no paper column) and whether the difference ours - paper follows it. Only a table of the
  paper's own settings has the difference: between other settings it would be noise."""

  label: str = "paper"
  delta: bool = True


SAME_SETTINGS = PaperColumns()
NO_PAPER = PaperColumns("", delta=False)


def paper_beside(setting: str) -> PaperColumns:
  """The paper's number beside ours, labelled with the paper's setting ("paper (CIFAR-100,
  200 ep.)"), without a difference: a table of other settings (NOT COMPARABLE)."""
  return PaperColumns(f"paper ({setting})", delta=False)


# The training step's own memory (summary.json's step_memory_bytes: XLA's memory analysis of the
# compiled step), beside "Mem GB", the process's lifetime high-water mark, which also holds
# compilation and autotuning scratch and the evaluation's memory (T5-small full, Ginger tau 32,
# one H100: 16.2 GB, set by evaluation, against the step's 10.1 GB; 21.2 GB while the loop built
# the state before compiling, the extra XLA's autotuning).
# Ours only: the paper reports one peak (PyTorch's). Blank where summary.json lacks it.
MEMORY_CAPTION = (
  "memory in GB (bytes/1e9): Mem = the process's peak (compilation and autotuning included), "
  "Step = the training step's own (XLA's memory analysis)."
)
STEP_MEMORY = Metric(
  "Step GB", number_alone("step_memory_bytes", 1e-9), None, "f2", paired=False, part=COST
)


def image_metrics(flops: str = "analytic") -> list[Metric]:
  """Table 1's columns for one model."""
  return [
    Metric("Acc", summary_number("best_val_accuracy"), "acc", "f2", part=QUALITY),
    Metric("Val loss", summary_number("val_loss_at_best"), "val_loss", "f3", part=QUALITY),
    Metric(
      "Train loss 1e-6",
      summary_number("min_train_loss", 1e6),
      "min_train_loss_1e-6",
      "f2",
      part=QUALITY,
    ),
    Metric(f"FLOPs ({flops})", flops_number(flops), "flops_per_iter", "sci", part=COST),
    Metric("Mem GB", number_alone("peak_memory_bytes", 1e-9), "peak_mem_gb", "f2", part=COST),
    STEP_MEMORY,
  ]


def xsum_metrics(flops: str = "analytic") -> list[Metric]:
  """Table 2's columns for one setting."""
  cost = PERPLEXITY_AND_COST
  return [
    Metric("R1", summary_number("rouge1"), "rouge1", "f2", part=ROUGE),
    Metric("R2", summary_number("rouge2"), "rouge2", "f2", part=ROUGE),
    Metric("RL", summary_number("rougeL"), "rougeL", "f2", part=ROUGE),
    Metric("Train ppl", summary_number("train_perplexity"), "train_ppl", "f3", part=cost),
    Metric(f"FLOPs ({flops})", flops_number(flops), "flops_per_iter", "sci", part=cost),
    Metric("Mem GB", number_alone("peak_memory_bytes", 1e-9), "peak_mem_gb", "f2", part=cost),
    replace(STEP_MEMORY, part=cost),
  ]


def metric_cells(
  runs: Sequence[Run],
  metric: Metric,
  paper: dict[str, str] | None,
  columns: PaperColumns = SAME_SETTINGS,
) -> list[str]:
  """[ours, paper, ours - paper] for a paired metric (the paper's cells as ``columns`` has
  them), [ours] otherwise."""
  stat = aggregate(metric.value(r) for r in runs)
  ours = fmt_stat(stat, metric.style)
  if not metric.paired:
    return [ours]
  theirs = (paper or {}).get(metric.paper_key or "", "") or ""
  diff = ""
  if stat.mean is not None and theirs:
    diff = fmt_num(stat.mean - float(theirs), metric.style, signed=True)
  return [ours] + [theirs] * bool(columns.label) + [diff] * columns.delta


UNITS = (
  "ours = mean ± sample std over n seeds (no std for one seed); paper = the paper's number; "
  "Δ = ours - paper; blank = no completed run."
)


def units(paper: PaperColumns, seeds: str = "n seeds") -> str:
  """The caption's last sentence: what ours, paper and Δ are (``seeds``: where n is said)."""
  ours = f"ours = mean ± sample std over {seeds} (no std for one seed)"
  if paper.delta:
    return UNITS.replace("n seeds", seeds)
  if paper.label:
    return (
      f"{ours}; {paper.label} = the paper's number in its own setting, beside ours for the shape "
      "only: the settings differ, so no difference ours - paper is given; blank = no completed run."
    )
  return f"{ours}; blank = no completed run."
