"""docs/configuration.md, generated from configs/: every key of train.py's config with its
default, the values training/config_check.py accepts and its meaning.

    python -m training.config_doc            # print the reference
    python -m training.config_doc --write    # write docs/configuration.md (`make docs`)
    python -m training.config_doc --check    # exit status 1 if docs/configuration.md is stale

The meaning of a key is the one-line trailing ``# comment`` on its line in the YAML, the single
source: configs/config.yaml first, then the default option of its config group, then the group's
other options. A key without one, or a trailing comment continued on the next line, stops the
generator with a message naming the file and key. Detail beyond one line goes in a block comment
above the key, which the reference leaves out. A config group's choices are described by the first
sentence of each option file's leading comment.

No JAX: Hydra's compose API, OmegaConf and training.config_check only, so it runs in seconds.
tests/test_configuration_doc.py fails when the committed reference differs from what this writes.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import config_check, registry

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
DOC = ROOT / "docs" / "configuration.md"
COMMAND = "python -m training.config_doc --write"

# The config groups whose options set keys of train.py's config (the "package" of each option:
# optimizer options set top-level keys too, `# @package _global_`).
KEY_GROUPS = ("optimizer", "model", "data", "logger")
# Mapping-valued keys shown as one value, not one row per entry.
MAPPING_KEYS = ("model.size",)

# One line per config group (directories of configs/; a new one needs a line here).
GROUPS = {
  "optimizer": "the optimizer, with its own defaults for the paper-notation keys "
  "(tau, alpha, gamma, rho, block, curvature_every, lr)",
  "model": "the network (`model.*`)",
  "data": "the dataset (`data.*`)",
  "experiment": "a paper experiment or a demo: model, data and training length together",
  "logger": "where metrics go besides the run dir's `metrics.jsonl` (`logger.*`)",
  "sweep": "the runs of a paper table or study, for `train.py -m` (sweeps/README.md)",
  "sweep/arm": "one optimizer setting of a sweep (optimizer, tau, rho, block, curvature_every; "
  "a recipe arm: schedule and weight decay), written from sweeps/arms.py",
  "sweep/exp": "one experiment of a sweep at a scale (`<scale>/<experiment>`)",
  "sweep/common": "what every sweep includes: the `scale` knob, the tuned lr, the run-dir layout",
  "best_lr": "tuned learning rates, written by `python -m sweeps.best_lr` and loaded by sweep/exp",
}
# How a choice of the group is given on the command line (`+` adds a group the defaults lack).
SELECTOR = {"sweep": "+sweep="}
# Groups whose choices are listed in full, one row each (the others: one row for the group).
CHOICE_TABLES = ("optimizer", "model", "data", "experiment", "logger", "sweep")

# The tables of keys: title, one line, the keys (a trailing "." takes every key under it).
SECTIONS = (
  ("Run", "What a run is called and whether it continues.", ("name", "seed", "resume", "sweep")),
  (
    "Training",
    "The optimizer, the learning rate and its schedule, the length and the evaluations.",
    (
      "optimizer.name",
      "lr",
      "epochs",
      "max_steps",
      "batch_size",
      "schedule",
      "warmup_epochs",
      "weight_decay",
      "weight_decay_mode",
      "grad_clip",
      "optimizer.b1",
      "optimizer.b2",
      "optimizer.eps",
      "eval_every",
      "eval_batch_size",
      "eval_examples",
    ),
  ),
  (
    "Ginger and curvature",
    "The curvature model of Ginger and QNG (paper notation) and the d-pass that feeds it.",
    (
      "tau",
      "alpha",
      "gamma",
      "rho",
      "block",
      "curvature_every",
      "passes",
      "optimizer.state_dtype",
      "fisher",
      "fisher_forward",
      "fisher_backward",
      "fisher_batch",
    ),
  ),
  (
    "K-FAC",
    "K-FAC's own curvature model (`optimizer=kfac`, kfac-jax's preconditioner; docs/training.md).",
    (
      "optimizer.damping",
      "optimizer.inverse_update_period",
      "optimizer.curvature_ema",
      "optimizer.norm_constraint",
    ),
  ),
  ("Data", "The dataset (`data=...`).", ("data.",)),
  ("Model", "The network (`model=...`).", ("model.",)),
  (
    "Logging and checkpoints",
    "What a run writes, and how often.",
    (
      "log_every",
      "checkpoint_every",
      "spectrum_every",
      "profile_steps",
      "profile_start",
      "logger.",
    ),
  ),
  (
    "Hardware",
    "Devices, precision and compilation; none of these changes results beyond float rounding "
    "(except `batchnorm=per_device`).",
    ("precision", "mesh.", "batchnorm", "distributed", "compilation_cache_dir", "deterministic"),
  ),
)

# What the mapping-valued keys config_check does not check as a whole hold (their entries it
# checks one by one: model.lora.rank, ...).
ALLOWED_ELSEWHERE = {
  "model.size": "a mapping of T5Config fields (vocab_size, d_model, num_layers, ...)",
  "model.lora": "null or a mapping (rank, alpha, targets, train_1d)",
}


class DocError(ValueError):
  """The configs lack what the reference needs (a key's comment, a group's line)."""


# ------------------------------------------------------------------------------ YAML comments
_KEY = re.compile(r"([A-Za-z_][\w-]*)\s*:(?=\s|$)")


def _split_comment(text: str) -> tuple[str, str | None, int]:
  """(value, trailing comment or None, column of its '#') of the text after a key's colon."""
  quote = None
  for i, ch in enumerate(text):
    if quote:
      if ch == quote:
        quote = None
    elif ch in "\"'":
      quote = ch
    elif ch == "#" and (i == 0 or text[i - 1].isspace()):
      return text[:i].strip(), text[i + 1 :].strip(), i
  return text.strip(), None, -1


def _brackets(value: str) -> int:
  """Open flow brackets ({ [) minus closed ones, outside quotes."""
  depth, quote = 0, None
  for ch in value:
    if quote:
      quote = None if ch == quote else quote
    elif ch in "\"'":
      quote = ch
    elif ch in "{[":
      depth += 1
    elif ch in "}]":
      depth -= 1
  return depth


def is_global(path: Path) -> bool:
  """Whether a group option file puts its keys at the top level (``# @package _global_``)."""
  return any(line.strip() == "# @package _global_" for line in path.read_text().splitlines())


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
  """The trailing comment of each key of a YAML file, by dotted key (``prefix.key``).

  Raises :class:`DocError` where a trailing comment goes on over the next line (a comment-only
  line that starts in the trailing comment's column): the reference takes one line per key.
  """
  out: dict[str, str] = {}
  stack: list[tuple[int, str]] = []
  depth = 0
  comment_col = None  # column of the previous line's trailing '#'
  for lineno, line in enumerate(path.read_text().splitlines(), 1):
    if depth > 0:  # inside a flow mapping or list spanning lines
      depth += _brackets(_split_comment(line)[0])
      continue
    stripped = line.lstrip()
    indent = len(line) - len(stripped)
    if not stripped:
      comment_col = None
      continue
    if stripped.startswith("#"):
      if indent == comment_col:
        raise DocError(
          f"{path}:{lineno}: a trailing comment continued on the next line; keep it one line "
          "(the key's meaning in docs/configuration.md) and put more in a comment above the key."
        )
      continue
    comment_col = None
    match = _KEY.match(stripped)
    if stripped.startswith("-") or not match:
      continue
    while stack and stack[-1][0] >= indent:
      stack.pop()
    stack.append((indent, match.group(1)))
    value, comment, col = _split_comment(stripped[match.end() :])
    depth = _brackets(value)
    if comment:
      key = ".".join(k for _, k in stack)
      out[f"{prefix}.{key}" if prefix else key] = comment
      comment_col = indent + match.end() + col
  return out


def header_sentence(path: Path) -> str | None:
  """The first sentence of a YAML file's leading comment (after ``# @package``), or None."""
  lines = []
  for line in path.read_text().splitlines():
    if not line.startswith("#") or line.startswith("#  "):  # the end, or an indented example
      break
    text = line[1:].strip()
    if not text.startswith("@package"):
      lines.append(text)
  text = " ".join(t for t in lines if t)
  if not text:
    return None
  # A sentence ends at a full stop before a capital letter or the end ("et al. 2022" goes on).
  match = re.search(r"\.(?=\s+[A-Z`]|\s*$)", text)
  return text[: match.end()] if match else text


# ------------------------------------------------------------------------------ composing
@dataclass(frozen=True)
class Context:
  """One composed config: the default one, or one option of a key group chosen."""

  group: str | None  # None: the default config
  option: str | None
  values: dict[str, Any]  # dotted key -> value, unresolved
  allowed: dict[str, str | tuple]  # what config_check accepts there (config_check.allowed_values)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in node.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict) and value and path not in MAPPING_KEYS:
      out.update(_flatten(value, path + "."))
    else:
      out[path] = value
  return out


def options(config_dir: Path, group: str) -> list[str]:
  return sorted(p.stem for p in (config_dir / group).glob("*.yaml"))


def group_defaults(config_dir: Path) -> dict[str, str | None]:
  """The choice config.yaml's defaults list makes for each group (``None``: none)."""
  out = {}
  for item in OmegaConf.load(config_dir / "config.yaml").get("defaults", []):
    if isinstance(item, str) or item is None:
      continue
    for key, value in item.items():
      if not str(key).startswith("override "):
        out[str(key)] = value
  return out


def _family(config_dir: Path, model: str) -> str:
  return str(OmegaConf.load(config_dir / "model" / f"{model}.yaml").get("family"))


def compose_contexts(config_dir: Path) -> list[Context]:
  """The default config, then one per option of each key group; a T5 model is composed with
  XSUM and XSUM with t5_small, so that every config is one train.py accepts."""
  defaults = group_defaults(config_dir)
  t5_models = [m for m in options(config_dir, "model") if _family(config_dir, m) == "t5"]
  wanted: list[tuple[str | None, str | None, list[str]]] = [(None, None, [])]
  for group in KEY_GROUPS:
    for option in options(config_dir, group):
      overrides = [f"{group}={option}"]
      if group == "model" and option in t5_models:
        overrides.append("data=xsum")
      if group == "data" and option == "xsum" and t5_models:
        overrides.append(f"model={'t5_small' if 't5_small' in t5_models else t5_models[0]}")
      if option != defaults.get(group):
        wanted.append((group, option, overrides))
  out = []
  with initialize_config_dir(config_dir=str(config_dir), version_base=None):
    for group, option, overrides in wanted:
      cfg = compose(config_name="config", overrides=overrides)
      values = _flatten(OmegaConf.to_container(cfg, resolve=False))
      out.append(Context(group, option, values, config_check.allowed_values(cfg)))
  return out


# ------------------------------------------------------------------------------ formatting
def show(value: Any) -> str:
  """A value as it would be written on the command line or in the YAML."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):  # 1e-05 -> 1e-5, 1 -> 1.0: as the YAML writes it
    text = re.sub(r"e([+-])0*(\d)", lambda m: f"e{'' if m[1] == '+' else '-'}{m[2]}", f"{value:g}")
    return text if re.search(r"[.e]|inf|nan", text) else text + ".0"
  if isinstance(value, str):
    return f'"{value}"' if value != value.strip() or not value else value
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(show(v) for v in value) + "]"
  return str(value)


def code(value: Any) -> str:
  return f"`{show(value)}`"


def cell(text: str) -> str:
  return text.replace("|", "\\|")


def _allowed_text(allowed: str | tuple) -> str:
  if isinstance(allowed, tuple):
    return " | ".join(code(v) for v in allowed)
  return allowed


def _type_text(value: Any) -> str:
  if isinstance(value, bool):
    return "true or false"
  if isinstance(value, int):
    return "an integer"
  if isinstance(value, float):
    return "a number"
  if isinstance(value, str):
    return "a string"
  return "any"


# ------------------------------------------------------------------------------ the reference
@dataclass
class Key:
  name: str
  default: str
  allowed: str
  meaning: str
  by_optimizer: bool  # its default comes from the optimizer's config


class Reference:
  """Everything docs/configuration.md says, read from ``config_dir``."""

  def __init__(self, config_dir: Path = CONFIG_DIR):
    self.config_dir = Path(config_dir)
    self.contexts = compose_contexts(self.config_dir)
    self.default = self.contexts[0]
    self.group_defaults = group_defaults(self.config_dir)
    self.comments = self._comments()
    self.optimizer_keys = self._optimizer_keys()
    self.keys = {name: self._key(name) for name in self._key_names()}

  def _files(self) -> list[tuple[Path, str]]:
    """(file, key prefix): config.yaml, then each key group's default option, then the rest."""
    files = [(self.config_dir / "config.yaml", "")]
    for group in KEY_GROUPS:
      default = self.group_defaults.get(group)
      rest = [o for o in options(self.config_dir, group) if o != default]
      for option in ([default] if default else []) + rest:
        path = self.config_dir / group / f"{option}.yaml"
        files.append((path, "" if is_global(path) else group))
    return files

  def _comments(self) -> list[tuple[Path, dict[str, str]]]:
    return [(path, yaml_comments(path, prefix)) for path, prefix in self._files()]

  def _optimizer_keys(self) -> set[str]:
    keys = set()
    for option in options(self.config_dir, "optimizer"):
      node = OmegaConf.to_container(
        OmegaConf.load(self.config_dir / "optimizer" / f"{option}.yaml")
      )
      node.pop("defaults", None)
      keys.update(_flatten(node))
    return keys

  def _key_names(self) -> list[str]:
    names: dict[str, None] = {}
    for context in self.contexts:
      names.update(dict.fromkeys(context.values))
    return list(names)

  def meaning(self, name: str) -> str:
    for _, comments in self.comments:
      if name in comments:
        return comments[name]
    group = self._group_of(name)
    where = f"configs/{group}/{self.group_defaults.get(group)}.yaml" if group else "config.yaml"
    raise DocError(
      f"{name} has no trailing '# ...' comment in configs/{where.removeprefix('configs/')} (nor "
      f"in the other files that set it): add a one-line meaning to its line, then run "
      f"`{COMMAND}`."
    )

  def _group_of(self, name: str) -> str | None:
    head = name.split(".")[0]
    return head if head in KEY_GROUPS else None

  def _default_text(self, name: str) -> str:
    if name in self.default.values:
      return code(self.default.values[name])
    # The options that set it: of its own group where it has one (data=xsum brings model.*
    # keys too), else of any group (an optimizer option may add a top-level key).
    having = [c for c in self.contexts[1:] if name in c.values]
    own = [c for c in having if c.group == self._group_of(name)]
    by_value: dict[str, dict[str, list[str]]] = {}
    for context in own or having:
      groups = by_value.setdefault(code(context.values[name]), {})
      groups.setdefault(context.group, []).append(context.option)
    texts = []
    for value, groups in by_value.items():
      chosen = ", ".join(f"{group}={', '.join(opts)}" for group, opts in groups.items())
      texts.append(f"{value} ({chosen})")
    return "; ".join(texts)

  def _allowed(self, name: str) -> str:
    family = self.default.values.get("model.family")
    texts: dict[str, list[str]] = {}
    for context in self.contexts:
      allowed = context.allowed.get(name)
      if allowed is None:
        continue
      if name.startswith(("model.", "data.")):
        label = str(context.values.get("model.family", family))
      else:
        label = str(context.values.get("optimizer.name"))
      labels = texts.setdefault(_allowed_text(allowed), [])
      if label not in labels:
        labels.append(label)
    if len(texts) == 1:
      return next(iter(texts))
    if texts:
      return "; ".join(f"{', '.join(labels)}: {text}" for text, labels in texts.items())
    if name in ALLOWED_ELSEWHERE:
      return ALLOWED_ELSEWHERE[name]
    values = [c.values[name] for c in self.contexts if name in c.values]
    return _type_text(next((v for v in values if v is not None), None))

  def _key(self, name: str) -> Key:
    return Key(
      name=name,
      default=self._default_text(name),
      allowed=self._allowed(name),
      meaning=self.meaning(name),
      by_optimizer=name in self.optimizer_keys and name != "optimizer.name",
    )

  # -- sections
  def sections(self) -> list[tuple[str, str, list[Key]]]:
    placed: set[str] = set()
    out = []
    for title, line, entries in SECTIONS:
      names = []
      for entry in entries:
        if entry.endswith("."):
          found = [k for k in self.keys if k.startswith(entry)]
        else:
          found = [entry] if entry in self.keys else []
        if not found:
          raise DocError(f"training/config_doc.py SECTIONS names {entry}, which no config has.")
        names += [k for k in found if k not in placed]
        placed.update(found)
      out.append((title, line, [self.keys[k] for k in names]))
    rest = [self.keys[k] for k in self.keys if k not in placed]
    if rest:
      out.append(("Other keys", "Keys no table above takes yet.", rest))
    return out

  # -- groups
  def groups(self) -> list[tuple[str, str, list[str]]]:
    """(group, its line, its choices) for every config group directory."""
    out = []
    found = {
      p.relative_to(self.config_dir).as_posix() for p in self.config_dir.rglob("*") if p.is_dir()
    }
    found = {g for g in found if not g.startswith("sweep/exp/")}  # the scales of sweep/exp
    if found - set(GROUPS):
      raise DocError(
        f"configs/{sorted(found - set(GROUPS))[0]} is a config group without a line in "
        "training/config_doc.py GROUPS."
      )
    if set(GROUPS) - found:
      raise DocError(
        f"training/config_doc.py GROUPS names {sorted(set(GROUPS) - found)[0]}, "
        "which is not a directory of configs/."
      )
    out = []
    for group, line in GROUPS.items():
      path = self.config_dir / group
      pattern = "*/*.yaml" if group == "sweep/exp" else "*.yaml"
      choices = sorted(p.relative_to(path).with_suffix("").as_posix() for p in path.glob(pattern))
      out.append((group, line, choices))
    return out

  def choice_line(self, group: str, choice: str) -> str:
    path = self.config_dir / group / f"{choice}.yaml"
    sentence = header_sentence(path)
    if sentence is None:
      raise DocError(
        f"{path.relative_to(self.config_dir.parent)} has no leading comment: start it with one "
        f"sentence saying what the choice is, then run `{COMMAND}`."
      )
    return sentence

  def experiment_settings(self, choice: str) -> str:
    """What an experiment file sets: its group choices, then its keys."""
    node = OmegaConf.to_container(
      OmegaConf.load(self.config_dir / "experiment" / f"{choice}.yaml"), resolve=False
    )
    parts = []
    for item in node.pop("defaults", []):
      for key, value in item.items():
        parts.append(f"{str(key).removeprefix('override /')}={value}")
    parts += [f"{k}={show(v)}" for k, v in _flatten(node).items()]
    return ", ".join(f"`{p}`" for p in parts)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
  return lines


def render(config_dir: Path = CONFIG_DIR) -> str:
  """The text of docs/configuration.md for the configs in ``config_dir``."""
  ref = Reference(config_dir)
  defaults = ref.group_defaults
  chosen = ", ".join(f"`{g}={defaults[g]}`" for g in KEY_GROUPS if defaults.get(g))
  out = [
    "# Configuration reference",
    "",
    f"<!-- Generated from configs/ and training/config_check.py by `{COMMAND}`",
    "     (`make docs`); edit the YAML comments, not this file. -->",
    "",
    "`train.py` composes `configs/config.yaml` with one choice per config group (by default "
    f"{chosen}, no experiment). Every key below can be set on the command line, e.g. "
    "`python train.py optimizer=adam lr=1e-3 data.holdout=5000`; a group is chosen as "
    "`model=resnet50`. *Default* is the value in that default config, *allowed* is what "
    "`training/config_check.py` accepts (a run with any other value stops before loading data), "
    "and *meaning* is the key's comment in its YAML file.",
    "",
    "Keys that only sweeps add (`scale`, `arm`, `lr_from`, `best_lr`, ...) are described in "
    "`configs/sweep/common/layout.yaml` and `sweeps/README.md`.",
    "",
    "## Config groups",
    "",
  ]
  groups = ref.groups()
  rows = []
  for group, line, choices in groups:
    # best_lr's files are written by sweeps, so the reference does not list them.
    shown = "-" if group == "best_lr" else ", ".join(f"`{c}`" for c in choices)
    rows.append((f"`{group}`", line, shown))
  out += _table(("group", "what it chooses", "choices"), rows)
  for group, _, choices in groups:
    if group not in CHOICE_TABLES:
      continue
    out += ["", f"### Choices of {group}", ""]
    selector = SELECTOR.get(group, f"{group}=")
    rows = []
    for choice in choices:
      mark = " (default)" if defaults.get(group) == choice else ""
      line = ref.choice_line(group, choice)
      if group == "experiment":
        line += f" Sets {ref.experiment_settings(choice)}."
      rows.append((f"`{selector}{choice}`{mark}", line))
    out += _table((group, "what it is"), rows)

  out += [
    "",
    "## Keys",
    "",
    "Defaults marked † come from the optimizer's config; [Defaults by optimizer]"
    "(#defaults-by-optimizer) gives each optimizer's. A key that only some options of a group "
    "have shows their values, e.g. `0.99` (optimizer=adam).",
  ]
  for title, line, keys in ref.sections():
    out += ["", f"### {title}", "", line, ""]
    out += _table(
      ("key", "default", "allowed", "meaning"),
      (
        (f"`{k.name}`", k.default + (" †" if k.by_optimizer else ""), k.allowed, k.meaning)
        for k in keys
      ),
    )

  optimizers = options(ref.config_dir, "optimizer")
  order = [o for o in registry.names() if o in optimizers]
  order += [o for o in optimizers if o not in order]
  by_name = {
    c.option or defaults.get("optimizer"): c for c in ref.contexts if c.group in (None, "optimizer")
  }
  out += ["", "### Defaults by optimizer", "", "What each `optimizer=...` sets; `-`: not set.", ""]
  rows = []
  for name in ref.keys:
    if name not in ref.optimizer_keys:
      continue
    values = [by_name[o].values.get(name, "-") for o in order]
    rows.append((f"`{name}`", *(v if v == "-" else code(v) for v in values)))
  out += _table(("key", *order), rows)
  return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
  mode.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
  args = parser.parse_args(argv)
  try:
    text = render()
  except DocError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  if args.write:
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
  elif args.check:
    committed = DOC.read_text() if DOC.exists() else ""
    if committed != text:
      diff = difflib.unified_diff(
        committed.splitlines(), text.splitlines(), "committed", "generated", lineterm=""
      )
      print("\n".join(diff), file=sys.stderr)
      print(f"{DOC.relative_to(ROOT)} is out of date: run `{COMMAND}`.", file=sys.stderr)
      return 1
  else:
    sys.stdout.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
