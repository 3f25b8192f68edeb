"""Lowered programs kept on disk, so that a later run of the same programs skips tracing them.

JAX's persistent compilation cache (config ``compilation_cache_dir``) saves a warm run XLA's
compilation, but not the tracing and lowering of Python that comes before it: for Ginger's
training step on a GPU 3-4 s of every run's start-up (its Pallas kernels, its per-bucket
code), against ~1 s for Adam's. :func:`lower` keeps each program a run lowers as a serialized
:mod:`jax.export` module beside the compilation cache (``<compilation_cache_dir>/programs/``);
a later run whose program has the same key reads the module back and lowers only a call of
it (~0.2 s), and XLA's cache then finds the executable that the first run compiled from it.

The key is a sha256 of everything that decides the program: its name and donated arguments,
the arguments' pytree structure, shapes, dtypes and shardings, the task's data (its contents:
constants computed from it, such as the images' mean and std, are part of the program), the
run's resolved config
without the keys that only change the arguments' values or the loop around the steps
(:data:`NEUTRAL_KEYS`: the seed, logging, checkpointing), the source files of the packages
the steps are built from (with kfac-jax's, vendored in third_party/kfac_jax), the versions of
Python, jax, jaxlib, flax, optax and K-FAC's distrax and tfp-nightly, JAX's own settings, and
the devices (kind, count, processes). A program read back is the module the
first run lowered (both runs compile a call of it, so they run the same executable); a key
that changes, a file that cannot be read, or a program that cannot be exported are traced as
without the cache (logged). Single-process runs only: with several processes each lowers its
own program, as before.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import export

log = logging.getLogger("train")

FOLDER = "programs"
# Packages whose code the training and evaluation steps are built from: optimizer=kfac's update
# is kfac-jax's code, vendored (the others import none of it).
PACKAGES = ("ginger", "models", "training", "data", "third_party/kfac_jax/kfac_jax")
REPO = Path(__file__).resolve().parents[1]
# Top-level config keys that never change a step's program: the seed (the initial state and
# the rng key are the steps' arguments), and what the loop does around the steps.
NEUTRAL_KEYS = frozenset(
  {
    "seed",
    "resume",
    "logger",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "spectrum_every",
    "profile_steps",
    "profile_start",
    "compilation_cache_dir",
    "name",
    "sweep",
    "lr_from",
    "best_lr",
  }
)
# Version 1 of the files' layout: a pickled dict of the output's tree and the serialized module
# (a pickle: the folder must be as trusted as the code, like any cache a run loads code from).
LAYOUT = 1
# Beyond the custom calls jax.export keeps stable (LAPACK, cuSOLVER, ...), Pallas' kernels on
# GPUs: a module is read back only by the same versions on the same devices (the key), so
# their stability across versions does not matter. Host callbacks stay refused (a callback
# is a Python object of the exporting process): such a program is traced as without a cache.
_CHECKS = tuple(
  export.DisabledSafetyCheck.custom_call(target)
  for target in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")
)


def folder_of(compilation_cache_dir: str | os.PathLike) -> Path:
  """Where the programs of the compilation cache ``compilation_cache_dir`` are kept."""
  return Path(compilation_cache_dir).expanduser().resolve() / FOLDER


@functools.cache
def source_digest(repo: Path = REPO) -> str:
  """sha256 of the packages' Python sources (paths and contents), read once per process."""
  digest = hashlib.sha256()
  for package in PACKAGES:
    for path in sorted((repo / package).rglob("*.py")):
      digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def _versions() -> dict[str, str]:
  out = {"python": sys.version}
  # distrax and tfp-nightly: kfac-jax draws its Fisher labels with them (optimizer=kfac).
  for dist in ("jax", "jaxlib", "flax", "optax", "distrax", "tfp-nightly"):
    try:
      out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:  # a jaxlib built from source, say
      out[dist] = "unknown"
  return out


def _jax_settings() -> dict[str, str]:
  """JAX's settings that can change what tracing produces (not its caches' or logging's)."""
  skip = ("cache", "log", "explain", "traceback", "debug_key_reuse")
  return {k: repr(v) for k, v in sorted(jax.config.values.items()) if not any(s in k for s in skip)}


def _devices() -> dict[str, Any]:
  devices = jax.devices()
  return {
    "platform": devices[0].platform,
    "kinds": sorted({d.device_kind for d in devices}),
    "count": len(devices),
    "processes": jax.process_count(),
  }


def _describe(x) -> list:
  sharding = getattr(x, "sharding", None)
  return [list(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), repr(sharding)]


def data_digest(task) -> str:
  """sha256 of a task's data: every numpy array and number among its dataclass fields (the
  datasets, and what was computed from them and enters the steps as constants, e.g. the
  images' per-channel mean and std). The model's parameters (JAX arrays: arguments of the
  steps) are not part of it. ~0.15 s for CIFAR's 150 MB on one core."""
  digest = hashlib.sha256()
  for field in dataclasses.fields(task):
    leaves = jax.tree.leaves_with_path(getattr(task, field.name))
    for path, leaf in leaves:
      if isinstance(leaf, np.ndarray | np.generic | int | float):
        array = np.ascontiguousarray(leaf)
        head = f"{field.name}{jax.tree_util.keystr(path)}:{array.dtype}{array.shape}"
        digest.update(head.encode() + b"\0")
        digest.update(memoryview(array.reshape(-1)).cast("B"))
  return digest.hexdigest()


def key(
  name: str, args: tuple, donate_argnums: tuple[int, ...], config: dict, data: str = ""
) -> str:
  """The program's key (hex sha256): see the module's docstring. ``config``: the run's
  resolved config as plain containers; ``data``: :func:`data_digest` of the run's task."""
  leaves, tree = jax.tree.flatten(args)
  text = json.dumps(
    {
      "layout": LAYOUT,
      "name": name,
      "data": data,
      "donate_argnums": list(donate_argnums),
      "tree": str(tree),
      "leaves": [_describe(x) for x in leaves],
      "config": {k: v for k, v in config.items() if k not in NEUTRAL_KEYS},
      "sources": source_digest(),
      "versions": _versions(),
      "jax_settings": _jax_settings(),
      "devices": _devices(),
    },
    sort_keys=True,
    default=repr,
  )
  return hashlib.sha256(text.encode()).hexdigest()


def lower(
  jitted,
  args: tuple,
  *,
  name: str,
  donate_argnums: tuple[int, ...],
  config: dict,
  folder: Path,
  data: str = "",
):
  """``jitted.lower(*args)``, through the program kept in ``folder`` under the program's key.

  Returns ``(lowered, how)``: ``how`` is "read" (the module came from ``folder``), "exported"
  (traced now and written there) or "traced" (traced now without the cache: several processes,
  or the export failed). ``jitted``: a ``jax.jit`` function whose own shardings and donation
  are those of ``args`` and ``donate_argnums``; the returned lowering takes the same arguments
  and donates the same ones.
  """
  if jax.process_count() > 1:
    return jitted.lower(*args), "traced"
  path = Path(folder) / f"{name}-{key(name, args, donate_argnums, config, data)}.bin"
  leaves, in_tree = jax.tree.flatten(args)
  if path.exists():
    try:
      with path.open("rb") as f:
        saved = pickle.load(f)
      program, out_tree = export.deserialize(saved["module"]), saved["out_tree"]
      return _call(program, out_tree, jitted, donate_argnums).lower(*args), "read"
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: trace instead
      log.warning("program %s in %s could not be read back (%s): tracing it", name, path, e)
  out_trees = []

  def flat(*leaves):
    out = jitted(*jax.tree.unflatten(in_tree, leaves))
    out_leaves, out_tree = jax.tree.flatten(out)
    out_trees.append(out_tree)
    return out_leaves

  avals = [
    jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=_sharding(x), weak_type=bool(getattr(x, "weak_type", False))
    )
    for x in leaves
  ]
  try:
    program = export.export(jax.jit(flat), disabled_checks=_CHECKS)(*avals)
  except Exception as e:  # noqa: BLE001 - e.g. an effect or a primitive export refuses
    log.warning("program %s could not be exported (%s): traced without the program cache", name, e)
    return jitted.lower(*args), "traced"
  _write(path, {"module": program.serialize(), "out_tree": out_trees[0]})
  return _call(program, out_trees[0], jitted, donate_argnums).lower(*args), "exported"


def _sharding(x):
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _call(program: export.Exported, out_tree, jitted, donate_argnums: tuple[int, ...]):
  """A jitted call of ``program`` on the unflattened arguments, named as ``jitted`` (JAX's
  logs and profiles show the same ``jit(<name>)`` either way)."""

  def call(*args):
    return jax.tree.unflatten(out_tree, program.call(*jax.tree.leaves(args)))

  call.__name__ = call.__qualname__ = getattr(jitted, "__name__", "program")
  return jax.jit(call, donate_argnums=donate_argnums)


def _write(path: Path, saved: dict) -> None:
  """Writes atomically: a concurrent run reads the whole file or none (another run of the same
  key writing the same program at once is harmless: the last rename wins)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
  try:
    with os.fdopen(fd, "wb") as f:
      pickle.dump(saved, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise
