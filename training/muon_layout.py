"""Which parameters Muon orthogonalises, and as which matrix.

Muon (Jordan et al. 2024) is steepest descent under the spectral norm of a hidden layer's
weight matrix ``W`` (``x W = y``): its update is the orthogonalised momentum, computed by
Newton-Schulz iterations. Its authors apply it to every hidden weight matrix - dense kernels
``(in, out)`` and convolution filters flattened to ``(kh * kw * in, out)`` - and AdamW to the
rest: the layers that read the input or write the output (the first convolution, the
classifier head, embedding tables, T5's tied embedding and relative-position tables), norms and
biases. ``optax.contrib.muon`` on its own sends every 2-D leaf to Muon and every other leaf to
AdamW, so a ResNet's 4-D convolution filters would silently get AdamW; :func:`dimension_numbers`
is the tree of ``MuonDimensionNumbers`` (None: AdamW) that gives the authors' split.

The input and output layers are named by the top-level modules of the framework's models
(:data:`INPUT_OUTPUT_MODULES`: ResNet's ``conv1`` and ``fc``, T5's ``shared`` embedding and
``lm_head``) and by the leaf name ``embedding`` (every ``nnx.Embed`` table). LoRA's adapter
factors are hidden matrices and get Muon.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from optax.contrib import MuonDimensionNumbers

# Top-level modules that read the input or write the output: AdamW, as the Muon authors do.
INPUT_OUTPUT_MODULES = ("conv1", "fc", "shared", "lm_head")
DENSE = MuonDimensionNumbers(reduction_axis=0, output_axis=1)  # (in, out)
CONV = MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3)  # (kh, kw, in, out)


def _names(path) -> list[str]:
  """The path's keys as strings (dict keys, attribute names, sequence indices)."""
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
  return [n for n in names if n != "value"]  # nnx.Variable's own attribute


def leaf_dimension_numbers(names: list[str], ndim: int) -> MuonDimensionNumbers | None:
  """How Muon sees one parameter (by its path's names and its rank); None: AdamW."""
  if not names or names[0] in INPUT_OUTPUT_MODULES or "embedding" in names:
    return None
  if ndim == 2:
    return DENSE
  if ndim == 4:
    return CONV
  return None  # biases, norm scales


def matrix_shape(shape: tuple[int, ...], dims: MuonDimensionNumbers) -> tuple[int, int]:
  """The ``(rows, columns)`` of the matrix Muon orthogonalises for a leaf of ``shape``: the
  product of its reduction axes by the product of its output axes (a ``(3, 3, 64, 128)``
  filter: ``(576, 128)``)."""

  def axes(a) -> tuple[int, ...]:
    return (a,) if isinstance(a, int) else tuple(a)

  rows = math.prod(shape[i] for i in axes(dims.reduction_axis))
  return rows, math.prod(shape[i] for i in axes(dims.output_axis))


def dimension_numbers(params: Any) -> Any:
  """The tree of :class:`MuonDimensionNumbers` (None for AdamW's leaves) for ``params``, as
  ``optax.contrib.muon(..., muon_weight_dimension_numbers=...)`` takes it."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: leaf_dimension_numbers(_names(path), leaf.ndim), params
  )
