"""ROUGE wrapper: agrees with rouge_score's scorer, and a hand-counted case."""

from __future__ import annotations

import pytest

from models.rouge import ROUGE_TYPES, regex_sentences, rouge_scores, sentences_per_line

PREDS = [
  "The council approved a new bridge over the river on Tuesday.",
  "Ashford Rovers beat Brindlemoor 3-1. The coach praised the defence.",
  "Police are investigating a fire at a warehouse.",
]
REFS = [
  "Councillors have approved plans for a bridge across the river.",
  "Ashford Rovers won 3-1 against Brindlemoor on Saturday. Their coach was delighted.",
  "A fire destroyed a warehouse in the town centre, police said.",
]


def test_matches_rouge_score_exactly():
  from rouge_score import rouge_scorer  # here, not at collection (~4 s with nltk)

  scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
  per = [
    scorer.score(sentences_per_line(r), sentences_per_line(p))
    for p, r in zip(PREDS, REFS, strict=True)
  ]
  expected = {t: 100.0 * sum(s[t].fmeasure for s in per) / len(per) for t in ROUGE_TYPES}
  assert rouge_scores(PREDS, REFS) == expected
  # single-sentence pairs: Lsum == L, and both equal the raw scorer's numbers
  one = rouge_scores(PREDS[:1], REFS[:1])
  raw = scorer.score(REFS[0], PREDS[0])
  assert one["rougeLsum"] == one["rougeL"] == 100.0 * raw["rougeL"].fmeasure


def test_hand_counted_case():
  # unigrams: 5 of 6 shared; bigrams: "the cat", "on the", "the mat" = 3 of 5; LCS = 5 tokens
  s = rouge_scores(["the cat sat on the mat"], ["the cat is on the mat"])
  assert s["rouge1"] == pytest.approx(100 * 5 / 6)
  assert s["rouge2"] == pytest.approx(60.0)
  assert s["rougeL"] == pytest.approx(100 * 5 / 6)
  assert rouge_scores(["a b"], ["c d"]) == dict.fromkeys(ROUGE_TYPES, 0.0)
  assert rouge_scores(["Same text here."], ["same text here"])["rouge2"] == pytest.approx(100.0)


def test_sentence_split_and_errors():
  assert regex_sentences('He left. "Then?" she asked! 3 more.\nNew line') == [
    "He left.",
    '"Then?" she asked!',
    "3 more.",
    "New line",
  ]
  assert regex_sentences('He said "Hi." Then left.') == ['He said "Hi."', "Then left."]
  assert sentences_per_line("One here. Two there.") == "One here.\nTwo there."
  with pytest.raises(ValueError):
    rouge_scores(["a"], [])
  with pytest.raises(ValueError):
    rouge_scores([], [])
