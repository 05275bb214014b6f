#!/usr/bin/env bash
# Make sure a Chromium is on PATH for the browser tests (Playwright drives the system's binary;
# it never downloads one). Installs Debian's chromium when it is missing and apt-get can be used;
# otherwise says what to install.
set -euo pipefail

ok() { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }

if ok; then
  exit 0
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "ensure_chromium: installing Debian's chromium (the browser tests drive it headless)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
  if ok; then
    exit 0
  fi
fi
echo "ensure_chromium: need chromium on PATH for the browser tests" >&2
echo "ensure_chromium: install it (e.g. 'apt-get install chromium') and run make again" >&2
exit 1
