"""The ``tokenfleet`` entry point: every subcommand is registered and explains itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenfleet.worker import cli

COMMANDS = ("demo", "worker", "submit", "queues", "status", "make-tiny-model", "bench", "pool")
# Commands whose options live on their actions; each action must take --redis-url.
ACTIONS = {"pool": ("create", "show")}


def test_every_command_module_exists_and_registers() -> None:
    parser = cli.build_parser()
    help_text = parser.format_help()
    for name in COMMANDS:
        assert name in help_text, name
    assert len(cli.COMMAND_MODULES) == len(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tokenfleet " + command)
    if command == "make-tiny-model":  # writes files; talks to no Redis
        return
    for action in ACTIONS.get(command, ()):
        with pytest.raises(SystemExit):
            cli.main([command, action, "--help"])
        assert "--redis-url" in capsys.readouterr().out, f"{command} {action}"
    if command not in ACTIONS:
        assert "--redis-url" in out, f"{command} has no --redis-url"


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_bad_redis_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["queues", "--redis-url", "http://nowhere:6379"])
    assert code != 0
    assert "must start with redis://" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "tokenfleet"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout


def test_bench_all_runs_every_script_and_fails_if_one_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenfleet.worker.commands import bench

    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "workload.py").write_text("")
    ran = tmp_path / "ran"
    for name, script in bench.SCRIPTS.items():
        code = 3 if name == "decode" else 0
        (folder / script).write_text(
            f"import sys\nopen({str(ran)!r}, 'a').write({name!r} + '\\n')\nsys.exit({code})\n"
        )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "all"]) == 1
    assert ran.read_text().split() == list(bench.SCRIPTS)  # a failure does not stop the rest
    captured = capsys.readouterr()
    assert "failed: decode (exit 3)" in captured.err
    assert cli.main(["bench", "all", "--", "--rounds", "3"]) == 2
    assert "takes no script arguments" in capsys.readouterr().err
