"""The gateway's own settings: ``tokenfleet serve`` flags first, then ``TOKENFLEET_GATEWAY_*``.

Connection settings (``REDIS_URL``, ``TOKENFLEET_KEY_PREFIX``, Redis timeouts) are the shared
``Settings``; what is here only shapes HTTP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tokenfleet.shared.errors import SettingsError

ENV_PREFIX = "TOKENFLEET_GATEWAY_"
DISCONNECT_MODES = ("cancel", "continue")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """How the gateway listens and what it accepts.

    Attributes:
        host, port: where uvicorn listens.
        auth: ``off`` (anyone who reaches the port may submit; for local use) or ``required``
            (every ``/v1`` call needs an API key from ``tokenfleet keys create``).
        max_body_bytes: a request body larger than this is answered 413 before it is parsed.
        max_file_bytes: the same for a file upload (``POST /v1/files``: a batch's JSONL).
        on_disconnect: what a client's disconnect does to its request when it sends no
            ``X-On-Disconnect`` header: ``cancel`` (free the KV at once) or ``continue``.
        submit_wait_s: how long a submit may wait for room in a queue whose policy is
            ``block`` before it is answered 429.
        models_ttl_s: how often each process re-reads the fleet's model list (live workers,
            declarations) in the background; requests check models against that copy.
        default_max_tokens: ``max_tokens`` when a request gives none.
        batch_window: the most lines of one batch this process keeps in the fleet at once.
        batch_lease_ms: how long a batch this process drives stays its own without a renewal
            (another gateway takes a batch over this long after its driver died).
        keepalive_s: seconds between SSE keep-alive comments on every stream (see
            :mod:`tokenfleet.producer.gateway.keepalive`). 15 s keeps a stream well inside the
            common 60 s idle timeouts of proxies and load balancers (nginx, AWS ALB) at the cost
            of 14 bytes per interval.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    auth: str = "off"
    max_body_bytes: int = 2_097_152
    max_file_bytes: int = 104_857_600
    on_disconnect: str = "cancel"
    submit_wait_s: float = 10.0
    models_ttl_s: float = 1.0
    default_max_tokens: int = 256
    batch_window: int = 64
    batch_lease_ms: int = 10_000
    keepalive_s: float = 15.0

    def __post_init__(self) -> None:
        if self.auth not in ("off", "required"):
            raise SettingsError(f"gateway auth must be 'off' or 'required', got {self.auth!r}")
        if self.on_disconnect not in DISCONNECT_MODES:
            raise SettingsError(
                f"on_disconnect must be 'cancel' or 'continue', got {self.on_disconnect!r}"
            )
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535, got {self.port}")
        for name in (
            "max_body_bytes",
            "max_file_bytes",
            "default_max_tokens",
            "batch_window",
            "batch_lease_ms",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.keepalive_s <= 3600:  # 0 would make sse-starlette spin
            raise SettingsError(f"keepalive_s must be in (0, 3600], got {self.keepalive_s}")
        for name in ("submit_wait_s", "models_ttl_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def auth_required(self) -> bool:
        """True when every ``/v1`` call needs an API key."""
        return self.auth == "required"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GatewaySettings:
        """``TOKENFLEET_GATEWAY_<FIELD>`` variables, then ``overrides`` (CLI flags; None skips).

        Raises:
            SettingsError: an unknown ``TOKENFLEET_GATEWAY_`` variable or a value that does not
                parse.
        """
        env = os.environ if env is None else env
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX):
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in types:
                known = ", ".join(ENV_PREFIX + k.upper() for k in sorted(types))
                raise SettingsError(f"unknown setting {var}; known: {known}")
            values[name] = _parse(var, raw, str(types[name]))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(var: str, raw: str, type_name: str) -> Any:
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
    except ValueError:
        raise SettingsError(f"{var} must be a {type_name}, got {raw!r}") from None
    return raw
