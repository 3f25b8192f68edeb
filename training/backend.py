"""Where a run computes, said at its start, and XLA's deterministic mode.

:func:`report` logs JAX's version, backend and devices, and one warning when ``nvidia-smi``
lists a GPU while JAX runs on the CPU (its CUDA plugin is not installed, or failed to start):
the run would go on, silently hundreds of times slower. :func:`use_deterministic` sets XLA's
flags for run-to-run reproducible GPU programs (config ``deterministic``); XLA reads them when
JAX starts its backend, so it must come before any JAX work (train.py and evaluate.py call it
first, in ``training.run_setup.prepare``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence

import jax

from training.config_check import ConfigError

log = logging.getLogger("train")

# The fix the CPU-fallback warning names: the framework's GPU install (Makefile), or the pinned
# jax's CUDA build for an environment of one's own.
GPU_INSTALL = 'make venv GPU=1 (or pip install "jax[cuda13]=={version}")'

# XLA:GPU's run-to-run reproducible mode ("Guarantees run-to-run determinism on GPU", its help
# in jaxlib 0.11.2): deterministic implementations of the operations that otherwise accumulate
# with atomics (scatter-adds, cuDNN's and cuBLAS's nondeterministic algorithms), and kernels
# chosen without timing them, so that every compilation picks the same ones (another flag's
# help there: "when autotuning is disabled (e.g., in deviceless or deterministic mode)").
# --xla_gpu_autotune_level=0 is not added: all autotuning off left the convolutions untuned
# (Adam's ResNet-18 step 1.1 s against 4.9 ms, docs/benchmarks.md).
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true",)


def nvidia_gpus() -> list[str]:
  """The GPUs ``nvidia-smi -L`` lists; [] without nvidia-smi or when it fails."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return []
  try:
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return []
  if out.returncode != 0:
    return []
  return [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]


def cpu_fallback_warning(backend: str, gpus: Sequence[str], platforms: str | None) -> str | None:
  """The warning for JAX on the CPU beside a GPU ``nvidia-smi`` lists; None when JAX runs
  on an accelerator, no GPU is listed, or the CPU was asked for (``JAX_PLATFORMS=cpu``)."""
  asked = {p.strip() for p in (platforms or "").split(",") if p.strip()}
  if backend != "cpu" or not gpus or asked == {"cpu"}:
    return None
  return (
    f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}) but JAX {jax.__version__} runs on the "
    f"CPU: its CUDA plugin is missing or failed to start (JAX logs why, if it tried). "
    f"Install it: {GPU_INSTALL.format(version=jax.__version__)}."
  )


def report(probe: Callable[[], list[str]] = nvidia_gpus, platforms: str | None = None) -> None:
  """Logs the backend and devices this process computes on, and the CPU-fallback warning
  (``probe``: the GPUs the machine has, by default :func:`nvidia_gpus`; ``platforms``: the
  platforms asked for, by default JAX's ``jax_platforms``, i.e. ``JAX_PLATFORMS``)."""
  devices = jax.devices()
  kinds = sorted({d.device_kind for d in devices})
  log.info(
    "JAX %s on %s: %d device(s), %s",
    jax.__version__,
    jax.default_backend(),
    len(devices),
    ", ".join(kinds),
  )
  asked = jax.config.jax_platforms if platforms is None else platforms
  if jax.default_backend() == "cpu" and (asked or "").strip() != "cpu":  # else: no probe needed
    warning = cpu_fallback_warning("cpu", probe(), asked)
    if warning:
      log.warning("%s", warning)


def with_flags(xla_flags: str, flags: Sequence[str]) -> str:
  """``xla_flags`` (an ``XLA_FLAGS`` value) with ``flags`` set: another value of the same flag
  is replaced, every other flag kept."""
  names = {f.split("=", 1)[0] for f in flags}
  kept = [f for f in xla_flags.split() if f.split("=", 1)[0] not in names]
  return " ".join([*kept, *flags])


def backend_started() -> bool:
  """Whether this process's JAX backends exist already (XLA has read ``XLA_FLAGS`` then)."""
  from jax._src import xla_bridge  # no public API says whether the backends exist

  return xla_bridge.backends_are_initialized()


def use_deterministic(deterministic: bool) -> None:
  """Sets :data:`DETERMINISTIC_XLA_FLAGS` in ``XLA_FLAGS`` (``deterministic=true``). Raises
  ConfigError when the backend has started without them: set now, they would not apply."""
  if not deterministic:
    return
  flags = with_flags(os.environ.get("XLA_FLAGS", ""), DETERMINISTIC_XLA_FLAGS)
  if backend_started():
    if set(os.environ.get("XLA_FLAGS", "").split()) >= set(DETERMINISTIC_XLA_FLAGS):
      return  # this process started its backend with them (a second run in one process)
    raise ConfigError(
      "deterministic=true: JAX's backend started before the run could set XLA's flags "
      f"({' '.join(DETERMINISTIC_XLA_FLAGS)}); run train.py in a fresh process, or set them in "
      "XLA_FLAGS before importing JAX."
    )
  os.environ["XLA_FLAGS"] = flags
