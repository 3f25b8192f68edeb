"""Ginger's update with the Pallas passes under other tilings, against Adam in the same process.

    python -m bench.kernel_tiling                          # GPU: ResNet-18 shapes, tau 8 and 32
    python -m bench.kernel_tiling --taus 8 --scan 20 --repeats 5
    python -m bench.kernel_tiling --taus 8 --min-padded-ranks 8 16  # rank 8 in 8 or 16 lanes
    python -m bench.kernel_tiling --taus 32 --tile-rows 64 --steps 1 --rotate-tile-rows 0 128

The kernels of :mod:`ginger._src.pallas_passes` stream each program's rows as ``steps`` tiles
of ``tile x kp`` elements of ``U`` (``tile = min(max_tile_rows, tile_elements / kp)``, ``kp``
the rank padded to a power of two >= ``min_padded_rank``; ``tile_rows[kp]`` where given; pass
3 pads to ``rotate_min_padded_rank`` and takes ``rotate_tile_rows[kp]`` where given) with
``num_warps`` warps and ``num_stages`` Triton pipelining stages: the fields of
:class:`ginger._src.tuning.Tuning`. This times the whole update
(``bench.optimizer_step.time_update``: ``tx.update`` + ``optax.apply_updates`` in a jitted
``lax.scan``, median of repeats) for ``block=per_tensor`` in two rounds: (1) lanes
(``min_padded_rank``, ``--min-padded-ranks``) x tile rows (``--tile-rows``) x pass 3's tile
rows (``--rotate-tile-rows``, 0: the other passes') x steps (``--steps``) at the default warps
and stages; (2) the best of round 1 x warps x stages (``--no-round-two`` skips it). Each
configuration is a ``Tuning`` given to the optimizer; every row is its own compiled program.
A row that fails to compile (e.g. Triton out of registers or shared memory) says so and the
sweep goes on.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys

import jax
import optax

import ginger
from bench.optimizer_step import resnet18_shapes, time_update
from ginger._src import pallas_passes
from ginger._src.tuning import DEFAULT, Tuning

TILE_ROWS = (64, 128, 256, 512, 1024)
STEPS = (1, 2, 4, 8)
WARPS = (2, 4, 8)
STAGES = (None, 1, 2, 3)


def _setting(
  lanes: int,
  tile_rows: int,
  rotate_rows: int,
  steps: int,
  warps: int,
  stages: int | None,
  tau: int,
):
  kp = max(lanes, pallas_passes._pow2(tau))  # the padded rank at min_padded_rank = lanes
  rotate_kp = pallas_passes.tiling(1, tau, rotate=True)[2]  # pass 3's (its lanes are not swept)
  return Tuning(
    min_padded_rank=lanes,
    tile_rows={},
    rotate_tile_rows={rotate_kp: rotate_rows} if rotate_rows else {},
    tile_elements=tile_rows * kp,
    max_tile_rows=tile_rows,
    steps=steps,
    num_warps=warps,
    num_stages=stages,
  )


def _time(tau: int, tuning: Tuning, shapes, scan: int, repeats: int) -> float | None:
  try:
    tx = ginger.ginger(1e-3, tau=tau, block="per_tensor", passes="pallas", tuning=tuning)
    return time_update(tx, shapes, scan, repeats)[0]
  except Exception as e:  # noqa: BLE001 (a tiling Triton cannot compile: report, go on)
    print(f"  ({tuning}: {type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
    return None


def _sweep(tau: int, args, shapes, adam: float) -> None:
  """Rounds 1 and 2 for one rank, a table row per configuration as it is timed."""
  results: dict[tuple, float | None] = {}

  def run(round_: int, *key):
    if key not in results:
      ms = results[key] = _time(tau, _setting(*key, tau), shapes, args.scan, args.repeats)
      cells = "failed | " if ms is None else f"{ms * 1e3:.3f} | {ms / adam:.2f}"
      print(f"| {tau} | {round_} | {' | '.join(map(str, key))} | {cells} |", flush=True)

  grid = (args.min_padded_ranks, args.tile_rows, args.rotate_tile_rows, args.steps)
  for lane, tile_rows, rotate_rows, steps in itertools.product(*grid):
    run(1, lane, tile_rows, rotate_rows, steps, DEFAULT.num_warps, DEFAULT.num_stages)
  timed = {k: v for k, v in results.items() if v is not None}
  if not timed or args.no_round_two:
    return
  best_round_one = min(timed, key=timed.get)[:4]
  for warps, stages in itertools.product(WARPS, STAGES):
    run(2, *best_round_one, warps, stages)
  timed = {k: v for k, v in results.items() if v is not None}
  best = min(timed, key=timed.get)
  print(
    f"best tau={tau}: lanes, tile rows, pass 3 tile rows, steps, warps, stages = {best}: "
    f"{timed[best] * 1e3:.3f} ms"
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--taus", nargs="+", type=int, default=[8, 32])
  parser.add_argument(
    "--min-padded-ranks", nargs="+", type=int, default=[16], help="min_padded_rank values"
  )
  parser.add_argument("--tile-rows", nargs="+", type=int, default=list(TILE_ROWS))
  parser.add_argument(
    "--rotate-tile-rows",
    nargs="+",
    type=int,
    default=[0],
    help="pass 3's rows per tile (rotate_tile_rows; 0: the other passes')",
  )
  parser.add_argument("--steps", nargs="+", type=int, default=list(STEPS))
  parser.add_argument("--no-round-two", action="store_true", help="skip warps x stages")
  parser.add_argument("--scan", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  shapes = resnet18_shapes()
  adam = time_update(optax.adam(1e-3), shapes, args.scan, args.repeats)[0]
  print(
    f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC device={device.device_kind} "
    f"jax={jax.__version__}; ResNet-18 shapes, block=per_tensor, passes=pallas; "
    f"adam {adam * 1e3:.3f} ms/update; defaults {DEFAULT}"
  )
  print(
    "| tau | round | lanes | tile rows | pass 3 tile rows | steps | warps | stages | ms/update "
    "| x Adam |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for tau in args.taus:
    _sweep(tau, args, shapes, adam)


if __name__ == "__main__":
  main()
