"""Time one Ginger update of the authors' public code against ours, in one process.

    python -m bench.authors_step --authors .authors                  # resnet18 and 1M, tau 8
    python -m bench.authors_step --authors .authors --sizes resnet18 --taus 8 32 \
        --scan 10 --repeats 3

``--authors`` is a checkout of https://github.com/MANGA-UOFA/Ginger (not vendored here: its
license is unknown). One way to get one without network access on the machine that runs
this: on a machine that has it, ``git archive HEAD | tar -x -C .authors`` inside this
repository (``/.authors/`` is ignored via ``.git/info/exclude``), then carry ``.authors``.

What is compared. Both optimizers are composed as the authors compose theirs
(``optimizers/ginger.py``, ``configs/optimizer/ginger.yaml``): bias-corrected momentum
``m = EMA_b1(g)`` -> fold the sampled-Fisher vector ``d`` into the curvature -> precondition
``m`` with the updated ``G`` -> clip every entry to ``[-rho, rho]`` -> ``-lr``. Parameters:
``tau`` from the command line, ``alpha`` (their ``b2``) 0.99, ``gamma`` (their ``damping``)
1e-5, ``rho`` 1, ``b1`` 0.9, one ``(U, sigma)`` per parameter tensor (ours:
``block="per_tensor"``, the only layout their code has), float32.

The interface. Their ``update(grads, state, ngrads)`` takes the Fisher vector ``ngrads`` as
the third positional argument (their ``img_cls.py`` passes the gradient of the loss at sampled
labels, scaled by ``sqrt(batch)``); ours takes it as ``fisher_grads=``:
``update(grads, state, params, fisher_grads=d)``. Both get the same ``g`` and ``d``. Their code
calls ``jax.tree_map`` (removed from JAX since 0.6) and ``jax.flatten_util`` without importing
it: the loader adds ``jax.tree_map = jax.tree_util.tree_map`` when it is missing and imports
``jax.flatten_util``; nothing else of theirs is changed. Their ``optimizers/`` package is
loaded from the given path under a private name (``_authors_optimizers``) rather than by
putting the checkout on ``sys.path``, where its ``models.py`` would shadow our ``models``.

How it is timed (same method for both, as ``bench.optimizer_step``): each step is
``tx.update`` followed by ``optax.apply_updates`` (so every update entry is consumed), ``--scan``
steps inside one jitted ``lax.scan``, the carry (state, params) donated, compiled and run once
as warm-up, then ``--repeats`` timed runs; the two optimizers' runs alternate, so that load
from other processes on a shared machine falls on both alike; the median is reported. Every
step gets its own random gradient and Fisher vector (stacked ``(scan, ...)`` arrays, the scan's
``xs``: arguments, not constants, and not the same vector twice, which would leave the
curvature update nothing new to fold in).

Numerical agreement (``--agreement-steps``, on a tiny problem, against each other and against
a float64 dense definition of the composed update): the two implementations solve the same
recursion differently. Theirs works in inverse space: it keeps ``M = U diag(s') U^T`` with
``G^{-1} = I/gamma - M``, Sherman-Morrison-updates ``M`` (an SVD of the ``(tau+1)^2`` core),
truncates to rank ``tau`` there and maps back ``sigma = gamma^2 s' / (1 - gamma s')``; with
``gamma = 1e-5`` in float32, ``s'`` is about ``1/gamma`` and the curvature is lost to
cancellation (docs/ginger-math.md, sections 4 and 10). Ours updates ``S`` itself (Brand's
eigen-update, a secular solve) and applies the Woodbury split. So the two agree to float32
rounding where the inverse space is well conditioned (``gamma = 1e-2``) and, at
``gamma = 1e-5``, until the truncation starts (step ``tau + 1``); after that theirs departs
from the definition and ours does not. With ``rho = 1`` the difference shows as entries
clipped to opposite signs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import pathlib
import platform
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ginger
from bench.optimizer_step import SIZES

AUTHORS_URL = "https://github.com/MANGA-UOFA/Ginger"
# The authors' files this harness needs, relative to the checkout.
AUTHORS_FILES = ("optimizers/ginger.py", "optimizers/utils.py")
_PACKAGE = "_authors_optimizers"

# As the authors compose Ginger (configs/optimizer/ginger.yaml), tau aside.
ALPHA, GAMMA, RHO, B1 = 0.99, 1e-5, 1.0, 0.9
LEARNING_RATE = 2e-4  # theirs; a constant: the time does not depend on it


def load_authors(root) -> types.ModuleType:
  """The authors' ``optimizers.ginger`` module from the checkout at ``root``.

  Raises FileNotFoundError naming ``root`` and the expected file when it is not a checkout.
  """
  root = pathlib.Path(root).expanduser()
  for rel in AUTHORS_FILES:
    if not (root / rel).is_file():
      raise FileNotFoundError(
        f"--authors {str(root)!r}: expected the file {str(root / rel)!r} there (a checkout "
        f"of {AUTHORS_URL}; this harness imports its optimizers/ginger.py). Get one with "
        f"`git clone {AUTHORS_URL} {root}`, or copy a checkout there."
      )
  # Their code targets jax 0.4: jax.tree_map is gone since 0.6 (same function as
  # jax.tree_util.tree_map) and jax.flatten_util is a submodule they never import.
  import jax.flatten_util  # noqa: F401

  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree_util.tree_map
  pkg_dir = (root / "optimizers").resolve()
  package = sys.modules.get(_PACKAGE)
  if package is None or list(package.__path__) != [str(pkg_dir)]:
    # A bare package over their folder: their relative `from .utils import ...` resolves in
    # it, and their __init__ (which imports the rest of their optimizers) is not run.
    for name in [m for m in sys.modules if m == _PACKAGE or m.startswith(_PACKAGE + ".")]:
      del sys.modules[name]
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(pkg_dir)]
    sys.modules[_PACKAGE] = package
  return importlib.import_module(f"{_PACKAGE}.ginger")


def make_pair(authors: types.ModuleType, tau: int, gamma: float = GAMMA, rho=RHO):
  """``{"authors": step, "ours": step}``, each ``step(state, params, g, d) -> (state,
  params, updates)`` one update (not applied), with the optimizer's ``init`` as ``step.init``."""
  theirs = authors.ginger(LEARNING_RATE, b1=B1, b2=ALPHA, tau=tau, damping=gamma, rho=rho)
  ours = ginger.ginger(
    LEARNING_RATE, tau=tau, alpha=ALPHA, gamma=gamma, b1=B1, rho=rho, block="per_tensor"
  )

  def authors_step(state, params, g, d):
    updates, state = theirs.update(g, state, d)  # their third argument is the Fisher vector
    return state, params, updates

  def ours_step(state, params, g, d):
    updates, state = ours.update(g, state, params, fisher_grads=d)
    return state, params, updates

  authors_step.init, ours_step.init = theirs.init, ours.init
  return {"authors": authors_step, "ours": ours_step}


def random_inputs(shapes, steps: int, seed: int = 0):
  """Params, and per step a gradient and a Fisher vector (leaves ``(steps, *shape)``)."""
  kp, kg, kd = jax.random.split(jax.random.key(seed), 3)

  def draw(key, lead, scale):
    keys = jax.random.split(key, len(shapes))
    return [
      scale * jax.random.normal(k, lead + s, jnp.float32) for k, s in zip(keys, shapes, strict=True)
    ]

  return draw(kp, (), 1.0), draw(kg, (steps,), 0.01), draw(kd, (steps,), 0.02)


def scan_runner(step):
  """A jitted ``(state, params, gs, ds) -> (state, params)`` over the leading axis of gs/ds."""

  def run(state, params, gs, ds):
    def body(carry, gd):
      state, params, updates = step(*carry, *gd)
      return (state, optax.apply_updates(params, updates)), None

    return jax.lax.scan(body, (state, params), (gs, ds))[0]

  return jax.jit(run, donate_argnums=(0, 1))


def time_pair(steps: dict, shapes, scan: int, repeats: int) -> dict[str, float]:
  """Median seconds per update of each of ``steps`` (runs alternate between them)."""
  params, gs, ds = random_inputs(shapes, scan)
  compiled, carries = {}, {}
  for name, step in steps.items():
    carry = (step.init(params), [jnp.array(p) for p in params])  # own copy: it is donated
    compiled[name] = scan_runner(step).lower(*carry, gs, ds).compile()
    carries[name] = jax.block_until_ready(compiled[name](*carry, gs, ds))  # warm-up
  times: dict[str, list[float]] = {name: [] for name in steps}
  for _ in range(repeats):
    for name in steps:
      start = time.perf_counter()
      carries[name] = jax.block_until_ready(compiled[name](*carries[name], gs, ds))
      times[name].append((time.perf_counter() - start) / scan)
  return {name: statistics.median(t) for name, t in times.items()}


AGREEMENT_SHAPES = [(16, 12), (24,), (3,)]  # (3,): a tensor smaller than tau


def dense_reference(gs, ds, tau: int, gamma: float, rho) -> list[np.ndarray]:
  """The composed update in float64 by definition, per tensor and step: ``m`` the debiased
  EMA of ``g``, ``S = top_tau(alpha S + (1 - alpha) d d^T)`` by a full eigendecomposition,
  ``u = -lr clip((gamma I + S)^{-1} m, rho)``. Returns each step's update, concatenated."""
  steps = gs[0].shape[0]
  mus = [np.zeros(x.shape[1:]) for x in gs]
  s_mats = [np.zeros((x[0].size, x[0].size)) for x in gs]
  out = []
  for t in range(steps):
    step = []
    for i, (g, d) in enumerate(zip(gs, ds, strict=True)):
      g, d = np.asarray(g[t], np.float64).ravel(), np.asarray(d[t], np.float64).ravel()
      mus[i] = B1 * mus[i].ravel() + (1 - B1) * g
      w, v = np.linalg.eigh(ALPHA * s_mats[i] + (1 - ALPHA) * np.outer(d, d))
      w, v = np.maximum(w[::-1][:tau], 0.0), v[:, ::-1][:, :tau]
      s_mats[i] = (v * w) @ v.T
      u = np.linalg.solve(gamma * np.eye(g.size) + s_mats[i], mus[i] / (1 - B1 ** (t + 1)))
      step.append(-LEARNING_RATE * (np.clip(u, -rho, rho) if rho is not None else u))
    out.append(np.concatenate(step))
  return out


def agreement(authors, tau: int, gamma: float, rho, steps: int) -> dict[str, float]:
  """Max over ``steps`` of ``max|x - y| / max|y|`` between the updates of the authors' code,
  ours and :func:`dense_reference` (float64), on a tiny problem: keys ``"ours-authors"``
  (relative to the authors'), ``"ours-ref"`` and ``"authors-ref"`` (relative to the
  reference)."""
  pair = make_pair(authors, tau, gamma, rho)
  params, gs, ds = random_inputs(AGREEMENT_SHAPES, steps, seed=1)
  reference = dense_reference(gs, ds, tau, gamma, rho)
  states = {name: step.init(params) for name, step in pair.items()}
  jitted = {name: jax.jit(step) for name, step in pair.items()}
  worst = {"ours-authors": 0.0, "ours-ref": 0.0, "authors-ref": 0.0}

  def rel(x, y):
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))

  for t in range(steps):
    g = [x[t] for x in gs]
    d = [x[t] for x in ds]
    out = {}
    for name, step in jitted.items():
      states[name], _, updates = step(states[name], params, g, d)
      out[name] = np.concatenate([np.asarray(x, np.float64).ravel() for x in updates])
    for key, x, y in (
      ("ours-authors", out["ours"], out["authors"]),
      ("ours-ref", out["ours"], reference[t]),
      ("authors-ref", out["authors"], reference[t]),
    ):
      worst[key] = max(worst[key], rel(x, y))
  return worst


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
  return value


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--authors", required=True, help=f"path to a checkout of {AUTHORS_URL} (not vendored)"
  )
  parser.add_argument("--sizes", nargs="+", default=["resnet18", "1M"], choices=list(SIZES))
  parser.add_argument("--taus", nargs="+", type=_positive, default=[8])
  parser.add_argument("--scan", type=_positive, default=10, help="updates per timed call")
  parser.add_argument("--repeats", type=_positive, default=3, help="timed calls per optimizer")
  parser.add_argument(
    "--agreement-steps",
    type=int,
    default=12,
    help="steps of the tiny agreement check, more than tau to exercise the truncation to "
    "rank tau (0: skip it)",
  )
  args = parser.parse_args(argv)
  try:
    authors = load_authors(args.authors)
  except FileNotFoundError as e:
    parser.error(str(e))

  device = jax.devices()[0]
  print(
    f"# {datetime.date.today()} device={device.device_kind} platform={device.platform} "
    f"cpu={platform.processor() or platform.machine()} jax={jax.__version__} "
    f"optax={optax.__version__} scan={args.scan} repeats={args.repeats} "
    f"(alpha={ALPHA} gamma={GAMMA} rho={RHO} b1={B1}, per-tensor blocks)"
  )
  print("| size | d | tau | authors ms | ours ms | ours/authors |")
  print("|---|---|---|---|---|---|")
  for size in args.sizes:
    shapes = SIZES[size]()
    d = sum(math.prod(s) for s in shapes)
    for tau in args.taus:
      t = time_pair(make_pair(authors, tau), shapes, args.scan, args.repeats)
      print(
        f"| {size} | {d / 1e6:.1f}M | {tau} | {1e3 * t['authors']:.2f} | {1e3 * t['ours']:.2f} "
        f"| {t['ours'] / t['authors']:.2f} |",
        flush=True,
      )
  if args.agreement_steps > 0:
    n = args.agreement_steps
    print(
      f"\nAgreement of the updates, {n} steps on shapes {AGREEMENT_SHAPES} (max over steps of "
      f"max|x - y| / max|y|; ref: the float64 dense definition)\n"
    )
    print("| tau | gamma | rho | ours vs authors | ours vs ref | authors vs ref |")
    print("|---|---|---|---|---|---|")
    for tau in args.taus:
      for gamma in (GAMMA, 1e-2):
        for rho in (RHO, None):
          w = agreement(authors, tau, gamma, rho, n)
          print(
            f"| {tau} | {gamma:g} | {rho} | {w['ours-authors']:.1e} | {w['ours-ref']:.1e} "
            f"| {w['authors-ref']:.1e} |",
            flush=True,
          )


if __name__ == "__main__":
  main()
