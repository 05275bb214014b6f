"""A real headless browser for the tests: Debian's Chromium (``scripts/ensure_chromium.sh``
installs it; ``make pytest`` runs that script) driven by Playwright's Python package. Playwright
never downloads a browser here: it is pointed at the system's binary."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from playwright.sync_api import Browser, sync_playwright

# What a root-run headless Chromium needs on a machine with a closed network: no sandbox (root),
# no GPU, and none of the background fetches that fail (and retry) without internet.
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path() -> str:
    """The system Chromium; AssertionError saying how to install it when it is missing."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("no chromium on PATH: run scripts/ensure_chromium.sh (make pytest does)")


@contextmanager
def headless_chromium() -> Iterator[Browser]:
    """A fresh headless Chromium (its own empty profile), closed on exit."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium_path(), headless=True, args=list(CHROMIUM_ARGS)
        )
        try:
            yield browser
        finally:
            browser.close()
