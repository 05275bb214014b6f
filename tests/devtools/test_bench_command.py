"""``tokenfleet bench``: finds the source tree's benchmarks/ and runs them, failures listed; its
plan refreshes every row of the headline table (none runs a real benchmark here)."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest

from tokenfleet.worker import cli
from tokenfleet.worker.devtools import bench_table
from tokenfleet.worker.devtools.commands import bench

ROOT = Path(__file__).resolve().parents[2]


def test_bench_finds_the_checkout_benchmarks_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing under the working directory: the folder beside the (editable) package is used.
    monkeypatch.chdir(tmp_path)
    assert bench.find_benchmarks() == ROOT / "benchmarks"
    for planned in bench.PLAN:
        assert (ROOT / "benchmarks" / planned.script).is_file(), planned.script


@pytest.mark.slow  # `bench all` runs each (stub) script as a process of its own
def test_bench_all_runs_every_script_and_fails_if_one_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "workload.py").write_text("")
    ran = tmp_path / "ran"
    unable = bench.Benchmark("elsewhere", "bench_gpu.py", (), ("gpu-row",), 1, lambda _: "no GPU")
    monkeypatch.setattr(bench, "PLAN", (*bench.PLAN, unable))
    for script in {b.script for b in bench.PLAN}:
        code = 3 if script == bench.BY_NAME["decode"].script else 0
        (folder / script).write_text(  # a run appends its arguments and environment to `ran`
            "import os, sys\nif __name__ == '__main__':\n"
            f"    planned = os.environ.get({bench_table.PLANNED_ENV!r}, '-')\n"
            f"    line = ' '.join([{script!r}, *sys.argv[1:], '|', planned,"
            f" os.environ.get({bench_table.RESULTS_ENV!r}, '-')])\n"
            f"    open({str(ran)!r}, 'a').write(line + '\\n')\n    sys.exit({code})\n"
        )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "all", "--results", "copy.md"]) == 1
    # a failure does not stop the rest; each run records its planned rows (--record), into the
    # results file named; a run this machine cannot do is skipped with its reason
    runnable = [b for b in bench.PLAN if b.why_not(folder) is None]
    assert unable not in runnable and len(runnable) >= len(bench.PLAN) - 3  # cluster, llama.cpp
    copy = str(tmp_path / "copy.md")
    assert ran.read_text().splitlines() == [
        " ".join([b.script, *b.args, "--record", "|", *b.keys, copy]) for b in runnable
    ]
    captured = capsys.readouterr()
    assert "failed: decode (exit 3), decode-int4 (exit 3), decode-smollm2 (exit 3)" in captured.err
    total = len(bench.PLAN)
    assert f"== [1/{total}] producer (0m00s elapsed): python benchmarks/bench_producer.py" in (
        captured.out
    )
    assert f"[{total}/{total}] elsewhere" in captured.out
    assert "skipped: no GPU; rows left as they are: gpu-row" in captured.out
    summary = captured.out[captured.out.index("tokenfleet bench all: ") :].splitlines()
    assert len(summary) == 1 + total and "in all" in summary[0]
    assert summary[1].split()[::2] == ["producer", "ok"]  # name, time taken, outcome
    assert summary[-1].split() == ["elsewhere", "0m00s", "skipped:", "no", "GPU"]
    assert cli.main(["bench", "all", "--", "--rounds", "3"]) == 2
    assert "takes no script arguments" in capsys.readouterr().err
    # one run: its planned arguments, or those after -- instead; nothing planned, no --record
    ran.write_text("")
    assert cli.main(["bench", "engine-200"]) == 0
    assert cli.main(["bench", "engine-200", "--", "--rounds", "1"]) == 0
    assert ran.read_text().splitlines() == [
        "bench_engine_workload.py --threads 2 --rate 200 | - -",
        "bench_engine_workload.py --rounds 1 | - -",
    ]


def test_every_headline_row_is_refreshed_by_make_bench_or_says_why_not() -> None:
    rows = bench_table.parse_table((ROOT / "benchmarks" / "RESULTS.md").read_text())
    planned = [k for b in bench.PLAN for k in b.keys]
    assert len(planned) == len(set(planned)), "a row is refreshed by two runs of make bench"
    assert set(planned).isdisjoint(bench.UNPLANNED), "a row both planned and unplanned"
    assert all(why.strip() for why in bench.UNPLANNED.values()), "an unplanned row needs a reason"
    keys = {r.key for r in rows}
    missing = sorted(keys - set(planned) - set(bench.UNPLANNED))
    assert not missing, (
        f"headline rows {missing}: add them to a run of tokenfleet bench's PLAN "
        "(worker/devtools/commands/bench.py), or to UNPLANNED with why this machine cannot "
        "measure them"
    )
    stale = sorted((set(planned) | set(bench.UNPLANNED)) - keys)
    assert not stale, f"make bench names rows RESULTS.md does not have: {stale}"
    assert len({b.name for b in bench.PLAN}) == len(bench.PLAN) and bench.DEFAULT in bench.BY_NAME


def test_each_row_was_measured_by_the_script_make_bench_refreshes_it_with() -> None:
    # A row names the command of its value; make bench may run that script with other
    # arguments (its row then takes the new command), but never another script.
    rows = {r.key: r for r in bench_table.parse_table((ROOT / "benchmarks/RESULTS.md").read_text())}
    for planned in bench.PLAN:
        for key in planned.keys:
            assert shlex.split(rows[key].command)[1] == f"benchmarks/{planned.script}", key
        if any(rows[k].command == planned.command for k in planned.keys):
            same = {k for k, r in rows.items() if r.command == planned.command}
            assert same == set(planned.keys), (planned.name, same)  # rows of the same command


def _flags(script: Path) -> set[str]:
    """The ``--flags`` a benchmark script's argparse declares (``add_argument`` literals)."""
    return {
        str(arg.value)
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
    } | {bench_table.RECORD_FLAG}


def test_make_bench_passes_each_script_only_flags_it_takes() -> None:
    # A misspelt flag would fail make bench after the runs before it: caught here.
    for planned in bench.PLAN:
        flags = _flags(ROOT / "benchmarks" / planned.script)
        given = {a for a in planned.args if a.startswith("--")}
        assert given <= flags, (planned.name, sorted(given - flags))
        assert planned.minutes > 0, planned.name
    assert [b.minutes for b in bench.PLAN] == sorted(b.minutes for b in bench.PLAN)  # quick first


def test_bench_list_shows_each_run_its_command_and_rows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    for planned in bench.PLAN:
        assert f"{planned.name}  (~{planned.minutes:g} min)  {planned.command}" in out
        assert f"rows: {' '.join(planned.keys)}" in out
