"""Run records packed into archives (results/records.py): an archived run reads back as the run
dir it was packed from, re-adding replaces by path, packing is byte-stable, and every reader
(tables, plots, compare) takes archives as it takes run dirs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from results import compare, plots, records, tables
from training import run_record

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "cifar10" / "runs"
EXPERIMENT = "cifar10_resnet18_30ep"
LIMIT_BYTES = 2_000_000  # 2 MB: no committed file reaches it


def spectrum(step: int) -> dict:
  return {"event": "spectrum", "step": step, "sigma": {"conv/kernel": [3.0 / step, 1.0 / step]}}


def make_run(root: Path, name: str, seed: int = 0, accuracy: float = 80.0, **fields) -> Path:
  """A run dir with every file a finished run has: summary.json (its mtime set), run.json,
  metrics.jsonl, spectrum.jsonl.gz (two gzip members), .hydra/{config,overrides}.yaml and
  train.log."""
  run_dir = root / name
  (run_dir / ".hydra").mkdir(parents=True)
  run = {"experiment": EXPERIMENT, "optimizer": "ginger", "tau": 4, "alpha": 0.99, "lr": 5e-4}
  run |= {"seed": seed, "model": "resnet18", "dataset": "cifar10", "sweep": "table1"} | fields
  config = {"seed": seed, "epochs": 30, "max_steps": None, "optimizer": {"name": "ginger"}}
  summary = {"run": run, "config": config, "status": "completed", "best_val_accuracy": accuracy}
  summary |= {"min_train_loss": 0.01, "device": {"kind": "NVIDIA H200"}, "git_commit": "abc"}
  (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
  os.utime(run_dir / "summary.json", (1.7e9 + seed, 1.7e9 + seed))
  (run_dir / "run.json").write_text(json.dumps({"version": 1, "fingerprint": "f", "config": {}}))
  events = [
    {"event": "train", "step": 10, "wall_time_s": 1.5, "train_loss": 2.0},
    {"event": "eval", "step": 20, "wall_time_s": 3.0, "val_accuracy": accuracy, "val_loss": 0.5},
  ]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  run_record.append_spectrum(run_dir, [spectrum(1), spectrum(2)])
  run_record.append_spectrum(run_dir, [spectrum(3), spectrum(4)])
  (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\nlr: ${best_lr.lr}\n")
  (run_dir / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n- +sweep=table1\n")
  (run_dir / "train.log").write_text("step 20/20 val_accuracy=80.0\n")
  return run_dir


@pytest.fixture
def campaign(tmp_path: Path) -> Path:
  """runs/table1/cifar10_resnet18_30ep/{ginger,adam}/seed=N: three run dirs."""
  folder = tmp_path / "runs" / "table1" / EXPERIMENT
  make_run(folder, "ginger/seed=0")
  make_run(folder, "ginger/seed=1", seed=1, accuracy=82.0)
  make_run(folder, "adam/seed=0", accuracy=78.0, optimizer="adam", tau=None, alpha=None)
  return tmp_path / "runs"


def archive_of(runs: Path) -> Path:
  return runs / "table1" / (EXPERIMENT + records.SUFFIX)


def pack(runs: Path) -> Path:
  """Packs runs/table1/<experiment>/'s run dirs into its archive and deletes them."""
  folder = runs / "table1" / EXPERIMENT
  records.add(archive_of(runs), tables.find_run_dirs([folder]))
  shutil.rmtree(folder)
  return archive_of(runs)


def everything(runs: Path) -> dict:
  """What every reader takes from the run dirs under ``runs``."""
  dirs = tables.find_run_dirs([runs])
  series = {str(d): plots.read_series(d) for d in dirs}
  return {
    "dirs": dirs,
    "summaries": [records.read_summary(d) for d in dirs],
    "events": [list(records.read_events(d)) for d in dirs],
    "spectra": [list(records.read_spectrum(d)) for d in dirs],
    "runs": tables.collect_runs([runs]),
    "series": {
      k: (s.train, s.eval, s.eval_metric, s.spectrum_steps, s.spectrum) for k, s in series.items()
    },
    "compare": compare.rows(runs),
  }


def assert_same(a: dict, b: dict) -> None:
  for key in a:
    if key == "series":
      for name, (train, evals, *rest) in a[key].items():
        other = b[key][name]
        for mine, theirs in ((train, other[0]), (evals, other[1])):
          assert mine.keys() == theirs.keys()
          assert all(np.array_equal(mine[k], theirs[k], equal_nan=True) for k in mine)
        assert rest == list(other[2:])
    else:
      assert a[key] == b[key], key


def test_an_archived_run_reads_as_its_run_dir(campaign: Path) -> None:
  """summary, resolved config, metrics, spectrum (both files, in order), mtime, and what the
  tables, plots and compare make of them: the same objects, at the same paths."""
  plain = everything(campaign)
  ginger = campaign / "table1" / EXPERIMENT / "ginger" / "seed=0"
  assert [e["step"] for e in plain["spectra"][1]] == [1, 2, 3, 4]
  archive = pack(campaign)
  assert sorted(p.name for p in archive.parent.iterdir()) == [archive.name]
  archived = everything(campaign)
  assert_same(plain, archived)
  assert archived["dirs"] == [
    campaign / "table1" / EXPERIMENT / name
    for name in ("adam/seed=0", "ginger/seed=0", "ginger/seed=1")
  ]
  assert [r["mtime"] for r in archived["runs"]] == [1.7e9, 1.7e9, 1.7e9 + 1]
  assert records.read_summary(ginger)["config"]["optimizer"] == {"name": "ginger"}
  line = records.read_run(ginger)
  assert list(line) == list(records.KEYS)
  assert line["path"] == f"{EXPERIMENT}/ginger/seed=0"
  assert line["hydra"] == {
    "config.yaml": "seed: 0\nlr: ${best_lr.lr}\n",
    "overrides.yaml": "- seed=0\n- +sweep=table1\n",
  }
  assert line["record"]["fingerprint"] == "f" and line["train_log"].startswith("step 20/20")
  assert [e["step"] for e in line["spectrum"]] == [1, 2, 3, 4]
  # The archive itself as a root, and as the plots' run list.
  assert tables.find_run_dirs([archive]) == archived["dirs"]
  assert [i.path for i in plots.load_runs([archive])] == archived["dirs"]


def test_a_plain_run_dir_wins_over_its_archived_copy(campaign: Path) -> None:
  archive = pack(campaign)
  ginger = campaign / "table1" / EXPERIMENT / "ginger" / "seed=0"
  records.extract(archive, archive.parent, [f"{EXPERIMENT}/ginger/seed=0"])
  summary = json.loads((ginger / "summary.json").read_text())
  (ginger / "summary.json").write_text(json.dumps(summary | {"best_val_accuracy": 99.0}))
  dirs = tables.find_run_dirs([campaign])
  assert len(dirs) == 3 and records.locate(ginger) is None
  assert records.read_summary(ginger)["best_val_accuracy"] == 99.0
  assert records.locate(campaign / "table1" / EXPERIMENT / "ginger" / "seed=1") == (
    archive,
    f"{EXPERIMENT}/ginger/seed=1",
  )
  assert records.locate(campaign / "table1" / EXPERIMENT / "ginger" / "seed=7") is None


def test_re_adding_a_run_replaces_it(campaign: Path) -> None:
  folder = campaign / "table1" / EXPERIMENT
  archive = archive_of(campaign)
  assert records.add(archive, [folder / "ginger" / "seed=0"]) == [
    (f"{EXPERIMENT}/ginger/seed=0", False)
  ]
  first = archive.read_bytes()
  shutil.rmtree(folder / "ginger" / "seed=0")
  make_run(folder, "ginger/seed=0", accuracy=90.0)  # a rerun
  added = records.add(archive, [folder / "ginger" / "seed=0", folder / "adam" / "seed=0"])
  assert added == [(f"{EXPERIMENT}/ginger/seed=0", True), (f"{EXPERIMENT}/adam/seed=0", False)]
  assert archive.read_bytes() != first
  runs = list(records.read_archive(archive))
  assert [r["path"] for r in runs] == [f"{EXPERIMENT}/adam/seed=0", f"{EXPERIMENT}/ginger/seed=0"]
  assert runs[1]["summary"]["best_val_accuracy"] == 90.0
  shutil.rmtree(folder)
  ginger = folder / "ginger" / "seed=0"
  assert records.read_summary(ginger)["best_val_accuracy"] == 90.0  # the cache saw the rewrite


def test_packing_is_byte_stable(campaign: Path, tmp_path: Path) -> None:
  """The same run dirs give the same bytes, in any order and added in any number of steps;
  extracting an archive and packing the run dirs it writes gives its bytes again."""
  dirs = tables.find_run_dirs([campaign])
  one, two = (
    tmp_path / "a" / (EXPERIMENT + records.SUFFIX),
    tmp_path / "b" / (EXPERIMENT + records.SUFFIX),
  )
  records.add(one, dirs)
  records.add(two, dirs[::-1][:1])
  records.add(two, dirs[::-1][1:])
  assert one.read_bytes() == two.read_bytes()
  assert one.read_bytes()[4:8] == b"\0\0\0\0"  # the gzip header's time
  records.add(one, dirs[:1])  # re-adding an unchanged run changes nothing
  assert one.read_bytes() == two.read_bytes()
  written = records.extract(one, tmp_path / "extracted")
  assert written == [
    tmp_path / "extracted" / p
    for p in sorted(str(d.relative_to(campaign / "table1")) for d in dirs)
  ]
  again = tmp_path / "c" / (EXPERIMENT + records.SUFFIX)
  records.add(again, written)
  assert again.read_bytes() == one.read_bytes()
  with pytest.raises(records.ArchiveError, match="refusing to overwrite"):
    records.extract(one, tmp_path / "extracted")


def test_stored_paths_start_at_the_folder_the_archive_stands_for(tmp_path: Path) -> None:
  run_dir = make_run(tmp_path / "multirun" / "table1" / EXPERIMENT, "adam/seed=2", seed=2)
  archive = tmp_path / "results" / (EXPERIMENT + records.SUFFIX)
  assert records.stored_path(run_dir, archive) == f"{EXPERIMENT}/adam/seed=2"
  elsewhere = tmp_path / "results" / ("mine" + records.SUFFIX)
  with pytest.raises(records.ArchiveError, match="no folder named 'mine'.*--root"):
    records.stored_path(run_dir, elsewhere)
  assert records.stored_path(run_dir, elsewhere, tmp_path / "multirun") == (
    f"mine/table1/{EXPERIMENT}/adam/seed=2"
  )
  with pytest.raises(records.ArchiveError, match="not below --root"):
    records.stored_path(run_dir, elsewhere, tmp_path / "outputs")
  with pytest.raises(records.ArchiveError, match="ends with .runs.jsonl.gz"):
    records.stored_path(run_dir, tmp_path / "runs.jsonl")
  with pytest.raises(records.ArchiveError, match="not a run dir"):
    records.add(archive, [tmp_path])
  assert not archive.exists()  # nothing written when one run dir cannot be packed


def test_a_damaged_archive_is_an_error_naming_it(
  campaign: Path, capsys: pytest.CaptureFixture
) -> None:
  archive = pack(campaign)
  archive.write_bytes(archive.read_bytes()[:-20])
  with pytest.raises(records.ArchiveError, match=str(archive)):
    tables.find_run_dirs([campaign])
  assert tables.main([str(campaign), "--out", str(campaign.parent / "out")]) == 2
  assert f"error: {archive}: not a readable archive" in capsys.readouterr().err


def test_command_line(campaign: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
  folder = campaign / "table1" / EXPERIMENT
  archive = archive_of(campaign)
  run_dirs = [str(folder / "ginger" / "seed=0"), str(folder / "adam" / "seed=0")]
  assert records.main(["add", str(archive), *run_dirs]) == 0
  assert capsys.readouterr().out == (
    f"added {EXPERIMENT}/ginger/seed=0\nadded {EXPERIMENT}/adam/seed=0\n"
  )
  assert records.main(["add", str(archive), run_dirs[0]]) == 0
  assert capsys.readouterr().out == f"replaced {EXPERIMENT}/ginger/seed=0\n"
  _lists_both_and_extracts_one(archive, folder, tmp_path / "out", capsys, "adam", "ginger")
  assert records.main(["add", str(archive), str(tmp_path / "missing")]) == 2
  assert "not a run dir" in capsys.readouterr().err


def test_committed_records_are_archives() -> None:
  """results/cifar10/runs/ holds archives only (the tables and plots read them:
  tests/test_results_tables.py), a few per campaign, each run dir once. Every run completed,
  but for lr_tune candidates that diverged: kept, as sweeps.best_lr counts them."""
  files = sorted(p for p in COMMITTED.rglob("*") if p.is_file())
  assert files and all(records.is_archive(p) for p in files)
  for campaign in COMMITTED.iterdir():
    assert len(list(campaign.iterdir())) <= 20
  dirs = tables.find_run_dirs([COMMITTED])
  assert len(dirs) == len(set(dirs)) >= 254
  for d in dirs:
    summary = records.read_summary(d)
    if summary["status"] != "completed":
      assert summary["config"]["sweep"] == "lr_tune", d
      assert (summary["status"], summary["error"][:32]) == (
        "failed",
        "the training loss became NaN/Inf",
      ), d


def test_committed_records_carry_what_train_py_records() -> None:
  """Every committed run says what it ran with, as train.py writes it now: its summary's "run"
  block has every field of run_record.identity, equal to what its config gives, and its
  run.json (where it has one) the fingerprint and fingerprinted config of that config. The
  tables read no default for a field a record lacks."""
  runs = [
    line
    for archive in sorted(COMMITTED.rglob("*" + records.SUFFIX))
    for line in records.read_archive(archive)
  ]
  assert len(runs) >= 161
  for line in runs:
    summary, record = line["summary"], line["record"]
    identity = run_record.identity(summary["config"])
    assert {k: summary["run"].get(k, "<absent>") for k in identity} == identity, line["path"]
    if record is not None:
      assert record["fingerprint"] == run_record.fingerprint(summary["config"]), line["path"]
      assert record["config"] == run_record.fingerprinted(summary["config"]), line["path"]


def lines_but_path(archive: Path) -> dict[str, dict]:
  """{path as ``archive`` stores it: the line without its path} of a split archive or not."""
  lines = {}
  for path, (member, stored) in records.runs_of(archive).items():
    line = json.loads(records._lines(member)[stored].line)
    assert line.pop("path") == stored
    lines[path] = line
  return lines


def test_a_split_archive_reads_as_the_archive(campaign: Path) -> None:
  """An archive split into one archive per arm, and an arm's archive split again into one per
  seed: every reader sees the same run dirs, each line the same but for its path, and the
  archive's name still names them all (as a root, and to list, extract and add)."""
  archive = pack(campaign)
  before, lines, unsplit = everything(campaign), lines_but_path(archive), archive.read_bytes()
  folder = campaign / "table1" / EXPERIMENT
  assert records.split(archive) == [
    folder / "adam.runs.jsonl.gz",
    folder / "ginger.runs.jsonl.gz",
  ]
  assert not archive.exists()
  ginger = folder / "ginger" / "seed=1"
  assert records.locate(ginger) == (folder / "ginger.runs.jsonl.gz", "ginger/seed=1")
  assert_same(before, everything(campaign))
  records.split(folder / "ginger.runs.jsonl.gz")
  assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
    "adam.runs.jsonl.gz",
    "ginger/seed=0.runs.jsonl.gz",
    "ginger/seed=1.runs.jsonl.gz",
  ]
  assert records.locate(ginger) == (folder / "ginger" / "seed=1.runs.jsonl.gz", "seed=1")
  assert_same(before, everything(campaign))
  assert lines_but_path(archive) == lines
  assert tables.find_run_dirs([archive]) == before["dirs"]
  assert [i.path for i in plots.load_runs([archive])] == before["dirs"]
  # Extracting the split archive by its name, then packing, gives the unsplit archive's bytes.
  written = records.extract(archive, campaign.parent / "extracted")
  assert written == [campaign.parent / "extracted" / p for p in lines]
  again = campaign.parent / "again" / archive.name
  records.add(again, written)
  assert again.read_bytes() == unsplit


def test_a_split_archive_refuses_what_it_cannot_split(campaign: Path) -> None:
  """An arm that has an archive already, a run at the archive's folder itself; and an archive
  that is neither a file nor split is named as missing."""
  archive = pack(campaign)
  folder = campaign / "table1" / EXPERIMENT
  records.extract(archive, campaign / "table1", [f"{EXPERIMENT}/adam/seed=0"])
  records.add(folder / "adam.runs.jsonl.gz", [folder / "adam" / "seed=0"])
  with pytest.raises(records.ArchiveError, match="refusing to overwrite .*adam.runs.jsonl.gz"):
    records.split(archive)
  assert archive.exists()
  whole = campaign / "whole" / ("seed=0" + records.SUFFIX)
  records.add(whole, [folder / "adam" / "seed=0"], root=folder / "adam" / "seed=0")
  with pytest.raises(records.ArchiveError, match="is the folder itself"):
    records.split(whole)
  with pytest.raises(records.ArchiveError, match="no such archive"):
    records.extract(campaign / ("missing" + records.SUFFIX), campaign / "out")


def test_adding_to_a_split_archive_goes_to_each_run_s_archive(campaign: Path) -> None:
  """``add`` by the archive's name after a split: a rerun replaces the run in the archive that
  holds it, a new seed of an arm joins the arm's archive (or gets its own beside its split
  arm's), a new arm gets its own archive; no archive of the whole folder comes back."""
  folder = campaign / "table1" / EXPERIMENT
  archive = archive_of(campaign)
  records.split(pack(campaign))
  records.split(folder / "ginger.runs.jsonl.gz")
  multirun = campaign.parent / "multirun" / "table1" / EXPERIMENT  # where new runs are
  make_run(multirun, "ginger/seed=0", accuracy=90.0)  # a rerun
  make_run(multirun, "ginger/seed=2", seed=2)
  make_run(multirun, "adam/seed=1", seed=1, optimizer="adam", tau=None, alpha=None)
  make_run(multirun, "momentum/seed=0", optimizer="momentum", tau=None, alpha=None)
  new = [multirun / n for n in ("ginger/seed=0", "ginger/seed=2", "adam/seed=1", "momentum/seed=0")]
  assert records.add(archive, new) == [
    (f"{EXPERIMENT}/ginger/seed=0", True),
    (f"{EXPERIMENT}/ginger/seed=2", False),
    (f"{EXPERIMENT}/adam/seed=1", False),
    (f"{EXPERIMENT}/momentum/seed=0", False),
  ]
  assert not archive.exists()
  assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
    "adam.runs.jsonl.gz",
    "ginger/seed=0.runs.jsonl.gz",
    "ginger/seed=1.runs.jsonl.gz",
    "ginger/seed=2.runs.jsonl.gz",
    "momentum.runs.jsonl.gz",
  ]
  assert [r["path"] for r in records.read_archive(folder / "adam.runs.jsonl.gz")] == [
    "adam/seed=0",
    "adam/seed=1",
  ]
  assert records.read_summary(folder / "ginger" / "seed=0")["best_val_accuracy"] == 90.0
  assert len(tables.find_run_dirs([campaign])) == 6


def test_command_line_on_a_split_archive(
  campaign: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
  folder = campaign / "table1" / EXPERIMENT
  archive = archive_of(campaign)
  assert records.main(["add", str(archive), str(folder / "adam" / "seed=0")]) == 0
  capsys.readouterr()
  assert records.main(["split", str(archive)]) == 0
  assert capsys.readouterr().out == f"wrote {folder / 'adam.runs.jsonl.gz'}: 1 runs\n"
  run_dirs = [str(folder / "ginger" / "seed=0"), str(folder / "adam" / "seed=0")]
  assert records.main(["add", str(archive), *run_dirs]) == 0
  out, err = capsys.readouterr()
  assert out == f"added {EXPERIMENT}/ginger/seed=0\nreplaced {EXPERIMENT}/adam/seed=0\n"
  assert (
    err == f"{folder / 'adam.runs.jsonl.gz'}: 1 runs\n{folder / 'ginger.runs.jsonl.gz'}: 1 runs\n"
  )
  _lists_both_and_extracts_one(archive, folder, tmp_path / "out", capsys, "ginger", "adam")


def test_no_committed_file_under_results_reaches_2_mb() -> None:
  """Every file git tracks under results/ is under 2 MB (run records included: a campaign's
  archive that grows past it is split, ``python -m results.records split``); without git, the
  files of a checkout's results/ but results/local/."""
  if not (ROOT / ".git").exists():
    pytest.skip("not a git checkout")
  try:
    listed = subprocess.run(
      ["git", "ls-files", "-z", "results"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    files = [ROOT / name for name in listed.decode().split("\0") if name]
  except (OSError, subprocess.CalledProcessError):
    local = ROOT / "results" / "local"
    files = [p for p in (ROOT / "results").rglob("*") if local not in p.parents]
  sizes = {str(p.relative_to(ROOT)): p.stat().st_size for p in files if p.is_file()}
  assert sizes
  assert {p: s for p, s in sizes.items() if s >= LIMIT_BYTES} == {}


def _lists_both_and_extracts_one(archive, folder, out, capsys, kept: str, left: str) -> None:
  """``list`` names the adam and ginger runs; ``extract --path`` writes back ``kept`` only."""
  assert records.main(["list", str(archive)]) == 0
  assert capsys.readouterr().out.splitlines() == [
    f"{folder}/adam/seed=0\tcompleted",
    f"{folder}/ginger/seed=0\tcompleted",
  ]
  path = f"{EXPERIMENT}/{kept}/seed=0"
  assert records.main(["extract", str(archive), str(out), "--path", path]) == 0
  assert (out / EXPERIMENT / kept / "seed=0" / "summary.json").exists()
  assert not (out / EXPERIMENT / left).exists()
