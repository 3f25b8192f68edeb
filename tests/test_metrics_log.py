"""metrics.jsonl on resume: cut back to the checkpoint's step; a write cut short is dropped,
any other damage names the file and line. Spectrum events go to spectrum.jsonl.gz, cut back
alike."""

from __future__ import annotations

import gzip
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


def log_steps(log: MetricsLog, start: int, stop: int) -> None:
  """A train and a spectrum event at each step, as the loop writes them."""
  for step in range(start, stop + 1):
    log.write("train", step, train_loss=1.0 / step)
    log.write("spectrum", step, sigma={"w": [float(step), 0.5]})


def logged(run_dir: Path) -> list[list[dict]]:
  """metrics.jsonl's events and spectrum.jsonl.gz's (read by gzip), without wall times."""
  with gzip.open(run_dir / run_record.SPECTRUM, "rt") as f:
    spectrum = [json.loads(line) for line in f]
  return [
    [{k: v for k, v in e.items() if k != "wall_time_s"} for e in part]
    for part in (events(run_dir), spectrum)
  ]


def test_spectrum_events_go_to_their_own_file_and_resume_like_the_rest(tmp_path: Path) -> None:
  """An uninterrupted log and one stopped after step 3, resumed from the checkpoint of step 2
  and run to the end hold the same events (wall clock aside); the resumed run's spectrum is
  appended to the file as a second gzip member, which gzip itself reads back whole."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  straight.mkdir()
  resumed.mkdir()
  log_steps(MetricsLog(straight, NONE, {}, None), 1, 4)
  log_steps(MetricsLog(resumed, NONE, {}, None), 1, 3)
  log = MetricsLog(resumed, NONE, {}, resume_step=2)
  spectrum = resumed / run_record.SPECTRUM
  last = json.loads(gzip.decompress(spectrum.read_bytes()).splitlines()[-1])
  assert last["step"] == 2 and log.wall_offset == last["wall_time_s"]  # the later of step 2's
  log_steps(log, 3, 4)
  metrics, gz = logged(resumed)
  assert [metrics, gz] == logged(straight)
  assert [e["event"] for e in metrics] == ["train"] * 4
  assert [e["step"] for e in gz] == [1, 2, 3, 4] and gz[-1]["sigma"] == {"w": [4.0, 0.5]}
  assert [e["step"] for e in run_record.read_spectrum(resumed, strict=True)] == [1, 2, 3, 4]
  MetricsLog(resumed, NONE, {}, None)  # a fresh start drops both files
  assert not spectrum.exists() and not (resumed / run_record.METRICS).exists()
