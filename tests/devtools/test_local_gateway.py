"""``LocalGateway``: after ``start()`` a live gateway answers ``/health``; after ``stop()`` the
process has ended and the port no longer answers."""

from __future__ import annotations

import urllib.request

import pytest

from tokenfleet.worker.devtools.local_gateway import LocalGateway


@pytest.mark.slow  # starts a gateway process
def test_a_local_gateway_answers_until_it_is_stopped(redis_url: str) -> None:
    gateway = LocalGateway(redis_url, key_prefix="localgw", extra_args=["--log-level", "warning"])
    try:
        gateway.start()
        assert gateway.proc is not None and gateway.proc.poll() is None
        with urllib.request.urlopen(f"{gateway.url}/health", timeout=10) as answer:
            assert answer.status == 200
    finally:
        code = gateway.stop()
        gateway.cleanup()
    assert code is not None and gateway.proc.poll() is not None
    assert not gateway.healthy()
    assert not gateway.log_dir.exists()
