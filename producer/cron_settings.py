"""The cron process's own settings (``python -m tokenfleet.producer.cron``), declared once.

Its Redis mode, sentinels and timeouts are the shared ``Settings`` (the connection flags every
command takes); what is here is rq's URL, which replaces the connection's ``REDIS_URL``, and the
logging level. The cron module generates its flags from this declaration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared import declared_settings
from tokenfleet.shared.declared_settings import setting


@dataclass(frozen=True, slots=True)
class CronSettings:
    """rq's Redis and the log level of the cron process; each declaration says what it does.

    Invariant: none beyond the types (the URL is checked as the connection's ``redis_url``).
    """

    rq_redis_url: str = setting(
        "",
        env="RQ_REDIS_URL",
        flag=("--url", "--redis-url"),
        shown_default="$REDIS_URL, else redis://localhost:6379/0",
        help="rq's Redis, where the queues live (the cron process talks to nothing else); in "
        "sentinel mode only its db, credentials and TLS count",
    )
    logging_level: str = setting("INFO", flag="--logging-level", help="rq's logging level")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CronSettings:
        """``RQ_REDIS_URL`` (default: ``os.environ``), then non-None ``overrides`` (flags).

        Raises:
            SettingsError: an unknown ``TOKENFLEET_`` variable.
        """
        return declared_settings.from_env(cls, env, overrides)
