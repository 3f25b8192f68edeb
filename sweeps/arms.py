"""The sweep arms, one line each: configs/sweep/arm/<name>.yaml is written from :data:`ARMS`.

An arm is an optimizer and the keys it sets over that optimizer's config (``tau``, ``rho``,
``block``, ``curvature_every``), chosen in a sweep as ``+sweep/arm=<name>`` (Hydra reads one
file per choice of a group, so each arm keeps its file; this module writes them all alike).
A new tau or optimizer is one line here, then::

    python -m sweeps.arms --write    # write configs/sweep/arm/*.yaml from ARMS
    python -m sweeps.arms --check    # exit status 1 if a file differs from what ARMS writes

tests/test_sweeps.py fails when the committed files differ from what this writes. Every arm
file loads its optimizer's config twice: as the run's optimizer and as ``default_hparams``,
whose ``lr`` is the fallback where configs/best_lr/ has no tuned lr
(configs/sweep/common/layout.yaml). No JAX.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import registry

ROOT = Path(__file__).resolve().parents[1]
ARM_DIR = ROOT / "configs" / "sweep" / "arm"
COMMAND = "python -m sweeps.arms --write"


@dataclass(frozen=True)
class Arm:
  """One arm: ``optimizer``'s config with ``settings`` over it (key, value, in file order);
  ``about`` is the first line of its file's comment (None: made from the settings)."""

  optimizer: str
  settings: tuple[tuple[str, Any], ...] = ()
  about: str | None = None


def arm(optimizer: str, about: str | None = None, **settings: Any) -> Arm:
  """``arm("ginger", tau=4)``: Ginger at tau = 4; the keys in the order given."""
  return Arm(optimizer, tuple(settings.items()), about)


# The curvature_every arms: the d-pass and the curvature update on every K-th step only.
_EVERY_K = (
  "Sweep arm: ginger with tau = 8 and the d-pass and curvature update on every {k}-th step only "
  "(curvature_every = {k}; beyond the paper, which updates every step: ginger_tau8). Used by {by}."
)
_CURVATURE_EVERY = "configs/sweep/curvature_every.yaml"
_TIME_TO_ACCURACY = (
  "the time_to_accuracy phase of sweeps/standin_campaign.sh (wall-clock time to an accuracy, "
  "against Adam)"
)
_QNG_CLIP = (
  "Sweep arm: QNG with Ginger's authors' clip (rho = 1) and per-tensor blocks, at the tau of "
  "configs/optimizer/qng.yaml (or tau=... from the sweep): the control that tells the curvature "
  "model's effect apart from the clip's. Its lr is tuned on its own (best_lr's `qng_clipped`)."
)

# The recipe arms: the optimizer again with the schedule and weight decay most training code
# uses (configs/sweep/recipe.yaml). Every arm decays the weights by the same fraction a step at
# its ResNet-18 tuned peak lr (configs/best_lr/), lr * weight_decay = 5e-5, AdamW's common 0.05
# at lr 1e-3; schedule-free AdamW keeps its warm-up without the decay of the lr it replaces.
_RECIPE = (
  "Sweep arm: {optimizer}{tau} with the common recipe instead of the paper's constant lr: "
  "{schedule}, and decoupled weight decay {wd} (lr * weight_decay = 5e-5 a step at its ResNet-18 "
  "tuned lr {lr}). Used by configs/sweep/recipe.yaml."
)


def recipe_arm(optimizer: str, lr: float, schedule: str = "warmup_cosine", **settings) -> Arm:
  """``optimizer``'s recipe arm at peak ``lr`` (its ResNet-18 tuned one): 2 epochs of linear
  warm-up, then ``schedule``'s decay; decoupled weight decay 5e-5 / lr."""
  wd = float(f"{5e-5 / lr:.3g}")
  warm = "2 epochs of linear warm-up then a cosine decay to 0"
  if schedule == "warmup_constant":
    warm = "2 epochs of linear warm-up then a constant lr (schedule-free: no decay)"
  tau = f" with tau = {settings['tau']}" if "tau" in settings else ""
  about = _RECIPE.format(optimizer=optimizer, tau=tau, schedule=warm, wd=wd, lr=lr)
  return arm(
    optimizer,
    about,
    **settings,
    schedule=schedule,
    warmup_epochs=2,
    weight_decay=wd,
    weight_decay_mode="decoupled",
  )


ARMS: Mapping[str, Arm] = {
  "momentum": arm("momentum"),
  "adam": arm("adam"),
  "qng": arm("qng"),
  **{f"qng_tau{t}": arm("qng", tau=t) for t in (1, 2, 4, 8, 16, 32)},
  "qng_clip": arm("qng", _QNG_CLIP, rho=1.0, block="per_tensor"),
  **{
    f"qng_clip_tau{t}": arm(
      "qng",
      f"Sweep arm: qng_clip (see qng_clip.yaml) with tau = {t}.",
      tau=t,
      rho=1.0,
      block="per_tensor",
    )
    for t in (4, 8)
  },
  "ginger": arm("ginger"),
  **{f"ginger_tau{t}": arm("ginger", tau=t) for t in (1, 2, 4, 8, 16, 32)},
  **{
    f"ginger_tau8_k{k}": arm("ginger", _EVERY_K.format(k=k, by=by), tau=8, curvature_every=k)
    for k, by in ((2, _CURVATURE_EVERY), (4, _CURVATURE_EVERY), (8, _CURVATURE_EVERY))
  },
  "ginger_tau8_k16": arm(
    "ginger", _EVERY_K.format(k=16, by=_TIME_TO_ACCURACY), tau=8, curvature_every=16
  ),
  "muon": arm("muon"),
  "schedule_free_adamw": arm("schedule_free_adamw"),
  "soap": arm("soap"),
  "kfac": arm(
    "kfac",
    "Sweep arm: kfac (kfac-jax's K-FAC), no tau; ResNet experiments only (the config check "
    "refuses T5).",
  ),
  "adam_recipe": recipe_arm("adam", 1e-3),
  "ginger_tau8_recipe": recipe_arm("ginger", 5e-4, tau=8),
  "muon_recipe": recipe_arm("muon", 1e-2),
  "schedule_free_adamw_recipe": recipe_arm("schedule_free_adamw", 1e-3, "warmup_constant"),
  "soap_recipe": recipe_arm("soap", 1e-3),
}


def _about(spec: Arm) -> str:
  """The arm's first comment line: ``spec.about``, or what its settings say."""
  if spec.about is not None:
    return spec.about
  if not spec.settings:
    base = f"configs/optimizer/{spec.optimizer}.yaml"
    if registry.reads(spec.optimizer, "tau"):
      return f"Sweep arm: {spec.optimizer} at the tau of {base} (or tau=... from the sweep)."
    return f"Sweep arm: {spec.optimizer}, no tau."
  said = " and ".join(f"{key} = {_show(value)}" for key, value in spec.settings)
  return f"Sweep arm: {spec.optimizer} with {said} (see {spec.optimizer}.yaml)."


def _show(value: Any) -> str:
  """A value as YAML writes it."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  return str(value)


def _wrap(text: str, width: int = 98) -> list[str]:
  """``text`` as comment lines of at most ``width`` characters."""
  lines, line = [], "#"
  for word in text.split():
    if len(line) + 1 + len(word) > width and line != "#":
      lines.append(line)
      line = "#"
    line += " " + word
  return [*lines, line]


def render(name: str, spec: Arm) -> str:
  """The text of configs/sweep/arm/<name>.yaml."""
  lines = ["# @package _global_", *_wrap(_about(spec))]
  lines += _wrap(
    "default_hparams keeps the optimizer config's own values: its lr is the fallback when "
    "configs/best_lr/ has no tuned lr (see configs/sweep/common/layout.yaml). Written by "
    f"`{COMMAND}` from sweeps/arms.py's ARMS: edit that, not this file."
  )
  lines += [
    "defaults:",
    f"  - /optimizer@default_hparams: {spec.optimizer}",
    f"  - override /optimizer: {spec.optimizer}",
    f"arm: {name}",
    *(f"{key}: {_show(value)}" for key, value in spec.settings),
  ]
  return "\n".join(lines) + "\n"


def stale(arm_dir: Path = ARM_DIR) -> list[str]:
  """What differs between ``arm_dir`` and :data:`ARMS`: a diff per file, a line per stray one."""
  out = []
  for name, spec in ARMS.items():
    path = arm_dir / f"{name}.yaml"
    have = path.read_text() if path.exists() else ""
    if have != render(name, spec):
      diff = difflib.unified_diff(
        have.splitlines(), render(name, spec).splitlines(), str(path), "ARMS", lineterm=""
      )
      out.append("\n".join(diff))
  out += [f"{p}: no arm of ARMS" for p in sorted(arm_dir.glob("*.yaml")) if p.stem not in ARMS]
  return out


def write(arm_dir: Path = ARM_DIR) -> None:
  """Writes every arm of :data:`ARMS` to ``arm_dir`` and removes the files of no arm."""
  for path in arm_dir.glob("*.yaml"):
    if path.stem not in ARMS:
      path.unlink()
  for name, spec in ARMS.items():
    (arm_dir / f"{name}.yaml").write_text(render(name, spec))


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true", help="write configs/sweep/arm/*.yaml")
  mode.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
  args = parser.parse_args(argv)
  if args.write:
    write()
    print(f"wrote {len(ARMS)} arms to {ARM_DIR.relative_to(ROOT)}")
    return 0
  problems = stale()
  if problems:
    print("\n".join(problems), file=sys.stderr)
    print(f"configs/sweep/arm/ is out of date: run `{COMMAND}`.", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
