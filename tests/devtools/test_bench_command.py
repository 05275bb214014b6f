"""``tokenfleet bench``: finds the source tree's benchmarks/ and runs them, failures listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet.worker import cli
from tokenfleet.worker.devtools.commands import bench

ROOT = Path(__file__).resolve().parents[2]


def test_bench_finds_the_checkout_benchmarks_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing under the working directory: the folder beside the (editable) package is used.
    monkeypatch.chdir(tmp_path)
    assert bench.find_benchmarks() == ROOT / "benchmarks"
    for script in bench.SCRIPTS.values():
        assert (ROOT / "benchmarks" / script).is_file(), script


@pytest.mark.slow  # `bench all` runs each (stub) script as a process of its own
def test_bench_all_runs_every_script_and_fails_if_one_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "workload.py").write_text("")
    ran = tmp_path / "ran"
    for name, script in bench.SCRIPTS.items():
        code = 3 if name == "decode" else 0
        (folder / script).write_text(
            f"import sys\nline = ' '.join([{name!r}, *sys.argv[1:]])\n"
            f"open({str(ran)!r}, 'a').write(line + '\\n')\nsys.exit({code})\n"
        )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "all"]) == 1
    # a failure does not stop the rest; each run records its headline figures (--record)
    assert ran.read_text().splitlines() == [f"{name} --record" for name in bench.SCRIPTS]
    captured = capsys.readouterr()
    assert "failed: decode (exit 3)" in captured.err
    assert cli.main(["bench", "all", "--", "--rounds", "3"]) == 2
    assert "takes no script arguments" in capsys.readouterr().err
