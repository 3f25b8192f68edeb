"""The layering docs/architecture.md draws, checked on the code: imports go one way (no module
reaches back up into one that imports it), the library imports nothing of the framework, the
readers of run records import no JAX, and the training and results code stay readable in one
sitting."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ginger", "data", "models", "training", "results", "sweeps", "bench")
LONGEST_FUNCTION = 80  # lines, def to the end of its body, in ginger/, training/ and results/
LONGEST_LOOP = 450  # lines of training/loop.py
LONGEST_RESULTS_FILE = 600  # lines of a module of results/
LONGEST_FILE = 700  # lines of any module of the packages (tests and generated files aside)


def _module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
  """The project modules ``path`` imports at module level (not inside functions: those are
  the deliberate late imports that keep a light module light). ``from package import name``
  counts as an import of the submodule where ``name`` is one, else of the package."""
  found = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if sub in modules else node.module)
  return found & modules


def _graph() -> dict[str, set[str]]:
  files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
  return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of module-level imports, as the list of its modules, or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_module_imports_have_no_cycles():
  graph = _graph()
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))
  assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the check itself can fail


def test_the_library_imports_nothing_of_the_framework():
  graph = _graph()
  outside = {
    (name, m)
    for name, deps in graph.items()
    if name.split(".")[0] == "ginger"
    for m in deps
    if m.split(".")[0] != "ginger"
  }
  assert not outside, sorted(outside)


def test_run_record_readers_import_no_jax():
  """Tables, plots, sweeps and the registry read run records on machines without an
  accelerator, in a fraction of a second: none of them imports JAX when imported."""
  modules = ["results.tables", "results.plots", "results.compare", "sweeps.best_lr"]
  code = (
    "import sys\n"
    + "".join(f"import {m}\n" for m in modules)
    + "import training.registry, training.run_record\n"
    + "heavy = [m for m in ('jax', 'flax', 'optax') if m in sys.modules]\n"
    + "assert not heavy, heavy\n"
  )
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-2000:]


def _long_functions(paths) -> list[str]:
  """Functions (and methods) in ``paths`` longer than ``LONGEST_FUNCTION`` lines, def line to
  the last line of the body, docstring included, as "file:line name (n lines)"."""
  long = []
  for path in sorted(paths):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > LONGEST_FUNCTION:
          long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
  return long


def test_the_training_code_reads_in_one_sitting():
  loop = ROOT / "training" / "loop.py"
  assert len(loop.read_text().splitlines()) <= LONGEST_LOOP
  long = _long_functions((ROOT / "training").glob("*.py"))
  assert not long, long


def test_the_results_code_reads_in_one_sitting():
  results = ROOT / "results"
  long_files = [
    f"{path.name} ({n} lines)"
    for path in sorted(results.glob("*.py"))
    if (n := len(path.read_text().splitlines())) > LONGEST_RESULTS_FILE
  ]
  assert not long_files, long_files
  long = _long_functions(results.glob("*.py"))
  assert not long, long


def test_the_optimizer_reads_in_one_sitting():
  long = _long_functions((ROOT / "ginger").rglob("*.py"))
  assert not long, long


def test_no_module_is_longer_than_a_sitting():
  modules = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
  long = [
    f"{p.relative_to(ROOT)} ({n} lines)"
    for p in sorted(modules)
    if (n := len(p.read_text().splitlines())) > LONGEST_FILE
  ]
  assert not long, long


def test_the_length_checks_can_fail(tmp_path):
  too_long = tmp_path / "too_long.py"
  too_long.write_text("def f():\n" + "  pass\n" * LONGEST_FUNCTION)
  assert _long_functions([too_long]) == [f"too_long.py:1 f ({LONGEST_FUNCTION + 1} lines)"]
