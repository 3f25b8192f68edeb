"""metrics.jsonl on resume: cut back to the checkpoint's step; a write cut short is dropped,
any other damage names the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from training import run_record
from training.logs import MetricsLog

NONE = SimpleNamespace(name="none")


def write(run_dir: Path, text: str) -> None:
  (run_dir / run_record.METRICS).write_text(text)


def events(run_dir: Path) -> list[dict]:
  return list(run_record.read_events(run_dir, strict=True))


def lines(*steps: int) -> str:
  return "".join(json.dumps({"event": "train", "step": s, "wall_time_s": s}) + "\n" for s in steps)


def test_resume_keeps_events_up_to_the_checkpoint(tmp_path: Path) -> None:
  write(tmp_path, lines(1, 2, 3, 4))
  log = MetricsLog(tmp_path, NONE, {}, resume_step=2)
  assert [e["step"] for e in events(tmp_path)] == [1, 2] and log.wall_offset == 2


def test_a_write_cut_short_is_dropped(tmp_path: Path) -> None:
  write(tmp_path, lines(1, 2) + '{"event": "train", "st')  # killed mid-write
  MetricsLog(tmp_path, NONE, {}, resume_step=2)
  assert [e["step"] for e in events(tmp_path)] == [1, 2]


def test_a_damaged_line_in_the_middle_names_file_and_line(tmp_path: Path) -> None:
  write(tmp_path, lines(1) + "not json\n" + lines(2))
  with pytest.raises(run_record.RunDirError, match=r"metrics.jsonl, line 2"):
    MetricsLog(tmp_path, NONE, {}, resume_step=2)
