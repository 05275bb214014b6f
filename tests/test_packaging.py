"""The install layout: three folders under ``tokenfleet.``, nothing bare, no torch in the base."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from child_process import run_command

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "shared": "tokenfleet.shared",
    "producer": "tokenfleet.producer",
    "worker": "tokenfleet.worker",
}


def _listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def test_every_package_folder_is_listed_in_pyproject() -> None:
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == _listed_packages()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = run_command(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        timeout_s=600,
    )
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("tokenfleet-*.whl")
    return path


def test_wheel_installs_only_under_tokenfleet(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"tokenfleet", next(t for t in top if t.endswith(".dist-info"))}
    for package in _listed_packages():
        assert package.replace(".", "/") + "/__init__.py" in names
    assert "tokenfleet/shared/scripts/finish.py" in names
    for lua in ("enqueue.lua", "tf_finish.lua"):  # scripts ship as package data
        assert f"tokenfleet/shared/scripts/{lua}" in names
    for lua in ("api_key_admit.lua", "bucket.lua"):  # and the API keys' scripts
        assert f"tokenfleet/producer/gateway/auth/lua/{lua}" in names
    for lua in ("pool_inspect.lua", "prelude.lua"):  # and a pool's (producers read pools too)
        assert f"tokenfleet/shared/pool/lua/{lua}" in names
    # the tiny tokenizer's training text
    assert "tokenfleet/worker/devtools/data/tiny_corpus.txt" in names
    assert "tokenfleet/producer/py.typed" in names
    # the console: its templates, its own script and style, and the vendored files copied from
    # their npm packages (it is served with no network: nothing comes from elsewhere)
    console = "tokenfleet/producer/gateway/console"
    for name in ("templates/console.html", "templates/_queues.html", "static/console.js"):
        assert f"{console}/{name}" in names
    vendored = json.loads(zipfile.ZipFile(wheel).read(f"{console}/static/vendor/VERSIONS.json"))
    assert {"htmx.min.js", "htmx-ext-sse.min.js", "uPlot.iife.min.js", "uPlot.min.css"} <= set(
        vendored
    )
    for name, entry in vendored.items():
        data = zipfile.ZipFile(wheel).read(f"{console}/static/vendor/{name}")
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
    lock = json.loads((ROOT / "web" / "package-lock.json").read_text())["packages"]
    for entry in vendored.values():  # the locked version, taken with its integrity hash
        locked = lock[f"node_modules/{entry['package']}"]
        assert locked["version"] == entry["version"] and locked["integrity"].startswith("sha512-")


def test_base_modules_import_without_torch() -> None:
    # torch and transformers made unimportable in a fresh interpreter.
    code = """
import sys
for name in ("torch", "transformers", "tokenizers"):
    sys.modules[name] = None
import tokenfleet.shared.schema, tokenfleet.shared.scripts.finish, tokenfleet.producer
import tokenfleet.worker.cli as cli
cli.build_parser()
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    out = run_command([sys.executable, "-c", code], timeout_s=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.slow
def test_clean_venv_install_imports_producer_without_torch(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    installed = run_command(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)], timeout_s=300
    )
    assert installed.returncode == 0, installed.stderr
    check = (
        "import importlib.util, tokenfleet.producer, tokenfleet.shared.schema;"
        "assert importlib.util.find_spec('torch') is None, 'torch was installed';"
        "print('ok')"
    )
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    out = run_command([str(python), "-c", check], clean_env, inherit_env=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for bare in ("shared", "worker", "producer"):
        res = run_command(
            [str(python), "-c", f"import {bare}"], clean_env, inherit_env=False, cwd=tmp_path
        )
        assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr, bare
