"""Run records packed into archives: many run dirs in one gzipped JSON-lines file.

    python -m results.records add <archive> <run_dir>... [--root DIR]
    python -m results.records list <archive>
    python -m results.records extract <archive> <dest> [--path PATH ...]
    python -m results.records split <archive>

An archive ``<name>.runs.jsonl.gz`` stands for the folder ``<name>/`` beside it: each line is
one run dir below that folder, and every reader (results.tables, results.plots,
results.compare, sweeps.best_lr) sees an archived run as the plain run dir it was packed from,
at the same path (``<the archive's folder>/<the line's "path">``). Roots hold plain run dirs,
archives, or both; an archive may also be named as a root itself. A plain run dir on disk wins
over an archived run of the same path.

A folder's runs may also be split over archives below it, at any depth, the deepest archive
holding a path being the one read: ``split`` replaces ``<name>.runs.jsonl.gz`` by one archive
per folder directly below ``<name>/`` (``table1/cifar10_resnet18_30ep/<arm>.runs.jsonl.gz``
for ``table1/cifar10_resnet18_30ep.runs.jsonl.gz``, its lines' paths starting at ``<arm>/``),
and the readers see the same run dirs. ``add``, ``list`` and ``extract`` take an archive's
name whether it is split or not: ``add`` packs each run into the deepest archive on its path
that exists, else beside the archives of a split folder (a new arm gets an archive of its
own), so the command adding runs stays the same::

    python -m results.records add results/cifar10/runs/table1/cifar10_resnet18_30ep.runs.jsonl.gz \\
      multirun/table1/cifar10_resnet18_30ep/*/seed=*

``list`` and ``extract`` read every archive below ``<name>/`` with ``<name>.runs.jsonl.gz``,
their paths as ``<name>.runs.jsonl.gz`` would store them. A committed file stays under 2 MB
(tests/test_results_records.py): an archive that grows past it is split, and an arm's archive
past it split again, into one archive per seed.

One line per run, keys in this order:

- ``path``: the run dir's path relative to the archive's folder, starting with ``<name>/``
  (e.g. ``cifar10_resnet18_30ep/adam,lr=0.001/seed=0`` in
  ``table1/cifar10_resnet18_30ep.runs.jsonl.gz``);
- ``mtime``: summary.json's modification time (seconds; the tables take the newest summary of
  a rerun), null without one;
- ``summary``: summary.json (its "config" is the resolved config), null without one;
- ``record``: run.json (fingerprint, config, .hydra texts of the first attempt), or null;
- ``hydra``: ``{"config.yaml": text, "overrides.yaml": text}``, the files .hydra/ has;
- ``metrics``: metrics.jsonl's events, in order (null without the file);
- ``spectrum``: spectrum.jsonl.gz's events, in order (null without the file);
- ``train_log``: train.log's text (the GPU pool's log of the job; no tool reads it), or null.

Objects keep the key order of the files they come from, so an archived run reads back as the
same objects, in the same order. Lines are sorted by path, JSON is compact and ASCII, and the
gzip header carries no name and time 0: packing the same run dirs gives the same bytes.
``add`` replaces a run already in the archive by its path; ``extract`` writes run dirs back
(summary.json's modification time included), and packing those gives the archive's bytes again.
Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import run_record

SUFFIX = ".runs.jsonl.gz"
HYDRA_FILES = ("config.yaml", "overrides.yaml")  # not hydra.yaml: Hydra's own runtime settings
TRAIN_LOG = "train.log"
SKIP_DIRS = frozenset({"checkpoints", "wandb"})
KEYS = ("path", "mtime", "summary", "record", "hydra", "metrics", "spectrum", "train_log")


class ArchiveError(ValueError):
  """An archive that cannot be read, or a run dir that cannot be packed."""


# ----------------------------------------------------------------------------- packing


def is_archive(path: str | Path) -> bool:
  return Path(path).name.endswith(SUFFIX) and len(Path(path).name) > len(SUFFIX)


def folder_name(archive: str | Path) -> str:
  """The name of the folder an archive stands for: ``<name>`` of ``<name>.runs.jsonl.gz``."""
  name = Path(archive).name
  if not is_archive(name):
    raise ArchiveError(f"{archive}: an archive's name ends with {SUFFIX}")
  return name[: -len(SUFFIX)]


def stored_path(run_dir: str | Path, archive: str | Path, root: str | Path | None = None) -> str:
  """The "path" a run dir gets in ``archive``: ``<name>/`` and the run dir's path below
  ``root`` (the folder the archive stands for), or by default below the run dir's last
  ancestor named ``<name>`` (the run dir itself when it is so named)."""
  name = folder_name(archive)
  absolute = Path(os.path.normpath(Path(run_dir).absolute()))
  if root is not None:
    try:
      below = absolute.relative_to(os.path.normpath(Path(root).absolute()))
    except ValueError:
      raise ArchiveError(f"{run_dir} is not below --root {root}") from None
    return Path(name, below).as_posix()
  parts = absolute.parts
  found = [i for i, part in enumerate(parts) if part == name]
  if not found:
    raise ArchiveError(
      f"{run_dir}: no folder named {name!r} on its path, which {archive} stands for; "
      "name the folder whose runs the archive holds with --root"
    )
  return Path(*parts[found[-1] :]).as_posix()


def _json_file(path: Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ArchiveError(f"{path}: not readable JSON ({e})") from e


def _run_dir(run_dir: str | Path) -> Path:
  d = Path(run_dir)
  if not ((d / run_record.SUMMARY).is_file() or (d / run_record.METRICS).is_file()):
    raise ArchiveError(f"{run_dir}: not a run dir (no summary.json or metrics.jsonl)")
  return d


def pack_run(run_dir: str | Path, path: str) -> dict[str, Any]:
  """One run dir as an archive line (a dict in :data:`KEYS` order), stored under ``path``."""
  d = _run_dir(run_dir)
  summary_file, metrics_file = d / run_record.SUMMARY, d / run_record.METRICS
  summary = None
  if summary_file.is_file():
    summary = _json_file(summary_file)
    if not isinstance(summary, dict):
      raise ArchiveError(f"{summary_file}: not a JSON object")
  record = _json_file(d / run_record.RECORD) if (d / run_record.RECORD).is_file() else None
  hydra_dir = d / run_record.HYDRA_DIR
  hydra = {n: (hydra_dir / n).read_text() for n in HYDRA_FILES if (hydra_dir / n).is_file()}
  metrics = list(run_record.read_events(d)) if metrics_file.is_file() else None
  spectrum = None
  if (d / run_record.SPECTRUM).is_file():  # read_spectrum: metrics.jsonl's events come first
    in_metrics = sum(e.get("event") == "spectrum" for e in metrics or ())
    spectrum = list(run_record.read_spectrum(d))[in_metrics:]
  log = d / TRAIN_LOG
  return {
    "path": path,
    "mtime": round(summary_file.stat().st_mtime, 6) if summary is not None else None,
    "summary": summary,
    "record": record,
    "hydra": hydra,
    "metrics": metrics,
    "spectrum": spectrum,
    "train_log": log.read_text(errors="replace") if log.is_file() else None,
  }


def dumps(line: dict[str, Any]) -> str:
  """One archive line: compact ASCII JSON, keys in the order given."""
  return json.dumps(line, separators=(",", ":"), ensure_ascii=True, default=str)


def write_archive(archive: str | Path, lines: Iterable[str]) -> None:
  """Writes the lines (JSON texts), sorted by path, as one gzip member with no name and time 0
  (the same lines give the same bytes); atomically (a temporary file, then a rename)."""
  by_path = {json.loads(line)["path"]: line for line in lines}
  text = "".join(by_path[p] + "\n" for p in sorted(by_path))
  buffer = io.BytesIO()
  with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
    f.write(text.encode("ascii"))
  target = Path(archive)
  target.parent.mkdir(parents=True, exist_ok=True)
  temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
  temporary.write_bytes(buffer.getvalue())
  os.replace(temporary, target)


def _archives_below(folder: Path) -> Iterator[Path]:
  """The archives anywhere below ``folder`` (none where it is not a folder)."""
  for dirpath, dirnames, filenames in os.walk(folder):
    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
    yield from (Path(dirpath) / name for name in sorted(filenames) if is_archive(name))


def _standing_for(base: Path, parts: Sequence[str], depth: int) -> tuple[Path, str]:
  """(archive, its "path") of the run ``base/<parts>`` in the archive of ``parts[:depth]``."""
  return base.joinpath(*parts[: depth - 1], parts[depth - 1] + SUFFIX), "/".join(parts[depth - 1 :])


def home(archive: str | Path, path: str) -> tuple[Path, str]:
  """(archive, its "path") a run of ``path`` (the path ``archive`` would store it under) is
  packed into: the deepest archive on its path that exists (the one readers take it from, e.g.
  ``<name>/<arm>.runs.jsonl.gz`` with the path ``<arm>/seed=0``); where none does, a new one
  beside the archives of the first folder on its path that is split into archives, or
  ``archive`` itself where ``<name>/`` holds none."""
  base, parts = Path(archive).parent, Path(path).parts
  for depth in range(len(parts), 0, -1):
    if (found := _standing_for(base, parts, depth))[0].is_file():
      return found
  depth = 1
  while depth < len(parts) and next(_archives_below(base.joinpath(*parts[:depth])), None):
    depth += 1
  return _standing_for(base, parts, depth)


def add(
  archive: str | Path, run_dirs: Sequence[str | Path], root: str | Path | None = None
) -> list[tuple[str, bool]]:
  """Packs ``run_dirs`` into ``archive`` (created if absent), or where ``<name>/`` is split into
  archives below it, each into the archive :func:`home` names; each replaces the run of the
  same path. Returns (path, replaced) per run dir, the path as ``archive`` would store it.
  Nothing is written if one cannot be packed."""
  targets: dict[Path, dict[str, str]] = {}
  done = []
  for run_dir in run_dirs:
    path = stored_path(_run_dir(run_dir), archive, root)
    target, stored = home(archive, path)
    if target not in targets:
      targets[target] = {p: e.line for p, e in _raw_lines(target)} if target.exists() else {}
    done.append((path, stored in targets[target]))
    targets[target][stored] = dumps(pack_run(run_dir, stored))
  for target, lines in targets.items():
    write_archive(target, lines.values())
    _CACHE.pop(target.absolute(), None)
  return done


def split(archive: str | Path) -> list[Path]:
  """Replaces ``archive`` by one archive per folder directly below ``<name>/``
  (``<name>/<child>.runs.jsonl.gz``, holding the runs below ``<name>/<child>/``, their paths
  starting at ``<child>/``): every reader sees each run at the same path, and each line is the
  same but for its path. Refuses an archive holding ``<name>/`` itself as a run, or one whose
  children already have archives. Returns the archives written."""
  archive = Path(archive)
  name = folder_name(archive)
  children: dict[str, list[str]] = {}
  for path, entry in _raw_lines(archive):
    parts = Path(path).parts
    if len(parts) < 2:
      raise ArchiveError(f"{archive}: the run {path} is the folder itself, so it cannot be split")
    run = json.loads(entry.line)
    run["path"] = "/".join(parts[1:])
    children.setdefault(parts[1], []).append(dumps(run))
  targets = {archive.parent / name / (child + SUFFIX): lines for child, lines in children.items()}
  if existing := sorted(str(t) for t in targets if t.exists()):
    raise ArchiveError(f"refusing to overwrite {', '.join(existing)}")
  for target, lines in sorted(targets.items()):
    write_archive(target, lines)
  archive.unlink()
  _CACHE.pop(archive.absolute(), None)
  return sorted(targets)


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Entry:
  """One line of an archive: its text, and the small parts read for every run."""

  line: str
  mtime: float | None
  summary: str | None  # the summary's JSON text (each read parses a fresh object)


# archive (absolute) -> ((mtime_ns, size), {path: Entry}): each archive is read once
_CACHE: dict[Path, tuple[tuple[int, int], dict[str, Entry]]] = {}


def _raw_lines(archive: Path) -> Iterator[tuple[str, Entry]]:
  """(path, entry) of each line of ``archive``; :class:`ArchiveError` if damaged."""
  name = folder_name(archive)
  try:
    text = gzip.decompress(archive.read_bytes()).decode("ascii")
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise ArchiveError(f"{archive}: not a readable archive ({e})") from e
  for number, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      run = json.loads(line)
      path = run["path"]
      parts = Path(path).parts
    except (ValueError, KeyError, TypeError) as e:
      raise ArchiveError(f"{archive}, line {number}: not a run record ({e!r})") from e
    if not parts or parts[0] != name or Path(path).is_absolute() or ".." in parts:
      raise ArchiveError(f"{archive}, line {number}: path {path!r} is not below {name}/")
    summary = run.get("summary")
    yield path, Entry(line, run.get("mtime"), None if summary is None else dumps(summary))


def _lines(archive: Path) -> dict[str, Entry]:
  """{path: entry} of ``archive``, read once per version of the file."""
  key = archive.absolute()
  stat = key.stat()
  stamp = (stat.st_mtime_ns, stat.st_size)
  cached = _CACHE.get(key)
  if cached is None or cached[0] != stamp:
    cached = _CACHE[key] = (stamp, dict(_raw_lines(key)))
  return cached[1]


def read_archive(archive: str | Path) -> Iterator[dict[str, Any]]:
  """The runs of ``archive`` (the line objects of :func:`pack_run`), sorted by path."""
  lines = _lines(Path(archive))
  for path in sorted(lines):
    yield json.loads(lines[path].line)


def archived_dirs(archive: str | Path) -> list[Path]:
  """The run dirs ``archive`` holds, as the paths readers know them by."""
  return [Path(archive).parent / path for path in sorted(_lines(Path(archive)))]


def locate(run_dir: str | Path) -> tuple[Path, str] | None:
  """(archive, path) of an archived run dir; None for a dir on disk, or one no archive holds."""
  target = Path(run_dir)
  if target.is_dir():
    return None
  for folder in (target, *target.parents):
    if folder.name in ("", ".", ".."):
      break
    archive = folder.parent / (folder.name + SUFFIX)
    if archive.is_file():
      path = target.relative_to(folder.parent).as_posix()
      if path in _lines(archive):
        return archive, path
  return None


def _entry(run_dir: str | Path) -> Entry | None:
  where = locate(run_dir)
  return None if where is None else _lines(where[0])[where[1]]


def read_run(run_dir: str | Path) -> dict[str, Any] | None:
  """The archive line of an archived run dir (a fresh object), None for any other."""
  entry = _entry(run_dir)
  return None if entry is None else json.loads(entry.line)


def members(archive: str | Path) -> list[Path]:
  """The archives holding the runs of the folder ``archive`` stands for, sorted: itself where
  it exists, and every archive below ``<name>/`` (where it is split into archives)."""
  archive = Path(archive)
  below = _archives_below(archive.parent / folder_name(archive))
  return sorted([archive, *below] if archive.is_file() else below)


def runs_of(archive: str | Path) -> dict[str, tuple[Path, str]]:
  """{path: (archive, its "path")} of every run of the folder ``archive`` stands for, split
  or not, sorted by path (the path as ``archive`` would store it); of two archives holding
  a path, the deeper (the one readers take it from)."""
  found = members(archive)
  if not found:
    folder = Path(archive).parent / folder_name(archive)
    raise ArchiveError(f"{archive}: no such archive, and no archive below {folder}")
  base, runs = Path(archive).parent, {}
  for member in sorted(found, key=lambda m: len(m.parts)):
    prefix = member.parent.relative_to(base)
    runs.update({(prefix / path).as_posix(): (member, path) for path in _lines(member)})
  return dict(sorted(runs.items()))


def find_run_dirs(roots: Iterable[str | Path]) -> list[Path]:
  """Every run dir under ``roots``, sorted: dirs holding a summary.json or a metrics.jsonl, and
  the runs of every archive there (a root may be an archive, split or not)."""
  found: set[Path] = set()
  for root in map(Path, roots):
    if is_archive(root) and not root.is_dir():
      for member in members(root):
        found.update(archived_dirs(member))
    if not root.is_dir():
      continue
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
      if run_record.SUMMARY in filenames or run_record.METRICS in filenames:
        found.add(Path(dirpath))
      for name in filenames:
        if is_archive(name):
          found.update(archived_dirs(Path(dirpath) / name))
  return sorted(found)


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
  """run_record.read_summary, for archived run dirs too."""
  if (entry := _entry(run_dir)) is None:
    return run_record.read_summary(run_dir)
  return None if entry.summary is None else json.loads(entry.summary)


def has_summary(run_dir: str | Path) -> bool:
  """Whether the run dir has a summary.json (readable or not)."""
  if (entry := _entry(run_dir)) is None:
    return (Path(run_dir) / run_record.SUMMARY).exists()
  return entry.summary is not None


def summary_mtime(run_dir: str | Path) -> float | None:
  """summary.json's modification time (None without one)."""
  if (entry := _entry(run_dir)) is None:
    path = Path(run_dir) / run_record.SUMMARY
    return path.stat().st_mtime if path.exists() else None
  return entry.mtime


def read_events(run_dir: str | Path) -> Iterator[dict[str, Any]]:
  """run_record.read_events (lenient), for archived run dirs too."""
  run = read_run(run_dir)
  if run is None:
    yield from run_record.read_events(run_dir)
    return
  yield from run["metrics"] or ()


def read_spectrum(run_dir: str | Path) -> Iterator[dict[str, Any]]:
  """run_record.read_spectrum (lenient): spectrum.jsonl.gz's events; for archived run dirs
  too."""
  run = read_run(run_dir)
  if run is None:
    yield from run_record.read_spectrum(run_dir)
    return
  yield from run["spectrum"] or ()


# ----------------------------------------------------------------------------- extracting


def extract(archive: str | Path, dest: str | Path, paths: Sequence[str] = ()) -> list[Path]:
  """Writes the runs of ``archive``, split or not (those of ``paths``, default all; the path as
  ``archive`` stores it) as run dirs under ``dest`` (``<dest>/<path>``); refuses a run dir
  that exists. Returns the dirs written."""
  where = runs_of(archive)
  if missing := sorted(set(paths) - set(where)):
    raise ArchiveError(f"{archive} holds no run {', '.join(missing)}")
  chosen = [p for p in where if not paths or p in paths]
  runs = [json.loads(_lines(where[p][0])[where[p][1]].line) for p in chosen]
  targets = [Path(dest) / p for p in chosen]
  if existing := [str(t) for t in targets if t.exists()]:
    raise ArchiveError(f"refusing to overwrite {', '.join(existing)}")
  for run, target in zip(runs, targets, strict=True):
    (target / run_record.HYDRA_DIR).mkdir(parents=True)
    for name, text in run["hydra"].items():
      (target / run_record.HYDRA_DIR / name).write_text(text)
    if run["record"] is not None:
      (target / run_record.RECORD).write_text(json.dumps(run["record"], indent=2))
    if run["metrics"] is not None:
      (target / run_record.METRICS).write_text(
        "".join(json.dumps(e) + "\n" for e in run["metrics"])
      )
    if run["spectrum"] is not None:
      (target / run_record.SPECTRUM).write_bytes(b"")
      run_record.append_spectrum(target, run["spectrum"])
    if run["train_log"] is not None:
      (target / TRAIN_LOG).write_text(run["train_log"])
    if run["summary"] is not None:
      summary = target / run_record.SUMMARY
      summary.write_text(json.dumps(run["summary"], indent=2, default=str))
      ns = round(run["mtime"] * 1e9)
      os.utime(summary, ns=(ns, ns))
  return targets


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m results.records",
    description=__doc__.split("\n\n")[2],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  commands = parser.add_subparsers(dest="command", required=True)
  adding = commands.add_parser("add", help="pack run dirs into an archive (replacing by path)")
  adding.add_argument("archive", type=Path, help=f"<name>{SUFFIX}, created if absent")
  adding.add_argument("run_dirs", type=Path, nargs="+")
  adding.add_argument(
    "--root",
    type=Path,
    default=None,
    help="the folder the archive stands for (default: each run dir's last ancestor named "
    "like the archive)",
  )
  listing = commands.add_parser("list", help="print the run dirs an archive holds")
  listing.add_argument("archive", type=Path)
  extracting = commands.add_parser("extract", help="write an archive's runs back as run dirs")
  extracting.add_argument("archive", type=Path)
  extracting.add_argument("dest", type=Path, help="runs go to <dest>/<path>")
  extracting.add_argument("--path", action="append", default=[], help="only this run (repeatable)")
  splitting = commands.add_parser(
    "split", help="replace an archive by one archive per folder below the one it stands for"
  )
  splitting.add_argument("archive", type=Path)
  args = parser.parse_args(argv)
  try:
    if args.command == "add":
      done = add(args.archive, args.run_dirs, args.root)
      for path, replaced in done:
        print(f"{'replaced' if replaced else 'added'} {path}")
      for target in sorted({home(args.archive, path)[0] for path, _ in done}):
        print(f"{target}: {len(_lines(target))} runs", file=sys.stderr)
    elif args.command == "list":
      for path, (member, stored) in runs_of(args.archive).items():
        status = json.loads(_lines(member)[stored].summary or "{}").get("status", "no summary")
        print(f"{args.archive.parent / path}\t{status}")
    elif args.command == "split":
      for target in split(args.archive):
        print(f"wrote {target}: {len(_lines(target))} runs")
    else:
      for target in extract(args.archive, args.dest, args.path):
        print(f"wrote {target}")
  except (ArchiveError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
