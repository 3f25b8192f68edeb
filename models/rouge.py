"""ROUGE-1/2/L/Lsum for generated summaries, via Google's ``rouge-score`` package.

Scores are per-example F-measures (``use_stemmer=True``) averaged over the corpus and reported in
percent, the numbers summarization papers (and the paper's Table 2) quote. We take the plain mean
rather than ``rouge_score``'s bootstrap aggregator so the result is deterministic.

ROUGE-Lsum treats newlines as sentence boundaries, so both sides are split into one sentence a
line first, as Hugging Face's summarization examples do: with NLTK's punkt model when its data is
installed (``nltk.download("punkt_tab")``; it cannot be downloaded offline), otherwise with a
regex that breaks after ``.``, ``!`` or ``?`` (optionally closed by a quote or bracket) followed
by whitespace and an upper-case letter, digit or opening quote. The fallback misses abbreviations
such as "Mr. Smith"; it only affects ROUGE-Lsum, and XSUM summaries are single sentences anyway.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from rouge_score import rouge_scorer

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")


def regex_sentences(text: str) -> list[str]:
  """Sentence split without NLTK data (see the module docstring for its rule)."""
  out = []
  for line in text.strip().splitlines():
    pieces = _SENTENCE_END.split(line.strip())
    out.extend(p.strip() for p in pieces if p.strip())
  return out


@functools.cache
def _sentence_splitter() -> Callable[[str], list[str]]:
  """NLTK's punkt if its data is on disk, else the regex; decided once per process."""
  try:
    import nltk

    for resource in ("tokenizers/punkt_tab/english/", "tokenizers/punkt"):
      try:
        nltk.data.find(resource)
      except LookupError:
        continue
      nltk.sent_tokenize("Probe. Sentence.")
      return lambda text: [
        s for line in text.strip().splitlines() for s in nltk.sent_tokenize(line)
      ]
  except Exception:  # noqa: BLE001 - any NLTK problem means "use the regex"
    pass
  return regex_sentences


def sentences_per_line(text: str) -> str:
  """``text`` with one sentence per line, the input format ROUGE-Lsum expects."""
  return "\n".join(_sentence_splitter()(text))


@functools.cache
def _scorer() -> rouge_scorer.RougeScorer:
  # Imported here: rouge_score imports nltk and scipy.stats (~4 s), which only evaluation needs.
  from rouge_score import rouge_scorer

  return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
  """Mean ROUGE-1/2/L/Lsum F-measures in percent: {"rouge1": ..., ..., "rougeLsum": ...}."""
  if len(predictions) != len(references):
    raise ValueError(f"{len(predictions)} predictions vs {len(references)} references")
  if not predictions:
    raise ValueError("rouge_scores needs at least one prediction")
  totals = dict.fromkeys(ROUGE_TYPES, 0.0)
  for pred, ref in zip(predictions, references, strict=True):
    scores = _scorer().score(sentences_per_line(ref), sentences_per_line(pred))
    for name in ROUGE_TYPES:
      totals[name] += scores[name].fmeasure
  return {name: 100.0 * total / len(predictions) for name, total in totals.items()}
