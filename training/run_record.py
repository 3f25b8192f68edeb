"""The run record: what a run dir says about its run, written and read in one place.

A run dir (``outputs/<name>/<overrides>/``) holds

- ``run.json``: the fingerprint of everything that changes the run's result (below), the
  configuration it was taken from, and the ``.hydra/`` files of the attempt that started it;
- ``summary.json``: the run's identity (``"run"``), config, status and results;
- ``metrics.jsonl``: one JSON object per train/eval event;
- ``spectrum.jsonl.gz``: the "spectrum" events (Ginger's sigma of every tensor, every
  ``spectrum_every`` steps; most of a Ginger run's log by size), gzipped JSON lines;
- ``checkpoints/`` (training/checkpoints.py) and ``.hydra/`` (written by Hydra).

train.py, sweeps/ and results/ read and write these through the functions here. Nothing here
imports JAX, so sweeps and tables stay light.

**Fingerprint.** A rerun in an existing run dir continues that run, so it must be the same run:
the resolved config minus the keys that change only how a run is watched or where it runs
(:data:`NOT_FINGERPRINTED`: logging and checkpoint cadence, resume, the logger, the device mesh
and how Ginger's passes run, which change values only to float rounding; a checkpoint resumes
on another mesh), hashed. Data source and path, epochs and max_steps are
part of it. A different fingerprint refuses before anything is loaded or compiled
(:func:`claim`), and leaves the dir as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import gzip
import hashlib
import json
import logging
import math
import os
import socket
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data import cache
from training import registry
from training.choices import WARMUP_SCHEDULES
from training.errors import TrainingError

log = logging.getLogger(__name__)

RECORD = "run.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
SPECTRUM = "spectrum.jsonl.gz"
HYDRA_DIR = ".hydra"
HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")
RECORD_VERSION = 1

# Top-level keys that do not change what a run computes (dotted paths).
NOT_FINGERPRINTED = frozenset(
  {
    "logger",
    "log_every",
    "checkpoint_every",
    "spectrum_every",
    "profile_steps",  # a device trace of some steps: what they compute is the same
    "profile_start",
    "resume",
    "mesh",  # results agree across meshes to float rounding; checkpoints move between them
    "passes",  # Ginger's jnp and Pallas passes agree to float32 summation order
    "fisher_backward",  # one batched backward, two, or one per device: the same values
    "distributed",
    "compilation_cache_dir",  # where compiled programs are cached: start-up time only
    "deterministic",  # XLA's deterministic GPU kernels: the same values to float rounding
    "eval_batch_size",  # the same sums in other batches
    "lr_from",  # provenance of the lr (the lr itself is fingerprinted)
    "best_lr",  # the tuned-lr table a sweep reads (only this run's lr matters)
  }
)

# The paper-notation hyperparameters of a run's identity: those its optimizer reads
# (registry.Optimizer.hyperparameters), None for the others.
IDENTITY_HYPERPARAMETERS = ("tau", "alpha", "gamma", "rho", "block", "fisher", "fisher_forward")
# The identity's numerics fields: the compute dtype and the curvature state's dtype.
NUMERICS = ("precision", "state_dtype")
# The identity's field for the optimizer's own keys (registry.Optimizer.keys) that no other
# field holds, where a run sets them away from its configs/optimizer/<name>.yaml.
OPTIONS = "optimizer_options"
# The identity's field for a run's lr schedule and weight decay away from the paper's protocol.
RECIPE = "recipe"
OPTIMIZER_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "optimizer"


class RunDirError(TrainingError):
  """A run dir that holds another run, or lacks what is asked of it."""


def _run_name(overrides: str) -> str:
  return overrides or "default"


def lr_key(optimizer: str, rho: float | None) -> str:
  """The optimizer's entry in configs/best_lr/, as its registry entry names it
  (``registry.Optimizer.lr_key``): "ginger_unclipped" for Ginger without the element-wise clip
  (rho=null), "qng_clipped" for QNG with it, else the optimizer's name.

  Unclipped, Ginger's update moves each direction outside span U by lr/gamma times the momentum
  (gamma = 1e-5 by default); clipped, no entry moves by more than lr * rho. A clipped and an
  unclipped variant's good lrs are therefore orders of magnitude apart and are tuned, and looked
  up, separately.
  """
  return registry.lr_key(optimizer, {"rho": rho})


COMPILATION_CACHE_ENV = "GINGER_COMPILATION_CACHE_DIR"
CACHE_OFF = ("", "none", "null", "off")


def user_compilation_cache_dir() -> str | None:
  """``${user_compilation_cache_dir:}``, the default ``compilation_cache_dir``:
  ``$GINGER_COMPILATION_CACHE_DIR`` when set (empty, ``none`` or ``off``: no cache, None), else
  ``compiled/`` in the user's cache folder of decoded data (:func:`data.cache.cache_root`:
  ``$GINGER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ginger``, else ``~/.cache/ginger``).

  One folder for every run of the user: the first run of a program compiles it, every later
  run of it (another seed, a resume, the next day) reads it back. The folder can be deleted at
  any time; nothing in it changes a result."""
  if COMPILATION_CACHE_ENV in os.environ:
    value = os.environ[COMPILATION_CACHE_ENV].strip()
    return None if value.lower() in CACHE_OFF else value
  return str(cache.cache_root() / "compiled")


def register_resolvers() -> None:
  """``${run_name:...}`` of configs/config.yaml: the override string, or "default";
  ``${lr_key:optimizer,rho}`` of configs/sweep/common/layout.yaml (`lr_key`);
  ``${user_compilation_cache_dir:}`` of configs/config.yaml (:func:`user_compilation_cache_dir`)."""
  if not OmegaConf.has_resolver("run_name"):
    OmegaConf.register_new_resolver("run_name", _run_name)
  if not OmegaConf.has_resolver("lr_key"):
    OmegaConf.register_new_resolver("lr_key", lr_key)
  if not OmegaConf.has_resolver("user_compilation_cache_dir"):
    OmegaConf.register_new_resolver("user_compilation_cache_dir", user_compilation_cache_dir)


register_resolvers()


def plain(config: Mapping | DictConfig) -> dict[str, Any]:
  """The resolved config as plain Python (without Hydra's own ``hydra`` node)."""
  if isinstance(config, DictConfig):
    config = OmegaConf.to_container(config, resolve=True)
  return {k: v for k, v in dict(config).items() if k != "hydra"}


# ----------------------------------------------------------------------------- identity


def identity(config: Mapping | DictConfig) -> dict[str, Any]:
  """summary.json's ``"run"`` block: what a run is, for tables and sweeps.

  Hyperparameters the optimizer does not read are None. ``setting`` is the fine-tuning setting
  of models that have one (``model.lora`` present: "lora" or "full"), else None.
  """
  c = plain(config)
  name = c["optimizer"]["name"]
  optimizer = registry.find(name)
  used = () if optimizer is None else optimizer.hyperparameters
  model = c["model"]
  setting = ("lora" if model.get("lora") else "full") if "lora" in model else None
  return {
    "experiment": c["name"],
    "optimizer": name,
    **{k: c.get(k) if k in used else None for k in IDENTITY_HYPERPARAMETERS[:5]},
    "lr": float(c["lr"]),
    "seed": int(c["seed"]),
    "model": model["name"],
    "dataset": c["data"]["name"],
    "setting": setting,
    "sweep": c.get("sweep"),
    **{k: c.get(k) if k in used else None for k in IDENTITY_HYPERPARAMETERS[5:]},
    "curvature_every": curvature_every(c),
    **fisher_batch(c, used),
    **batchnorm(c),
    **numerics(c, name),
    **({OPTIONS: own} if (own := options(c, optimizer)) else {}),
    **({RECIPE: own} if (own := recipe(c)) else {}),
  }


def recipe(config: Mapping) -> dict[str, Any]:
  """The learning-rate schedule and weight decay of a run that sets them away from the paper's
  protocol (a constant lr, no weight decay): ``schedule`` (with ``warmup_epochs`` where it warms
  up), ``weight_decay`` and ``weight_decay_mode``; {} for the paper's."""
  out: dict[str, Any] = {}
  schedule = config.get("schedule") or "constant"
  if schedule != "constant":
    out["schedule"] = schedule
    if schedule in WARMUP_SCHEDULES:
      out["warmup_epochs"] = float(config.get("warmup_epochs") or 0)
  if config.get("weight_decay"):
    out["weight_decay"] = float(config["weight_decay"])
    out["weight_decay_mode"] = config.get("weight_decay_mode") or "l2"
  return out


def fisher_batch(config: Mapping, used: tuple[str, ...]) -> dict[str, Any]:
  """``{"fisher_batch": m}`` for a run whose optimizer's d-pass ran on the batch's first ``m``
  examples, {} where it ran on the whole batch (``fisher_batch`` null), as every record
  without the key did: left out, so that such records keep their identity (and fingerprint:
  :func:`fingerprinted`)."""
  value = config.get("fisher_batch") if "fisher_batch" in used else None
  return {} if value is None else {"fisher_batch": value}


def own_keys(optimizer: registry.Optimizer) -> tuple[str, ...]:
  """The keys of ``optimizer`` (:attr:`registry.Optimizer.keys`) that the identity holds in
  :data:`OPTIONS`: those no other identity field holds (``optimizer.b1``, Muon's
  ``optimizer.ns_steps``) and that change what a run computes (not ``passes``)."""
  named = {*IDENTITY_HYPERPARAMETERS, "curvature_every", "optimizer.state_dtype"}
  return tuple(k for k in optimizer.keys if k not in named and k not in NOT_FINGERPRINTED)


_ABSENT = object()


def _at(config: Mapping, key: str) -> Any:
  """The value at dotted ``key`` of ``config``; :data:`_ABSENT` where there is none."""
  for part in key.split("."):
    if not isinstance(config, Mapping) or part not in config:
      return _ABSENT
    config = config[part]
  return config


@functools.cache
def _defaults(name: str) -> dict[str, Any] | None:
  """The values configs/optimizer/<name>.yaml sets (None: no such file, an optimizer whose
  YAML lives elsewhere on Hydra's search path)."""
  path = OPTIMIZER_CONFIGS / f"{name}.yaml"
  return OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else None


def options(config: Mapping, optimizer: registry.Optimizer | None) -> dict[str, Any]:
  """The :data:`OPTIONS` of a run of ``optimizer`` with this (plain) config: each of its
  :func:`own_keys` whose value differs from its YAML's (every one where the repository ships
  no YAML for it), by its dotted key. Runs at the YAML's values have none, so two runs that
  differ only in such a key never share an identity, and the identities of runs at the
  defaults stay as they were before an optimizer gained a key."""
  if optimizer is None:
    return {}
  defaults = _defaults(optimizer.name)
  out = {}
  for key in own_keys(optimizer):
    value = _at(config, key)
    value = None if value is _ABSENT else value
    default = _ABSENT if defaults is None else _at(defaults, key)
    if default is _ABSENT or canonical(value) != canonical(default):
      out[key] = value
  return out


def numerics(config: Mapping, optimizer: str | None) -> dict[str, Any]:
  """The :data:`NUMERICS` of a run of ``optimizer`` with this (plain) config: ``precision``,
  the compute dtype, and ``state_dtype``, the dtype its curvature state is stored in (None for
  optimizers without one)."""
  state_dtype = (config.get("optimizer") or {}).get("state_dtype")
  return {
    "precision": config.get("precision") or "float32",
    "state_dtype": (state_dtype or "float32") if registry.keeps_curvature(optimizer) else None,
  }


def narrow_numerics(run: Mapping) -> dict[str, Any]:
  """The :data:`NUMERICS` of a ``"run"`` block that are not float32 ({} for a float32 run)."""
  return {k: run[k] for k in NUMERICS if run.get(k) not in (None, "float32")}


def batchnorm(config: Mapping) -> dict[str, Any]:
  """``batchnorm`` ("sync" | "per_device") and ``batchnorm_groups`` (per_device: the data
  axis's size, the number of statistics groups; else None) of a ResNet run; both None for
  models without BatchNorm (T5)."""
  if config["model"].get("family") != "resnet":
    return {"batchnorm": None, "batchnorm_groups": None}
  mode = config.get("batchnorm") or "sync"  # null: sync
  groups = int(config["mesh"]["data"]) if mode == "per_device" else None
  return {"batchnorm": mode, "batchnorm_groups": groups}


def curvature_every(config: Mapping) -> int | None:
  """How many steps apart the curvature updates are: the config's value for an optimizer that
  takes ``curvature_every`` (Ginger; 1, the paper, when unset), None for the others."""
  optimizer = registry.find(config["optimizer"]["name"])
  if optimizer is None or not optimizer.curvature_every:
    return None
  return int(config.get("curvature_every") or 1)


# ----------------------------------------------------------------------------- fingerprint


# Keys newer than some runs, each with the value those runs ran with: left out of the
# fingerprint at that value, so that those runs resume (evaluate.py fills them in, at that
# value, into an older run's config).
ABSENT_AT = {"eval_examples": None, "fisher_batch": None, "weight_decay_mode": "l2"}


def fingerprinted(config: Mapping | DictConfig) -> dict[str, Any]:
  """The part of the resolved config that determines the run's result. ``mesh`` is not part
  of it, except the data axis's size under ``batchnorm=per_device`` (the statistics groups);
  ``fisher_batch`` only where set (null, the whole batch, is what configs without it ran),
  ``weight_decay_mode`` only where not ``l2`` (what configs without it ran)."""
  c = plain(config)
  out = {k: v for k, v in c.items() if k not in NOT_FINGERPRINTED}
  for key, value in ABSENT_AT.items():
    if out.get(key, value) == value:
      out.pop(key, None)
  if c.get("batchnorm") == "per_device":
    out["batchnorm_groups"] = (c.get("mesh") or {}).get("data")
  return out


def fingerprint(config: Mapping | DictConfig) -> str:
  """sha256 of the fingerprinted config (canonical JSON: sorted keys, 4 == 4.0)."""
  text = json.dumps(canonical(fingerprinted(config)), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def canonical(x):
  """``x`` in the form fingerprints and comparisons use: dict keys as strings, tuples as lists,
  integral floats as ints (so that ``1.0`` and ``1`` compare equal)."""
  if isinstance(x, dict):
    return {str(k): canonical(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [canonical(v) for v in x]
  if isinstance(x, float) and math.isfinite(x) and x == int(x):
    return int(x)
  return x


def differences(old: Mapping, new: Mapping, prefix: str = "") -> list[str]:
  """``key: old -> new`` for every dotted key whose value differs."""
  out = []
  for key in sorted(set(old) | set(new), key=str):
    a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      out += differences(a, b, f"{prefix}{key}.")
    elif canonical(a) != canonical(b):
      out.append(f"{prefix}{key}: {a!r} -> {b!r}")
  return out


LOCK = ".lock"


class RunDirBusy(TrainingError):
  """Another live process holds the run dir."""


@contextlib.contextmanager
def exclusive(run_dir: str | Path) -> Iterator[None]:
  """Holds ``run_dir`` for this process: an OS lock (``flock``) on ``run_dir/.lock`` for the
  life of the block, released by the kernel however the process ends (``kill -9`` included),
  so a dead holder never blocks. A second process is refused at once with the holder's host
  and PID, before it writes anything in the dir (the ``.hydra/`` files Hydra wrote for it are
  put back as the holder recorded them). On a filesystem without locks
  (some network mounts) it warns and goes on unlocked."""
  path = Path(run_dir) / LOCK
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
      record = read_record(run_dir) or {}
      if (Path(run_dir) / HYDRA_DIR).is_dir():  # undo what Hydra wrote for this attempt
        for name, text in (record.get("hydra") or {}).items():
          (Path(run_dir) / HYDRA_DIR / name).write_text(text)
      raise RunDirBusy(
        f"{run_dir} is in use by another process ({holder}): one process per run dir. Wait "
        "for it, stop it, or give this run another hydra.run.dir."
      ) from None
    except OSError as e:
      log.warning("%s: cannot lock the run dir (%s); two processes could share it", run_dir, e)
    else:
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}".encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock


def read_record(run_dir: str | Path) -> dict[str, Any] | None:
  path = Path(run_dir) / RECORD
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise RunDirError(
      f"{path} cannot be read ({e}); give this run another dir, or delete the file and pass "
      "resume=false to start over in this one"
    ) from e


def has_run(run_dir: str | Path) -> bool:
  """Whether the dir holds (part of) a run: checkpoints, a summary or metrics."""
  run_dir = Path(run_dir)
  checkpoints = run_dir / "checkpoints"
  return (
    (run_dir / SUMMARY).exists()
    or (run_dir / METRICS).exists()
    or (run_dir / SPECTRUM).exists()
    or (checkpoints.is_dir() and any(checkpoints.iterdir()))
  )


def claim(run_dir: str | Path, config: Mapping | DictConfig, *, fresh: bool, write: bool) -> str:
  """Checks that ``config`` is the run of ``run_dir`` and records it there.

  Returns what happened: "new" (an empty dir), "same" (the recorded fingerprint matches),
  "taken over" (another config's attempt left no checkpoint, metrics or summary: the caller
  holds the dir's lock, so nothing runs it), or "fresh" (``fresh=True``: the caller discards
  the old run). On a mismatch it raises :class:`RunDirError` naming the keys that differ, after
  putting back the ``.hydra/`` files that Hydra overwrote for this attempt, so the dir is as
  the run left it; likewise for a dir that holds a run but no ``run.json`` (nothing says which
  run it is). Only the process that writes (``write``) touches files.
  """
  run_dir = Path(run_dir)
  config = plain(config)
  record = read_record(run_dir)
  if fresh:
    outcome = "fresh"
  elif record is not None:
    if record.get("fingerprint") == fingerprint(config):
      return "same"
    if has_run(run_dir):
      _refuse(run_dir, record.get("config") or {}, config, record.get("hydra") or {}, write)
    # The earlier attempt stopped before its first log (bad data, say): nothing to protect,
    # and nothing runs it (the caller holds the dir's lock).
    changed = differences(record.get("config") or {}, fingerprinted(config))
    log.warning(
      "%s: its earlier attempt (another configuration: %s) left no checkpoint, metrics or "
      "summary; this run takes the dir over",
      run_dir,
      "; ".join(changed) or "the fingerprint",
    )
    outcome = "taken over"
  elif not has_run(run_dir):
    outcome = "new"
  else:
    _unrecorded(run_dir)
  if write:
    hydra_dir = run_dir / HYDRA_DIR
    hydra = {n: (hydra_dir / n).read_text() for n in HYDRA_FILES if (hydra_dir / n).exists()}
    _write_json(
      run_dir / RECORD,
      {
        "version": RECORD_VERSION,
        "fingerprint": fingerprint(config),
        "config": fingerprinted(config),
        "hydra": hydra,
      },
    )
  return outcome


def _unrecorded(run_dir: Path) -> None:
  raise RunDirError(
    f"{run_dir} holds a run (checkpoints, metrics or a summary) but no {RECORD}, so nothing says "
    "which run it is. Nothing in the dir was changed. Give this run its own dir "
    "(hydra.run.dir=<new dir>, or a new name=...), or pass resume=false to discard what is "
    "there and start over in this dir."
  )


def _refuse(run_dir: Path, old: Mapping, config: Mapping, hydra: Mapping, write: bool) -> None:
  if write and (run_dir / HYDRA_DIR).is_dir():
    for name, text in hydra.items():  # undo what Hydra wrote before this attempt started
      (run_dir / HYDRA_DIR / name).write_text(text)
  changed = differences(old, fingerprinted(config))
  raise RunDirError(
    f"{run_dir} holds another run; rerunning there would mix two runs. Its configuration differs "
    f"in: {'; '.join(changed) or 'the fingerprint'}. Nothing in the dir was changed. To start "
    "a new run, give it its own dir (hydra.run.dir=<new dir>, or a new name=...), or pass "
    "resume=false to discard this run and start over in this dir."
  )


# ----------------------------------------------------------------------------- summary.json


def _write_json(path: Path, data: Any) -> None:
  _replace(path, json.dumps(data, indent=2, default=str).encode())


def write_summary(run_dir: str | Path, summary: Mapping) -> Path:
  path = Path(run_dir) / SUMMARY
  _write_json(path, dict(summary))
  return path


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
  """The run's summary.json; None if absent, unreadable or not a JSON object."""
  try:
    data = json.loads((Path(run_dir) / SUMMARY).read_text())
  except (OSError, ValueError):
    return None
  return data if isinstance(data, dict) else None


def status(run_dir: str | Path, config: Mapping | None = None) -> str | None:
  """summary.json's status ("completed", "failed", "interrupted"), or None if there is none;
  with ``config``, None also when the summary is of another config."""
  summary = read_summary(run_dir)
  if summary is None or (config is not None and summary.get("config") != plain(config)):
    return None
  return summary.get("status")


def finished_summary(run_dir: str | Path, step: int, total_steps: int) -> dict | None:
  """The summary of a run that already reached ``total_steps`` (a rerun then changes nothing)."""
  summary = read_summary(run_dir) if step >= total_steps else None
  return summary if summary is not None and summary.get("status") == "completed" else None


# ----------------------------------------------------------------------------- metrics.jsonl


def read_events(run_dir: str | Path, *, strict: bool = False) -> Iterator[dict[str, Any]]:
  """The JSON objects of metrics.jsonl, in order. Lenient (default): a missing file, malformed
  lines and non-objects are skipped (a run killed mid-write). Strict: raises
  :class:`RunDirError` naming the file and line."""
  path = Path(run_dir) / METRICS
  try:
    lines = path.read_text().splitlines()
  except OSError:
    if strict and path.exists():
      raise
    return
  yield from _parse(lines, path, strict)


def _parse(lines: Iterable[str], path: Path, strict: bool) -> Iterator[dict[str, Any]]:
  """The JSON objects among ``lines`` (blank lines skipped; see :func:`read_events`)."""
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      event = json.loads(line)
    except ValueError as e:
      if strict:
        raise RunDirError(f"{path}, line {number}: not JSON ({e})") from e
      continue
    if isinstance(event, dict):
      yield event


# ----------------------------------------------------------------------------- spectrum.jsonl.gz
#
# A gzip file may be a sequence of members, which gzip readers (gzip.open, zcat) return as one
# stream. Each write appends its events as one member, compressed in memory and written with a
# single write() of a file opened for appending: the file is readable after every write and
# after a resume, and a process killed in the middle of a write (SIGKILL, power loss: SIGTERM
# stops the loop between steps) leaves at most that member cut short, which is dropped like
# the partial last line of metrics.jsonl. mtime=0 in every gzip header: the same events give
# the same bytes.

CUT_SHORT = "a last gzip member cut short"
_CHUNK = 1 << 16  # bytes fed to zlib at a time


def read_spectrum(run_dir: str | Path, *, strict: bool = False) -> Iterator[dict[str, Any]]:
  """A run's "spectrum" events (spectrum.jsonl.gz) in order.

  Lenient (default): a missing file, a damaged or cut-short member (and what follows it) and
  malformed lines are skipped. Strict: each raises :class:`RunDirError` naming the file.
  """
  path = Path(run_dir) / SPECTRUM
  lines, damage = _gzip_lines(path)
  if damage and strict:
    raise RunDirError(f"{path}: {damage}")
  yield from _parse(lines, path, strict)


def append_spectrum(run_dir: str | Path, events: Iterable[Mapping]) -> None:
  """Appends ``events`` to spectrum.jsonl.gz as one gzip member (one write; see above)."""
  member = _gzip_member(events)
  if member:
    with (Path(run_dir) / SPECTRUM).open("ab") as f:
      f.write(member)


def keep_spectrum(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
  """On resume from the checkpoint of ``step``: cuts spectrum.jsonl.gz back to its events at or
  before ``step`` (the file is rewritten only if that drops something) and returns them.

  A last member cut short (a write killed mid-way) is dropped with a warning; any other damage
  raises :class:`RunDirError`, naming the file, and leaves it as it is.
  """
  path = Path(run_dir) / SPECTRUM
  if not path.exists():
    return []
  lines, damage = _gzip_lines(path)
  if damage and not damage.startswith(CUT_SHORT):
    raise RunDirError(f"{path}: {damage}")
  if damage:
    logging.getLogger(__name__).warning("%s: dropping %s", path, damage)
  events = list(_parse(lines, path, strict=True))
  kept = [e for e in events if e.get("step", 0) <= step]
  if not kept:
    path.unlink()
  elif damage or len(kept) < len(events):
    _replace(path, _gzip_member(kept))
  return kept


def _gzip_member(events: Iterable[Mapping]) -> bytes:
  text = "".join(json.dumps(dict(e)) + "\n" for e in events)
  return gzip.compress(text.encode(), mtime=0) if text else b""


def _gzip_lines(path: Path) -> tuple[list[str], str | None]:
  """The lines of the whole, intact gzip members of ``path`` (none if it is missing), and what
  is wrong with the rest of the file, if anything: :data:`CUT_SHORT` (a member that ends with
  the file before its end), or a damaged member (bad header, data or checksum).

  The file is fed to zlib in chunks, so that a file of many members (one per write) is read in
  time linear in its size (``unused_data`` copies at most one chunk per member).
  """
  try:
    data = memoryview(path.read_bytes())
  except FileNotFoundError:
    return [], None
  chunks, offset = [], 0
  while offset < len(data):
    member, out, end = zlib.decompressobj(wbits=31), [], offset  # 31: gzip, checked
    try:
      while not member.eof and end < len(data):
        out.append(member.decompress(data[end : end + _CHUNK]))
        end = min(end + _CHUNK, len(data))
    except zlib.error as e:
      return _lines(chunks), f"damaged gzip member at byte {offset} ({e})"
    if not member.eof:
      return _lines(chunks), f"{CUT_SHORT} (bytes {offset}-{len(data)})"
    chunks += out
    offset = end - len(member.unused_data)
  return _lines(chunks), None


def _lines(chunks: list[bytes]) -> list[str]:
  return b"".join(chunks).decode().splitlines()


def _replace(path: Path, data: bytes) -> None:
  """Writes ``data`` to ``path`` via a temporary file and a rename: never half a file."""
  tmp = path.with_name(path.name + ".tmp")
  try:
    tmp.write_bytes(data)
  except OSError as e:  # a full disk: no partial file left behind, and the error names the file
    tmp.unlink(missing_ok=True)
    e.filename = str(path)
    raise
  os.replace(tmp, path)
