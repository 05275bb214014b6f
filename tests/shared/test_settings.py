from __future__ import annotations

import pytest

from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.settings import DEFAULT_REDIS_URL, Settings


def test_defaults_without_environment() -> None:
    s = Settings.from_env({})
    assert s.redis_url == DEFAULT_REDIS_URL
    assert s.key_prefix == "tokenfleet"
    assert s.record_ttl_s == 86_400


def test_environment_is_read() -> None:
    s = Settings.from_env(
        {
            "REDIS_URL": "unix:///tmp/r.sock",
            "TOKENFLEET_KEY_PREFIX": "fleet-b",
            "TOKENFLEET_RECORD_TTL_S": "60",
            "UNRELATED": "x",
        }
    )
    assert (s.redis_url, s.key_prefix, s.record_ttl_s) == ("unix:///tmp/r.sock", "fleet-b", 60)


def test_overrides_win_over_environment() -> None:
    s = Settings.from_env({"TOKENFLEET_KEY_PREFIX": "a"}, key_prefix="b", redis_url=None)
    assert s.key_prefix == "b"


def test_misspelt_setting_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(SettingsError, match=r"TOKENFLEET_KEY_PREFX.*TOKENFLEET_KEY_PREFIX"):
        Settings.from_env({"TOKENFLEET_KEY_PREFX": "x"})


def test_worker_settings_in_the_environment_are_not_rejected() -> None:
    s = Settings.from_env({"TOKENFLEET_MODEL": "/models/tiny", "TOKENFLEET_MAX_NUM_SEQS": "8"})
    assert s.key_prefix == "tokenfleet"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("", "empty"),
        ("http://localhost:6379", "must start with redis://"),
        ("redis://", "names no host"),
        ("unix://", "names no socket path"),
    ],
)
def test_bad_urls_are_refused(url: str, fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        Settings(redis_url=url)


@pytest.mark.parametrize("prefix", ["", "has space", "a:b", "x" * 65])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(SettingsError, match=r"key_prefix \(TOKENFLEET_KEY_PREFIX\) must be"):
        Settings(key_prefix=prefix)


def test_non_integer_number_setting_is_refused() -> None:
    with pytest.raises(SettingsError, match="TOKENFLEET_RECORD_TTL_S must be an integer"):
        Settings.from_env({"TOKENFLEET_RECORD_TTL_S": "1d"})
    with pytest.raises(
        SettingsError, match=r"record_ttl_s \(TOKENFLEET_RECORD_TTL_S\) must be a positive integer"
    ):
        Settings(record_ttl_s=0)


def test_with_url_replaces_only_when_given() -> None:
    s = Settings()
    assert s.with_url(None) is s
    assert s.with_url("redis://h:1/0").redis_url == "redis://h:1/0"
