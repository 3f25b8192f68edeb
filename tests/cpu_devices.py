"""Run a script on simulated CPU devices: XLA reads the device-count flag when JAX starts, so a
test that needs several devices runs its part in a fresh Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def with_device_count(devices: int) -> str:
  """``XLA_FLAGS`` for ``devices`` simulated CPU devices, keeping the flags already set
  (a subprocess compiles as its parent would)."""
  flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count=")
  ]
  return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


def run_on_cpu_devices(
  script: str, *args: str, devices: int = 4, timeout: int = 300, **env
) -> dict:
  """Runs ``script`` (with ``args`` as ``sys.argv[1:]``, from the repository root) in a fresh
  Python with ``devices`` CPU devices and ``env`` added to the environment; the script prints
  one JSON line last, which is returned. A failed script fails the test with its stderr."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=with_device_count(devices),
    **env,
  )
  out = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(script), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])
