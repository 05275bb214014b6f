"""The ``tokenfleet`` entry point: every subcommand is registered and explains itself."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from child_process import run_command

from tokenfleet.worker import cli

COMMANDS = (
    "demo",
    "worker",
    "models",
    "submit",
    "get",
    "follow",
    "cancel",
    "queues",
    "serve",
    "console",
    "batch",
    "keys",
    "tenants",
    "status",
    "make-tiny-model",
    "bench",
    "pool",
)
# Commands whose options live on their actions; each action must take --redis-url.
ACTIONS = {
    "pool": ("create", "show"),
    "keys": ("create", "list", "revoke"),
    "tenants": ("set", "list"),
    "batch": ("submit", "status", "cancel", "results", "list"),
}


def test_every_command_module_exists_and_registers() -> None:
    parser = cli.build_parser()
    help_text = parser.format_help()
    for name in COMMANDS:
        assert name in help_text, name
    assert len(cli.COMMANDS) == len(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tokenfleet " + command)
    if command in ("make-tiny-model", "models"):  # local files only; talk to no Redis
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
    out = run_command([str(script), "--help"], timeout_s=60)
    assert out.returncode == 0 and "demo" in out.stdout


def test_help_lists_the_commands_in_their_order(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out, flags=re.MULTILINE)
    assert listed == list(COMMANDS)


def test_cli_composes_its_commands_with_plain_imports() -> None:
    # No importing by string: every command's register function is imported by name.
    tree = ast.parse(Path(cli.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "__import__"
    assert not {name for name in imported if name.split(".")[0] == "importlib"}
    assert all(callable(register) for register in cli.COMMANDS)


def test_every_command_explains_itself_without_torch() -> None:
    # The base install has no torch: the CLI imports and every command's --help runs without it.
    code = f"""
import sys
for name in ("torch", "transformers", "tokenizers"):
    sys.modules[name] = None
from tokenfleet.worker import cli
for command in {COMMANDS!r}:
    try:
        cli.main([command, "--help"])
    except SystemExit as exc:
        assert exc.code == 0, (command, exc.code)
print("ok")
"""
    out = run_command([sys.executable, "-c", code], timeout_s=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
