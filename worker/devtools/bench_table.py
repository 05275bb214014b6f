"""The headline table of ``benchmarks/RESULTS.md``: benchmarks write their figures into it.

The table sits between the snippet markers ``--8<-- [start:headline]`` and
``--8<-- [end:headline]`` (the docs site includes it from there) and has six columns: ``key``
(stable, in backticks), ``figure``, ``goal``, ``today``, ``measured`` (a date) and ``command``
(in backticks). A benchmark run with ``--record`` calls :func:`record_figures` with a value per
key it measured; each such row whose command is the run's own command gets the new value and
today's date, and README.md's headline block is rewritten from the table. A row whose command
differs is left alone (its figure was measured another way); a run that matches no row says so.

``tokenfleet bench all`` (``make bench``) names the rows each of its runs refreshes in the
environment (:data:`PLANNED_ENV`): those rows take the run's value, date *and* command, whatever
command they named before, so a row always shows the command that measured its value; a planned
key the run did not measure is an error. :data:`RESULTS_ENV` points the writes at another copy of
RESULTS.md (README.md is then left alone): smoke runs of ``--record`` use it.

README.md's block: ``<!-- headline: KEY KEY ... -->``, a table of figure, goal, today and
measured for those keys in that order, then ``<!-- headline: end -->``.

Invariants: only the ``today``, ``measured`` and (for a planned key) ``command`` cells of a table
ever change, and only for a key whose command matches or that the run was planned for;
everything outside the table and README.md's block is kept byte for byte; a key the table lacks,
a planned key the run did not measure, a malformed table or a value that would break a cell is
an error (nothing is written).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

START = "<!-- --8<-- [start:headline] -->"
END = "<!-- --8<-- [end:headline] -->"
HEADER = "| key | figure | goal | today | measured | command |"
RULE = "|---|---|---|---|---|---|"
README_START = re.compile(r"^<!-- headline: (?P<keys>[^>]*?) -->$", re.MULTILINE)
README_END = "<!-- headline: end -->"
README_HEADER = ["| figure | goal | today | measured |", "|---|---|---|---|"]
RECORD_FLAG = "--record"
# Space-separated keys that ``tokenfleet bench all`` planned this run to refresh (see the module
# docstring). Not ``TOKENFLEET_*``: the workers a benchmark starts refuse unknown such variables.
PLANNED_ENV = "BENCH_PLANNED_KEYS"
# A RESULTS.md to write instead of the repository's (README.md is then left alone).
RESULTS_ENV = "BENCH_RESULTS_FILE"


@dataclass(frozen=True, slots=True)
class Row:
    """One headline row; ``key`` and ``command`` without their backticks."""

    key: str
    figure: str
    goal: str
    today: str
    measured: str
    command: str

    def line(self) -> str:
        return (
            f"| `{self.key}` | {self.figure} | {self.goal} | {self.today} | {self.measured} "
            f"| `{self.command}` |"
        )


def _code(cell: str, what: str, line: str) -> str:
    if not (len(cell) >= 2 and cell[0] == "`" and cell[-1] == "`"):
        raise ValueError(f"headline table: the {what} cell must be in backticks: {line}")
    return cell[1:-1]


def parse_row(line: str) -> Row:
    """The row a table line holds; ``ValueError`` if it is not one of six cells."""
    if not (line.startswith("| ") and line.endswith(" |")):
        raise ValueError(f"headline table: not a table row: {line}")
    cells = [c.strip() for c in line[2:-2].split(" | ")]
    if len(cells) != 6:
        raise ValueError(f"headline table: {len(cells)} cells instead of 6: {line}")
    key, figure, goal, today, measured, command = cells
    return Row(
        _code(key, "key", line), figure, goal, today, measured, _code(command, "command", line)
    )


def _table_span(text: str) -> tuple[int, int]:
    """Line indices (start, end) of the table's rows, the header and rule excluded."""
    lines = text.split("\n")
    try:
        start, end = lines.index(START), lines.index(END)
    except ValueError:
        raise ValueError(f"headline table: markers {START!r} and {END!r} not found") from None
    if lines[start + 1 : start + 3] != [HEADER, RULE] or end < start + 3:
        raise ValueError(f"headline table: expected {HEADER!r} and {RULE!r} after {START!r}")
    return start + 3, end


def parse_table(text: str) -> list[Row]:
    """The table's rows in order; ``ValueError`` for a malformed table or a repeated key."""
    start, end = _table_span(text)
    rows = [parse_row(line) for line in text.split("\n")[start:end]]
    keys = [r.key for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"headline table: a key appears twice: {keys}")
    return rows


def _check_cell(value: str, key: str) -> str:
    if not value.strip() or "|" in value or "\n" in value or value != value.strip():
        raise ValueError(f"headline table: value for {key!r} would break its cell: {value!r}")
    return value


def record(
    text: str,
    figures: Mapping[str, str],
    command: str,
    date: datetime.date,
    planned: Collection[str] = (),
) -> tuple[str, list[str]]:
    """``text`` with each key's ``today`` and ``measured`` cells set, where the row's command is
    ``command`` (other keys' rows are kept: they are measured by other commands), and for each
    ``planned`` key also its ``command`` cell, whatever it named; and a line per row written, or
    one line saying none was. ``ValueError`` (nothing changed) for a key the table lacks, a
    planned key not among ``figures`` or a value that would break a cell."""
    start, end = _table_span(text)
    lines = text.split("\n")
    rows = parse_table(text)
    by_key = {r.key: i for i, r in enumerate(rows)}
    unknown = [k for k in [*figures, *planned] if k not in by_key]
    if unknown:
        raise ValueError(f"headline table: no row for {unknown} (rows: {list(by_key)})")
    unmeasured = [k for k in planned if k not in figures]
    if unmeasured:
        raise ValueError(
            f"headline table: {unmeasured} planned for `{command}`, which measured only "
            f"{sorted(figures)}"
        )
    said = []
    for key, value in figures.items():
        row = rows[by_key[key]]
        if row.command == command or key in planned:
            rows[by_key[key]] = replace(
                row, today=_check_cell(value, key), measured=date.isoformat(), command=command
            )
            moved = "" if row.command == command else f"; its command was `{row.command}`"
            said.append(f"{key}: {value} ({date.isoformat()}{moved})")
    if not said:
        said.append(f"nothing recorded: no row of {sorted(figures)} is measured by `{command}`")
    lines[start:end] = [r.line() for r in rows]
    return "\n".join(lines), said


def readme_block(readme: str, results: str) -> str:
    """README.md's text ``readme`` with its headline block rewritten from the table in
    ``results``; unchanged if it has no block. ``ValueError`` for a key the table lacks or a
    block without its end."""
    match = README_START.search(readme)
    if match is None:
        return readme
    keys = match.group("keys").split()
    rows = {r.key: r for r in parse_table(results)}
    missing = [k for k in keys if k not in rows]
    if missing:
        raise ValueError(f"README.md's headline block: no row for {missing} in the results table")
    end = readme.find("\n" + README_END, match.end())
    if end < 0:
        raise ValueError(f"README.md's headline block: {README_END!r} not found")
    body = README_HEADER + [
        f"| {rows[k].figure} | {rows[k].goal} | {rows[k].today} | {rows[k].measured} |"
        for k in keys
    ]
    return readme[: match.end()] + "\n" + "\n".join(body) + readme[end:]


def run_command(argv: Sequence[str]) -> str:
    """The command a row names for this run: ``python benchmarks/SCRIPT ARGS``, without
    ``--record`` (``argv`` is ``sys.argv``: the script's path first)."""
    args = [shlex.quote(a) for a in argv[1:] if a != RECORD_FLAG]
    return " ".join(["python", f"benchmarks/{Path(argv[0]).name}", *args])


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--record`` flag every headline benchmark takes (``make bench`` passes it)."""
    parser.add_argument(
        RECORD_FLAG,
        action="store_true",
        help="write this run's headline figures into benchmarks/RESULTS.md (rows measured by "
        "this exact command) and README.md's headline block",
    )


def record_figures(
    figures: Mapping[str, str],
    *,
    benchmarks: Path,
    keys: Collection[str],
    argv: Sequence[str] | None = None,
    date: datetime.date | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """Write ``figures`` (key -> the ``today`` cell) into ``benchmarks/RESULTS.md`` for this
    run's command (and the keys :data:`PLANNED_ENV` names), then README.md's block from the
    table; print and return what happened. ``keys`` are the rows the script declares it measures
    (its ``HEADLINE_KEYS``): a figure for another key is a ``ValueError``. :data:`RESULTS_ENV`
    names another file to write instead (README.md is then left alone)."""
    undeclared = sorted(set(figures) - set(keys))
    if undeclared:
        raise ValueError(f"headline figures {undeclared} are not among the script's {keys}")
    env = os.environ if environ is None else environ
    planned = env.get(PLANNED_ENV, "").split()
    results_path = Path(env[RESULTS_ENV]) if env.get(RESULTS_ENV) else benchmarks / "RESULTS.md"
    readme_path = benchmarks.parent / "README.md"
    command = run_command(sys.argv if argv is None else argv)
    text, said = record(
        results_path.read_text(), figures, command, date or datetime.date.today(), planned
    )
    readme = (
        readme_block(readme_path.read_text(), text)
        if readme_path.is_file() and not env.get(RESULTS_ENV)
        else None
    )
    results_path.write_text(text)
    if readme is not None:
        readme_path.write_text(readme)
    for line in said:
        print(f"{results_path.name} {line}")
    return said
