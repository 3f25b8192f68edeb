"""On an NVIDIA GPU: are this install's compiled kernels right, and how fast is a step?

    make gpu-check GPU=1                          # = python -m bench.gpu_check
    python -m bench.gpu_check --only kernels update bf16    # the numerical checks alone

Four checks, each reported pass or FAIL with its time:

* ``kernels``: :mod:`bench.kernels_check` at ResNet-18's per-tensor buckets, tau 8 and 32:
  every Pallas pass compiled by Triton against the jnp pass and a float64 reference (Higham's
  bounds), and the step's temporaries;
* ``update``: :mod:`bench.update_check`, ResNet-18's shapes, tau 8 and 32, 10 steps: the whole
  update with the Pallas passes against a float64 state;
* ``bf16``: a bfloat16 state (:func:`check_bf16_state`) fed curvature directions partly outside
  ``span(U)``, compiled Pallas passes against a float64 state;
* ``steps``: Adam's and Ginger's (tau 8) ResNet-18 training steps, batch 128, on synthetic
  CIFAR-10 images (:mod:`bench.train_step`, each run in its own ``train.py`` process): the
  median ms per step is printed, not judged; a run that fails fails the check.

Exit status 0 when every check passed, 1 when one failed, 2 without a GPU (nothing run).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import ginger
from bench import kernels_check, train_step, update_check
from training import backend

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("kernels", "update", "bf16", "steps")
# The bfloat16 case: Ginger's in-span test (ginger._src.brand._after_residual)
# counts a curvature direction v in span(U) when its residual is below 32 eps ||v||: a quarter
# of ||v|| for bfloat16 (eps 2^-7). The inputs' parts outside span are well above that.
IN_SPAN_EPS = 32
OUT_OF_SPAN = 0.5  # ||part of d outside the directions' span|| / ||d||, by construction
BF16_GAMMA, BF16_ALPHA = 0.25, 0.9  # with ||d|| = 1: sigma <= ~0.3, G's condition <= ~2.2
STEP_RUNS = ("adam", "ginger tau=8 (d-pass: eval forward)")


def span_inputs(rows: int, tau: int, steps: int, fraction: float = OUT_OF_SPAN, seed: int = 0):
  """Per step ``(g, d)`` (float32 numpy): ``d`` of unit norm, a random combination of ``tau``
  fixed orthonormal directions plus a part orthogonal to them of norm ``fraction``; ``g``
  random. After the first steps ``U`` holds mostly the fixed directions, so each new ``d`` lies
  partly in ``span(U)`` and partly outside."""
  rng = np.random.default_rng(seed)
  basis, _ = np.linalg.qr(rng.standard_normal((rows, tau)))
  out = []
  for _ in range(steps):
    inside = basis @ rng.standard_normal(tau)
    outside = rng.standard_normal(rows)
    outside -= basis @ (basis.T @ outside)
    d = np.sqrt(1 - fraction**2) * inside / np.linalg.norm(inside)
    d += fraction * outside / np.linalg.norm(outside)
    out.append((rng.standard_normal(rows).astype(np.float32), d.astype(np.float32)))
  return out


def run_state(data, tau: int, dtype: str, passes: str, device, record: bool = False):
  """Every step's update (float64 numpy) of a ``dtype`` state on ``device``; with ``record``
  also, per step, ``||d - U U^T d|| / ||d||`` for the state's ``U`` before it, and the largest
  ``sigma`` at the end."""
  tx = ginger.scale_by_ginger(
    tau, BF16_ALPHA, BF16_GAMMA, state_dtype=dtype, passes=passes, reorthonormalise_every=0
  )
  with jax.default_device(device):
    state = tx.init([jnp.zeros(data[0][0].size, dtype)])
    update = jax.jit(lambda g, s, d: tx.update(g, s, fisher_grads=d))
    outs, fractions = [], []
    for g, d in data:
      if record:
        u, v = np.asarray(state.u.leaf(0), np.float64), np.asarray(d, np.float64)
        fractions.append(float(np.linalg.norm(v - u @ (u.T @ v)) / np.linalg.norm(v)))
      (out,), state = update([jax.device_put(g, device)], state, [jax.device_put(d, device)])
      outs.append(np.asarray(out, np.float64))
    sigma = max(float(jnp.max(s)) for s in jax.tree.leaves(state.sigma))
  return outs, fractions, sigma


def bf16_verdicts(got, exact, fractions, sigma: float) -> tuple[float, list[tuple]]:
  """The bound and, per step, ``(fraction outside span, relative error, ok)`` of a bfloat16
  state's updates ``got`` against the float64 state's ``exact`` (:func:`check_bf16_state`)."""
  finfo = jnp.finfo(jnp.bfloat16)
  unit, threshold = float(finfo.eps) / 2, IN_SPAN_EPS * float(finfo.eps)
  bound = 8 * (BF16_GAMMA + sigma) / BF16_GAMMA * unit
  rows = []
  for a, b, fraction in zip(got, exact, fractions, strict=True):
    err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    rows.append((fraction, err, err <= bound and fraction > threshold))
  return bound, rows


def check_bf16_state(rows: int, tau: int, steps: int, passes: str, device) -> bool:
  """A bfloat16 state with ``passes`` on ``device`` against a float64 state (jnp passes, CPU)
  on :func:`span_inputs`. Storing ``U`` and ``sigma`` to bfloat16's unit roundoff ``u`` each
  step moves the update ``G^{-1} g`` (``G = gamma I + U diag(sigma) U^T``) by a few ``u``
  times ``G``'s condition number ``kappa = (gamma + sigma_max) / gamma``, and alpha forgets
  older roundings: a step passes when its relative error is at most ``8 kappa u``, the bound of
  tests/test_ginger.py's half-precision test (8 u at kappa <= 1.5) at this ``kappa``. The case
  is what it claims only if every step's ``d`` lies outside ``span(U)`` by more than the in-span
  threshold (``32 eps``, a quarter of ``||d||``): checked too. Prints a row per step; True
  when all pass."""
  data = span_inputs(rows, tau, steps)
  with jax.enable_x64(True):  # 64-bit mode for the reference only
    exact, fractions, sigma = run_state(data, tau, "float64", "jnp", jax.devices("cpu")[0], True)
  got, _, _ = run_state(data, tau, "bfloat16", passes, device)
  bound, verdicts = bf16_verdicts(got, exact, fractions, sigma)
  unit = float(jnp.finfo(jnp.bfloat16).eps) / 2
  print(
    f"# bf16 state, passes={passes}: d={rows} tau={tau} gamma={BF16_GAMMA} alpha={BF16_ALPHA} "
    f"sigma_max={sigma:.3g}: bound 8 kappa u = {bound:.3g} ({bound / unit:.1f} u)"
  )
  print("| step | ||d outside span U|| / ||d|| | rel err | err / u | ok |")
  print("|---|---|---|---|---|")
  for step, (fraction, err, ok) in enumerate(verdicts):
    print(
      f"| {step} | {fraction:.3f} | {err:.3g} | {err / unit:.2f} | {'pass' if ok else 'FAIL'} |"
    )
  return all(ok for _, _, ok in verdicts)


def step_times(steps: int, out: Path) -> bool:
  """Adam's and Ginger's ResNet-18 steps on synthetic CIFAR-10 images (bench.train_step's
  runs, each a train.py process); prints ms per step. True when both runs completed."""
  sys.path.insert(0, str(ROOT / "tests"))
  from fakes import cifar_pickle_folder

  data = cifar_pickle_folder(Path(tempfile.mkdtemp()), "cifar10", 2560, 500)
  print("| run | ms/step | examples/s | x Adam | compile+run s |")
  print("|---|---|---|---|---|")
  ok, adam = True, None
  for name in STEP_RUNS:
    start = time.perf_counter()
    summary = train_step.run("resnet18", name, str(data), steps, out, 600, [])
    wall = time.perf_counter() - start
    t = summary.get("step_time_s")
    if not t:
      print(f"| {name} | FAILED | | | {wall:.0f} |", flush=True)
      ok = False
      continue
    adam = t if name == "adam" else adam
    ratio = f"{t / adam:.2f}" if adam else ""
    print(
      f"| {name} | {1e3 * t:.2f} | {summary.get('examples_per_s'):.0f} | {ratio} | {wall:.0f} |",
      flush=True,
    )
  return ok


def run_check(name: str, args) -> bool:
  device = jax.devices()[0]
  if name == "kernels":
    argv = ["--taus", "8", "32", "--blocks", "per_tensor"]
    return kernels_check.main(argv) == 0
  if name == "update":
    return update_check.check("resnet18", [8, 32], 10) == 0
  if name == "bf16":
    return check_bf16_state(1 << 20, 8, 24, "pallas", device)
  return step_times(args.steps, args.out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
  parser.add_argument("--steps", type=int, default=60, help="training steps per timed run")
  parser.add_argument("--out", type=Path, default=Path("outputs/gpu_check"))
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    why = backend.cpu_fallback_warning(
      jax.default_backend(), backend.nvidia_gpus(), jax.config.jax_platforms
    )
    print(
      f"gpu-check needs an NVIDIA GPU: JAX {jax.__version__} runs on "
      f"{jax.default_backend()} here. {why or 'No GPU: nothing checked.'}"
    )
    return 2
  device = jax.devices()[0]
  print(
    f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {device.device_kind} "
    f"x{jax.device_count()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}"
  )
  results = {}
  for name in args.only:
    print(f"\n## {name}", flush=True)
    start = time.perf_counter()
    results[name] = (run_check(name, args), time.perf_counter() - start)
  print("\n| check | result | s |\n|---|---|---|")
  for name, (ok, seconds) in results.items():
    print(f"| {name} | {'pass' if ok else 'FAIL'} | {seconds:.0f} |")
  failed = [name for name, (ok, _) in results.items() if not ok]
  print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
