"""The ``>>>`` examples in the library's docstrings run as written and print what they show;
every public optimizer and the Fisher vector's entry point has one."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ginger

# Every module, the implementation's under ginger._src included.
MODULES = sorted(m.name for m in pkgutil.walk_packages(ginger.__path__, prefix="ginger."))
WITH_EXAMPLES = [
  ginger.scale_by_ginger,
  ginger.ginger,
  ginger.scale_by_qng,
  ginger.qng,
  ginger.scale_by_soap,
  ginger.soap,
  ginger.fisher.value_grad_and_fisher,
]
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str) -> None:
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=FLAGS, report=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"


@pytest.mark.parametrize("fn", WITH_EXAMPLES, ids=lambda fn: fn.__qualname__)
def test_public_api_has_examples(fn) -> None:
  (test,) = doctest.DocTestFinder(recurse=False).find(fn, fn.__name__, globs={})
  assert test.examples, f"{fn.__qualname__} has no >>> example"
