"""docs/configuration.md is what training/config_doc.py generates from configs/ now."""

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import config_check, config_doc, registry

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def committed() -> str:
  return DOC.read_text()


def row(doc: str, key: str) -> list[str]:
  """The cells of a key's row in the reference."""
  line = next(x for x in doc.splitlines() if x.startswith(f"| `{key}` |"))
  cells = line.replace("\\|", "\0").strip("|").split("|")
  return [c.strip().replace("\0", "|") for c in cells]


def test_committed_reference_is_current(committed):
  generated = config_doc.render()
  if generated != committed:
    diff = "\n".join(
      difflib.unified_diff(
        committed.splitlines(), generated.splitlines(), "committed", "generated", lineterm=""
      )
    )
    pytest.fail(
      f"docs/configuration.md is out of date with configs/: run `{config_doc.COMMAND}` "
      f"(or `make docs`) and commit it.\n{diff}"
    )


def test_every_key_of_the_default_config_has_a_row(committed):
  with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
    cfg = compose(config_name="config")
  keys = config_doc._flatten(OmegaConf.to_container(cfg, resolve=False))
  assert "tau" in keys and "mesh.data" in keys and "optimizer.b1" in keys
  missing = [k for k in keys if f"| `{k}` |" not in committed]
  assert not missing


@pytest.mark.parametrize(
  "key, allowed",
  [
    ("optimizer.name", registry.names()),
    ("schedule", config_check.SCHEDULES),
    ("block", registry.BLOCKS),
    ("fisher", config_check.FISHERS),
    ("fisher_backward", config_check.FISHER_BACKWARDS),
    ("precision", config_check.PRECISIONS),
    ("optimizer.state_dtype", registry.STATE_DTYPES),
    ("passes", registry.PASSES),
    ("logger.name", config_check.LOGGERS),
    ("logger.mode", config_check.WANDB_MODES),
    ("batchnorm", config_check.BATCHNORMS),
    ("data.name", (*config_check.IMAGE_DATASETS, "xsum")),
    ("data.source", config_check.XSUM_SOURCES),
  ],
)
def test_allowed_values_are_config_checks(committed, key, allowed):
  cells = row(committed, key)
  for value in allowed:
    assert f"`{config_doc.show(value)}`" in cells[2], (key, value, cells)


def test_defaults_and_meanings_come_from_the_yaml(committed):
  assert row(committed, "epochs")[1] == "`200`"
  assert row(committed, "gamma")[1] == "`1e-5` †"  # from configs/optimizer/ginger.yaml
  b2 = row(committed, "optimizer.b2")[1]  # from each optimizer's YAML that sets it
  assert b2.startswith("`0.99` (optimizer=adam)") and "`0.95` (optimizer=soap)" in b2
  assert row(committed, "log_every")[3] == "steps between train-loss log lines"


def copy_configs(tmp_path: Path) -> Path:
  return Path(shutil.copytree(ROOT / "configs", tmp_path / "configs"))


def test_a_changed_default_changes_the_reference(tmp_path, committed):
  configs = copy_configs(tmp_path)
  path = configs / "config.yaml"
  path.write_text(path.read_text().replace("epochs: 200 ", "epochs: 300 ", 1))
  generated = config_doc.render(configs)
  assert generated != committed
  assert row(generated, "epochs")[1] == "`300`"


def test_a_key_without_a_comment_stops_the_generator(tmp_path):
  configs = copy_configs(tmp_path)
  path = configs / "config.yaml"
  path.write_text(path.read_text().replace("sweep: null ", "new_knob: 3\nsweep: null ", 1))
  with pytest.raises(config_doc.DocError, match="new_knob has no trailing"):
    config_doc.render(configs)


def test_a_comment_over_two_lines_stops_the_generator(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("a: 1    # the first line\n        #   and its continuation\n")
  with pytest.raises(config_doc.DocError, match="keep it one line"):
    config_doc.yaml_comments(path)


def test_yaml_comments(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(
    "# block comment, not a meaning\n"
    "top: 1            # one\n"
    'quoted: "a # b"   # two\n'
    "flow: {x: 1,\n"
    "       y: 2}      # not a key of its own\n"
    "nested:\n"
    "  # a comment above a key\n"
    "  inner: true     # three\n"
    "bare: 2\n"
  )
  assert config_doc.yaml_comments(path, "g") == {
    "g.top": "one",
    "g.quoted": "two",
    "g.nested.inner": "three",
  }


def test_the_generator_imports_no_jax():
  code = (
    "import sys; from training import config_doc; config_doc.render(); "
    "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]"
  )
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
