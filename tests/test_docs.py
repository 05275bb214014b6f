"""The docs site and the README: the site builds strict, every page is in its nav, the README
stays a front door, and nothing in the code cites a README heading (it points at docs pages)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from child_process import run_command

from tokenfleet.worker.devtools import bench_table

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15 * 1024
# Where code, tests and deploy files live: what may not cite the README by its headings.
SOURCES = ("shared", "producer", "worker", "tests", "benchmarks", "scripts", "examples", "deploy")
TOP_FILES = ("compose.yaml", "Dockerfile", "Makefile", "mkdocs.yml", "pyproject.toml", ".ci/run")
TEXT_SUFFIXES = {".py", ".lua", ".yaml", ".yml", ".toml", ".md", ".sh", ".txt", ".cfg", ""}
# "README" as a word that is not the file name README.md ("the README's ...", README "Routing"),
# a link into one of its sections (README.md#routing) or a § sign: a citation of a README
# section. Names such as README_START are not.
README_CITATION = re.compile(r"\bREADME(?![.\w])|README\.md#|§")


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    # The fast tier's version of the build's omitted-files check: a new page needs a nav entry.
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = _nav_pages(config["nav"])
    assert len(in_nav) == len(set(in_nav)), in_nav
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert set(in_nav) == on_disk, (
        f"pages missing from mkdocs.yml's nav: {sorted(on_disk - set(in_nav))}; "
        f"nav entries without a page: {sorted(set(in_nav) - on_disk)}"
    )


def test_readme_is_a_front_door_within_its_size() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES, (
        f"README.md is {len(readme.encode())} bytes (at most {README_MAX_BYTES}): move the "
        "detail to a docs/ page and link it"
    )
    for command in ("make demo", "make test"):
        assert command in readme
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to a missing file: {target}"


def test_no_code_test_or_deploy_file_cites_a_readme_heading() -> None:
    files = [ROOT / f for f in TOP_FILES if (ROOT / f).is_file()]
    for folder in (*SOURCES, "docs"):
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
        ]
    here = Path(__file__).resolve()
    citations = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        if path.resolve() != here and path.name != "HISTORY.md"  # the dated record stays as run
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if README_CITATION.search(line)
    ]
    assert not citations, "cite the docs page (docs/NAME.md) instead:\n" + "\n".join(citations)


def test_readme_headline_figures_are_the_results_table() -> None:
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert bench_table.README_START.search(readme), "README.md has no headline block"
    assert bench_table.readme_block(readme, results) == readme, (
        "README.md's headline figures differ from benchmarks/RESULTS.md: rewrite them with "
        "bench_table.readme_block"
    )


@pytest.mark.slow
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    # What `make docs` runs: a broken link, anchor, nav entry or API reference fails it.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = run_command(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        env,
        inherit_env=False,
        cwd=ROOT,
        timeout_s=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index.html", "reference/client/index.html", "benchmarks/index.html"):
        assert (tmp_path / page).is_file(), page
    client_api = (tmp_path / "reference" / "client" / "index.html").read_text()
    assert "submit_many" in client_api  # the API pages are generated from the docstrings
    figures = (tmp_path / "benchmarks" / "index.html").read_text()
    assert "submit-many" in figures  # the headline table is included from RESULTS.md
    settings_api = (tmp_path / "reference" / "settings" / "index.html").read_text()
    # a declared field shows its default and its help (scripts/griffe_settings.py), not the
    # setting(...) call that declares it
    assert "setting(" not in settings_api
    assert "TOKENFLEET_MAX_NUM_SEQS" in settings_api and "max_num_seqs" in settings_api
