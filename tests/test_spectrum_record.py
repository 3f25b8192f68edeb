"""spectrum.jsonl.gz: the "spectrum" events of a run dir, gzipped JSON lines, one gzip member per
write. Written, appended, read back and cut back on resume (training/run_record.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from training import run_record


def spectrum(step: int) -> dict:
  return {"event": "spectrum", "step": step, "wall_time_s": 0.5 + step, "sigma": {"w": [step, 1]}}


def train(step: int) -> dict:
  return {"event": "train", "step": step, "wall_time_s": float(step), "train_loss": 1.0 / step}


def jsonl(events: list[dict]) -> str:
  return "".join(json.dumps(e) + "\n" for e in events)


def steps(run_dir: Path, **kw) -> list[int]:
  return [e["step"] for e in run_record.read_spectrum(run_dir, **kw)]


def test_appends_read_back_whole_also_by_gzip(tmp_path: Path) -> None:
  """Each append is one more gzip member; gzip.open reads the members as one stream, so the
  file written before a resume and the events appended after it read back together."""
  run_record.append_spectrum(tmp_path, [spectrum(1), spectrum(2)])
  run_record.append_spectrum(tmp_path, [spectrum(3)])  # as a resumed run does
  run_record.append_spectrum(tmp_path, [])  # nothing to write: no empty member
  path = tmp_path / run_record.SPECTRUM
  with gzip.open(path, "rt") as f:
    assert [json.loads(line) for line in f] == [spectrum(1), spectrum(2), spectrum(3)]
  assert list(run_record.read_spectrum(tmp_path, strict=True)) == [spectrum(s) for s in (1, 2, 3)]
  assert path.read_bytes().count(b"\x1f\x8b\x08") == 2  # two members (gzip magic + deflate)


def test_same_events_give_the_same_bytes(tmp_path: Path) -> None:
  """mtime=0 in the gzip header: rewriting the same record gives the same file."""
  a, b = tmp_path / "a", tmp_path / "b"
  for run_dir in (a, b):
    run_dir.mkdir()
    run_record.append_spectrum(run_dir, [spectrum(1)])
  assert (a / run_record.SPECTRUM).read_bytes() == (b / run_record.SPECTRUM).read_bytes()


def test_a_member_cut_short_is_dropped_or_named(tmp_path: Path) -> None:
  """A write killed mid-way leaves its member cut short: lenient readers drop it (the members
  before it are whole), strict ones name the file."""
  run_record.append_spectrum(tmp_path, [spectrum(1)])
  path = tmp_path / run_record.SPECTRUM
  whole = path.read_bytes()
  run_record.append_spectrum(tmp_path, [spectrum(2)])
  path.write_bytes(path.read_bytes()[:-5])  # the second member lacks part of its trailer
  assert steps(tmp_path) == [1]
  with pytest.raises(run_record.RunDirError, match=r"spectrum.jsonl.gz: a last gzip member cut"):
    steps(tmp_path, strict=True)
  path.write_bytes(whole + b"not gzip at all")
  assert steps(tmp_path) == [1]
  with pytest.raises(run_record.RunDirError, match=r"damaged gzip member at byte"):
    steps(tmp_path, strict=True)


def test_a_damaged_line_names_file_and_line(tmp_path: Path) -> None:
  path = tmp_path / run_record.SPECTRUM
  path.write_bytes(gzip.compress((jsonl([spectrum(1)]) + "not json\n").encode(), mtime=0))
  assert steps(tmp_path) == [1]
  with pytest.raises(run_record.RunDirError, match=r"spectrum.jsonl.gz, line 2: not JSON"):
    steps(tmp_path, strict=True)


def test_keep_spectrum_cuts_back_to_the_checkpoint(tmp_path: Path) -> None:
  """On resume from step 2, the events after it are dropped (the resumed run writes them
  again); a member cut short is dropped; nothing to drop leaves the file as it is."""
  path = tmp_path / run_record.SPECTRUM
  assert run_record.keep_spectrum(tmp_path, 2) == [] and not path.exists()
  for step in (1, 2, 3, 4):
    run_record.append_spectrum(tmp_path, [spectrum(step)])
  before = path.read_bytes()
  assert run_record.keep_spectrum(tmp_path, 4) == [spectrum(s) for s in (1, 2, 3, 4)]
  assert path.read_bytes() == before
  assert run_record.keep_spectrum(tmp_path, 2) == [spectrum(1), spectrum(2)]
  assert steps(tmp_path, strict=True) == [1, 2]
  run_record.append_spectrum(tmp_path, [spectrum(3)])  # the resumed run goes on
  path.write_bytes(path.read_bytes()[:-3])  # and is killed in its next write
  assert run_record.keep_spectrum(tmp_path, 3) == [spectrum(1), spectrum(2)]
  assert steps(tmp_path, strict=True) == [1, 2]
  assert run_record.keep_spectrum(tmp_path, 0) == [] and not path.exists()


def test_keep_spectrum_refuses_damage_and_leaves_the_file(tmp_path: Path) -> None:
  path = tmp_path / run_record.SPECTRUM
  run_record.append_spectrum(tmp_path, [spectrum(1), spectrum(2)])
  path.write_bytes(damaged := path.read_bytes() + b"\x1f\x8b\x08garbage-garbage-garbage")
  with pytest.raises(run_record.RunDirError, match=r"damaged gzip member"):
    run_record.keep_spectrum(tmp_path, 1)
  assert path.read_bytes() == damaged
