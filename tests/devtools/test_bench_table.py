"""The headline table updater: benchmarks write only their own rows' value and date cells, only
for rows measured by their exact command, and README.md's block follows the table."""

from __future__ import annotations

import ast
import datetime
from pathlib import Path

import pytest

from tokenfleet.worker.devtools import bench_table
from tokenfleet.worker.devtools.commands import bench

ROOT = Path(__file__).resolve().parents[2]
DAY = datetime.date(2031, 2, 3)
TABLE = f"""# Benchmark results

Intro text | with a pipe, kept as it is.

{bench_table.START}
{bench_table.HEADER}
{bench_table.RULE}
| `alpha` | alpha ratio | ≥ 1.0 | 0.9 | 2026-01-01 | `python benchmarks/bench_a.py` |
| `beta` | beta latency | report | 3 ms | 2026-01-02 | `python benchmarks/bench_a.py --rounds 5` |
| `gamma` | gamma | report | 7 | 2026-01-03 | `python benchmarks/bench_b.py` |
{bench_table.END}

Notes after the table.
"""
README_TEXT = """# x

<!-- headline: gamma alpha -->
| figure | goal | today | measured |
|---|---|---|---|
| stale | stale | stale | stale |
<!-- headline: end -->

## After
"""


def test_a_run_rewrites_the_value_and_date_of_its_rows_only() -> None:
    text, said = bench_table.record(
        TABLE, {"alpha": "1.07", "beta": "2 ms"}, "python benchmarks/bench_a.py", DAY
    )
    rows = {r.key: r for r in bench_table.parse_table(text)}
    assert (rows["alpha"].today, rows["alpha"].measured) == ("1.07", "2031-02-03")
    assert rows["alpha"].figure == "alpha ratio" and rows["alpha"].goal == "≥ 1.0"
    # beta's row is measured by another command: its figure stays as it was measured
    assert (rows["beta"].today, rows["beta"].measured) == ("3 ms", "2026-01-02")
    assert (rows["gamma"].today, rows["gamma"].measured) == ("7", "2026-01-03")
    assert said == ["alpha: 1.07 (2031-02-03)"]
    old, new = TABLE.split("\n"), text.split("\n")
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    assert [old[i] for i in changed] == [
        "| `alpha` | alpha ratio | ≥ 1.0 | 0.9 | 2026-01-01 | `python benchmarks/bench_a.py` |"
    ]


def test_a_run_that_matches_no_row_writes_nothing_and_says_so() -> None:
    text, said = bench_table.record(TABLE, {"alpha": "2"}, "python benchmarks/bench_a.py -x", DAY)
    assert text == TABLE
    assert len(said) == 1 and said[0].startswith("nothing recorded")


@pytest.mark.parametrize(
    ("figures", "message"),
    [
        ({"delta": "1"}, "no row for ['delta']"),
        ({"alpha": "1 | 2"}, "would break its cell"),
        ({"alpha": ""}, "would break its cell"),
        ({"alpha": "1\n2"}, "would break its cell"),
    ],
)
def test_an_unknown_key_or_a_bad_value_is_refused(figures: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bench_table.record(TABLE, figures, "python benchmarks/bench_a.py", DAY)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (TABLE.replace(bench_table.END, ""), "markers"),
        (TABLE.replace(" | `python benchmarks/bench_b.py` |", " |"), "5 cells instead of 6"),
        (TABLE.replace("| `gamma` |", "| gamma |"), "key cell must be in backticks"),
        (TABLE.replace("`gamma`", "`alpha`"), "a key appears twice"),
        (TABLE.replace(bench_table.RULE, "|---|"), "expected"),
    ],
)
def test_a_malformed_table_is_refused(broken: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench_table.record(broken, {"alpha": "1"}, "python benchmarks/bench_a.py", DAY)


def test_readme_block_is_rewritten_from_the_table_in_its_order() -> None:
    out = bench_table.readme_block(README_TEXT, TABLE)
    assert out.split("\n")[3:8] == [
        "| figure | goal | today | measured |",
        "|---|---|---|---|",
        "| gamma | report | 7 | 2026-01-03 |",
        "| alpha ratio | ≥ 1.0 | 0.9 | 2026-01-01 |",
        "<!-- headline: end -->",
    ]
    assert out.startswith("# x\n\n<!-- headline: gamma alpha -->\n")
    assert out.endswith("<!-- headline: end -->\n\n## After\n")
    assert bench_table.readme_block(out, TABLE) == out
    assert bench_table.readme_block("# no block\n", TABLE) == "# no block\n"
    with pytest.raises(ValueError, match="no row for"):
        bench_table.readme_block(README_TEXT.replace("gamma alpha", "gamma omega"), TABLE)
    with pytest.raises(ValueError, match="not found"):
        bench_table.readme_block(README_TEXT.replace(bench_table.README_END, ""), TABLE)


def test_the_run_command_is_the_script_and_its_arguments_without_record() -> None:
    argv = ["/x/benchmarks/bench_a.py", "--record", "--batch", "1,8,32", "--name", "a b"]
    assert bench_table.run_command(argv) == (
        "python benchmarks/bench_a.py --batch 1,8,32 --name 'a b'"
    )
    assert bench_table.run_command(["bench_a.py"]) == "python benchmarks/bench_a.py"


def _checkout(tmp_path: Path) -> tuple[Path, Path]:
    """benchmarks/RESULTS.md (TABLE) and README.md (README_TEXT) of a checkout in tmp_path."""
    (tmp_path / "benchmarks").mkdir()
    results, readme = tmp_path / "benchmarks" / "RESULTS.md", tmp_path / "README.md"
    results.write_text(TABLE)
    readme.write_text(README_TEXT)
    return results, readme


def test_record_figures_writes_the_table_and_the_readme(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results, readme = _checkout(tmp_path)
    said = bench_table.record_figures(
        {"alpha": "1.5", "gamma": "8"},
        benchmarks=tmp_path / "benchmarks",
        keys=("alpha", "gamma"),
        argv=["benchmarks/bench_a.py", "--record"],
        date=DAY,
        environ={},
    )
    assert said == ["alpha: 1.5 (2031-02-03)"]
    assert "RESULTS.md alpha: 1.5 (2031-02-03)" in capsys.readouterr().out
    assert "| `alpha` | alpha ratio | ≥ 1.0 | 1.5 | 2031-02-03 |" in results.read_text()
    assert "| alpha ratio | ≥ 1.0 | 1.5 | 2031-02-03 |" in readme.read_text()
    assert "| gamma | report | 7 | 2026-01-03 |" in readme.read_text()
    results.write_text(TABLE.replace("`gamma`", "`alpha`"))  # malformed: nothing is written
    with pytest.raises(ValueError):
        bench_table.record_figures(
            {"alpha": "9"},
            benchmarks=tmp_path / "benchmarks",
            keys=("alpha",),
            argv=["bench_a.py"],
            date=DAY,
            environ={},
        )
    assert "| alpha ratio | ≥ 1.0 | 1.5 |" in readme.read_text()


def _headline_keys(script: Path) -> set[str]:
    """The RESULTS.md keys a benchmark script declares: its module-level ``HEADLINE_KEYS``, a
    tuple of string literals (``*(...)`` groups allowed); empty if it has none."""
    for node in ast.parse(script.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["HEADLINE_KEYS"]
            and isinstance(node.value, ast.Tuple)
        ):
            items: list[ast.expr] = []
            for elt in node.value.elts:
                inner = elt.value if isinstance(elt, ast.Starred) else elt
                items += inner.elts if isinstance(inner, ast.Tuple) else [inner]
            keys = {i.value for i in items if isinstance(i, ast.Constant)}
            assert len(keys) == len(items) and all(isinstance(k, str) for k in keys), (
                f"{script.name}: HEADLINE_KEYS must be distinct string literals"
            )
            return {str(k) for k in keys}
    return set()


def test_every_make_bench_script_records_rows_the_table_has() -> None:
    # A typo in a key would fail `make bench` only after minutes of measuring: caught here.
    rows = {r.key: r for r in bench_table.parse_table((ROOT / "benchmarks/RESULTS.md").read_text())}
    for planned in bench.PLAN:
        script = planned.script
        keys = _headline_keys(ROOT / "benchmarks" / script)
        assert keys, f"{script} records no headline figure"
        assert keys <= set(rows), f"{script}: no row for {sorted(keys - set(rows))}"
        for key in keys:
            assert rows[key].command.startswith(f"python benchmarks/{script}"), (key, script)
        assert set(planned.keys) <= keys, (
            f"make bench plans {planned.name} to refresh rows {script} does not declare: "
            f"{sorted(set(planned.keys) - keys)}"
        )
        assert any(k in rows for k in planned.keys), f"make bench refreshes no {script} row"


def test_every_script_that_records_names_rows_its_command_measures() -> None:
    # Every benchmark with --record (make bench's and the others), and every headline row: the
    # script its command runs takes --record, so each figure can be refreshed by its command.
    rows = bench_table.parse_table((ROOT / "benchmarks/RESULTS.md").read_text())
    recording = {
        path.name
        for path in (ROOT / "benchmarks").glob("bench_*.py")
        if "add_record_flag(" in path.read_text()
    }
    for script in sorted(recording):
        keys = _headline_keys(ROOT / "benchmarks" / script)
        assert keys, f"{script} takes --record but records no headline figure"
        named = {r.key: r for r in rows if r.key in keys}
        assert set(named) == keys, f"{script}: no row for {sorted(keys - set(named))}"
        for key, row in named.items():
            assert row.command.startswith(f"python benchmarks/{script}"), (key, script)
    for row in rows:
        script = row.command.split()[1].removeprefix("benchmarks/")
        assert script in recording, f"{row.key}: {script} cannot record it (no --record)"


def test_every_script_with_record_writes_only_its_declared_rows() -> None:
    # record_figures refuses a key outside keys=..., so each call must pass the declaration
    # the tests above check against the table.
    for path in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "record_figures"
        ]
        for call in calls:
            keys = [k.value for k in call.keywords if k.arg == "keys"]
            assert len(keys) == 1 and getattr(keys[0], "id", None) == "HEADLINE_KEYS", (
                f"{path.name}:{call.lineno}: record_figures(..., keys=HEADLINE_KEYS)"
            )
        if calls:
            assert _headline_keys(path), f"{path.name} records without HEADLINE_KEYS"


def test_a_planned_run_takes_its_rows_and_names_its_command_in_them() -> None:
    # make bench's run of bench_a.py --rounds 2 refreshes beta (named --rounds 5 before): the
    # row now says which command measured its value; alpha's row matches by its command.
    command = "python benchmarks/bench_a.py --rounds 2"
    text, said = bench_table.record(TABLE, {"alpha": "1", "beta": "4 ms"}, command, DAY, ["beta"])
    rows = {r.key: r for r in bench_table.parse_table(text)}
    assert (rows["beta"].today, rows["beta"].measured, rows["beta"].command) == (
        "4 ms",
        "2031-02-03",
        command,
    )
    assert rows["beta"].figure == "beta latency" and rows["beta"].goal == "report"
    assert rows["alpha"] == bench_table.parse_table(TABLE)[0]  # not planned, another command
    assert said == [
        "beta: 4 ms (2031-02-03; its command was `python benchmarks/bench_a.py --rounds 5`)"
    ]
    with pytest.raises(ValueError, match="planned for"):  # planned but not measured
        bench_table.record(TABLE, {"alpha": "1"}, command, DAY, ["beta"])
    with pytest.raises(ValueError, match="no row for"):
        bench_table.record(TABLE, {"alpha": "1"}, command, DAY, ["omega"])


def test_record_figures_reads_the_plan_and_the_results_file_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real, readme = _checkout(tmp_path)
    copy = tmp_path / "copy.md"
    copy.write_text(TABLE)
    environ = {bench_table.RESULTS_ENV: str(copy), bench_table.PLANNED_ENV: "gamma"}
    said = bench_table.record_figures(
        {"gamma": "8"},
        benchmarks=tmp_path / "benchmarks",
        keys=("gamma",),
        argv=["benchmarks/bench_b.py", "--rounds", "1", "--record"],
        date=DAY,
        environ=environ,
    )
    assert said == ["gamma: 8 (2031-02-03; its command was `python benchmarks/bench_b.py`)"]
    assert (
        "| `gamma` | gamma | report | 8 | 2031-02-03 | `python benchmarks/bench_b.py --rounds 1` |"
        in (copy.read_text())
    )
    assert (real.read_text(), readme.read_text()) == (TABLE, README_TEXT)  # both left alone
    assert "copy.md gamma: 8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not among the script's"):
        bench_table.record_figures(
            {"alpha": "9"}, benchmarks=tmp_path / "benchmarks", keys=("gamma",), environ={}
        )
    assert copy.read_text().count("| 8 |") == 1 and real.read_text() == TABLE
