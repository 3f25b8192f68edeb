"""A :class:`~results.table_model.Table` as GitHub markdown and as LaTeX (booktabs), a table
wider than :data:`MAX_COLUMNS` shown as several; written as files (:func:`write_tables`), also
from a table module's command line (:func:`tables_command`)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from results.runs import Run, collect_runs, missing_roots
from results.table_model import DEFAULT_OUT, Column, Row, Table, slug

MAX_COLUMNS = 12  # columns of a rendered table, its row labels included


def blocks(table: Table) -> list[tuple[str, Table]]:
  """The tables ``table`` is shown as, each with its heading ("" for a table shown whole).

  One per row section (the ablation's base settings) and column section (Table 1's models,
  Table 2's settings), in order; a section wider than :data:`MAX_COLUMNS` is split by its
  columns' parts (accuracy and loss, cost), the columns of no part (n) in each.
  """
  row_sections = list(dict.fromkeys(r.section for r in table.rows)) or [""]
  col_sections = list(dict.fromkeys(c.section for c in table.columns)) or [""]
  out = []
  for row_section in row_sections:
    rows = [r for r in table.rows if r.section == row_section]
    for col_section in col_sections:
      shown = [i for i, c in enumerate(table.columns) if c.section == col_section]
      parts = [("", shown)]
      if 1 + len(shown) > MAX_COLUMNS:
        names = dict.fromkeys(table.columns[i].part for i in shown if table.columns[i].part)
        if not names:
          raise ValueError(
            f"table {table.name}: {1 + len(shown)} columns, more than {MAX_COLUMNS}, and none "
            "names a part to split it into (Column.part)"
          )
        parts = [(p, [i for i in shown if table.columns[i].part in ("", p)]) for p in names]
      for part, index in parts:
        heading = ": ".join(x for x in (row_section, col_section, part) if x)
        heading = heading[:1].upper() + heading[1:] if heading == part else heading
        block = Table(
          table.name,
          table.title,
          table.caption,
          table.row_header,
          [table.columns[i] for i in index],
          [
            Row(r.label, [r.cells[i] for i in index], r.rule_before and j > 0, r.section)
            for j, r in enumerate(rows)
          ],
        )
        out.append((heading, block))
  return out


def _md_cell(text: str) -> str:
  return text.replace("|", "\\|")


def to_markdown(table: Table) -> str:
  """GitHub pipe tables (:func:`blocks`, each under its heading) with title, caption and
  notes; headers read "<group> <label>"."""
  lines = [f"## {table.title}", "", table.caption]
  for heading, block in blocks(table):
    lines += ["", f"### {heading}", ""] if heading else [""]
    headers = [block.row_header] + [c.header() for c in block.columns]
    lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
    lines.append("|---|" + "---:|" * len(block.columns))
    for row in block.rows:
      lines.append("| " + " | ".join(_md_cell(c) for c in [row.label, *row.cells]) + " |")
  if table.notes:
    lines.append("")
    lines += [f"- {note}" for note in table.notes]
  return "\n".join(lines) + "\n"


LATEX_CHARS = {
  "\\": r"\textbackslash{}",
  "&": r"\&",
  "%": r"\%",
  "$": r"\$",
  "#": r"\#",
  "_": r"\_",
  "{": r"\{",
  "}": r"\}",
  "~": r"\textasciitilde{}",
  "^": r"\textasciicircum{}",
  "±": r"$\pm$",
  "Δ": r"$\Delta$",
  "τ": r"$\tau$",
  "α": r"$\alpha$",
  "ρ": r"$\rho$",
  "γ": r"$\gamma$",
  "×": r"$\times$",
}


def latex_escape(text: str) -> str:
  """Escape LaTeX specials and turn the few Greek/math characters we use into math."""
  return "".join(LATEX_CHARS.get(ch, ch) for ch in text)


def _spans(columns: Sequence[Column], key: Callable[[Column], Any]) -> list[tuple[Any, int, int]]:
  """(key, first, last) LaTeX column numbers (1-based, after the label column) of each run of
  consecutive columns with the same key."""
  spans: list[tuple[Any, int, int]] = []
  for i, col in enumerate(columns, start=2):
    if spans and spans[-1][0] == key(col):
      spans[-1] = (spans[-1][0], spans[-1][1], i)
    else:
      spans.append((key(col), i, i))
  return spans


def _span_row(spans: list[tuple[Any, int, int]], text: Callable[[Any], str]) -> list[str]:
  """A header row of multicolumns over `spans`, then the cmidrules under the named ones."""
  cells = [""] + [
    rf"\multicolumn{{{b - a + 1}}}{{c}}{{{latex_escape(text(k))}}}" if text(k) else ""
    for k, a, b in spans
  ]
  rules = " ".join(rf"\cmidrule(lr){{{a}-{b}}}" for k, a, b in spans if text(k) and b > a)
  return ["    " + " & ".join(cells) + r" \\"] + (["    " + rules] if rules else [])


def _latex_header(table: Table) -> list[str]:
  """Up to three header rows: groups, metrics (over ours/paper/Δ), then the sub-labels."""
  lines = []
  cols = table.columns
  if any(c.group for c in cols):
    lines += _span_row(_spans(cols, lambda c: c.group), str)
  has_subs = any(c.sub for c in cols)
  if has_subs:
    lines += _span_row(
      _spans(cols, lambda c: (c.group, c.label) if c.sub else id(c)),
      lambda k: k[1] if isinstance(k, tuple) else "",
    )
  labels = [table.row_header] + [c.sub or c.label for c in cols]  # n etc. on the last row
  lines.append("    " + " & ".join(latex_escape(x) for x in labels) + r" \\")
  return lines


def _caption_title(table: Table) -> str:
  """The title without its "Table N: " prefix (LaTeX numbers the caption itself)."""
  return re.sub(r"^Table \d+:\s*", "", table.title)


LABEL_CHARS = {"τ": "tau", "α": "alpha", "ρ": "rho", "γ": "gamma"}


def _latex_label(table: Table, heading: str) -> str:
  """tab:repro-<name>[-<heading>], letters, digits and dashes only."""
  text = "".join(LABEL_CHARS.get(ch, ch) for ch in f"{table.name} {heading}")
  return "tab:repro-" + slug(text).replace("_", "-").lower()


def to_latex(table: Table) -> str:
  """Booktabs table* environments (need booktabs and graphicx), one per :func:`blocks`, laid
  out like the paper's tables."""
  lines = ["% Generated by `python -m results.tables`; do not edit by hand."]
  for heading, block in blocks(table):
    title = _caption_title(table) + (f". {heading}" if heading else "")
    lines += [
      r"\begin{table*}[t]",
      r"  \centering",
      r"  \small",
      f"  \\caption{{{latex_escape(title)}. {latex_escape(table.caption)}}}",
      f"  \\label{{{_latex_label(table, heading)}}}",
      r"  \resizebox{\textwidth}{!}{%",
      r"  \begin{tabular}{l" + "r" * len(block.columns) + "}",
      r"    \toprule",
      *_latex_header(block),
      r"    \midrule",
    ]
    for row in block.rows:
      if row.rule_before:
        lines.append(r"    \midrule")
      cells = [row.label, *row.cells]
      lines.append("    " + " & ".join(latex_escape(c) for c in cells) + r" \\")
    lines += [r"    \bottomrule", r"  \end{tabular}}", r"\end{table*}"]
  lines += [f"% {note}" for note in table.notes]
  return "\n".join(lines) + "\n"


def write_tables(tables: Iterable[tuple[str, Table]], out: Path) -> None:
  """Each ``(name, table)`` as ``<out>/<name>.md`` and ``.tex``, each file named on stderr."""
  out.mkdir(parents=True, exist_ok=True)
  for name, table in tables:
    (out / f"{name}.md").write_text(to_markdown(table))
    (out / f"{name}.tex").write_text(to_latex(table))
    print(f"wrote {out / name}.md and .tex", file=sys.stderr)


def tables_command(
  prog: str,
  description: str,
  make: Callable[[Sequence[Run]], list[tuple[str, Table]]],
  argv: Sequence[str] | None = None,
) -> int:
  """The command line of a module whose tables ``make`` builds from the runs: scan the roots
  given, write the tables into ``--out``; 2 where a root does not exist."""
  parser = argparse.ArgumentParser(prog=prog, description=description)
  parser.add_argument("roots", nargs="+", help="dirs (or run archives) to scan")
  parser.add_argument("--out", default=DEFAULT_OUT, help="where to write the tables")
  args = parser.parse_args(argv)
  if error := missing_roots(args.roots):
    print(f"error: {error}", file=sys.stderr)
    return 2
  write_tables(make(collect_runs(args.roots)), Path(args.out))
  return 0
