"""The gateway's own settings, declared once: ``tokenfleet serve`` flags first, then
``TOKENFLEET_GATEWAY_*`` variables; and the settings of a batch runner in a process of its own.

Connection settings (``REDIS_URL``, ``TOKENFLEET_KEY_PREFIX``, Redis timeouts) are the shared
``Settings``; what is here only shapes HTTP and the Batch API. ``serve``'s flags and
docs/configuration.md are generated from these declarations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared import declared_settings
from tokenfleet.shared.declared_settings import label, setting
from tokenfleet.shared.errors import SettingsError

DISCONNECT_MODES = ("cancel", "continue")
CONSOLE_MODES = ("on", "off")
AUTH_MODES = ("off", "required")
# How often each gateway process re-reads the fleet's model list (live workers, declarations) in
# the background. A constant: requests never wait on it (they check models against the copy),
# and one small read a second per process is cheap; nothing a deployment would tune.
MODELS_REFRESH_S = 1.0
DEFAULT_BATCH_WINDOW = 64  # (the gateway's and a lone batch runner's defaults are one)
DEFAULT_BATCH_LEASE_MS = 10_000
# A batch lease shorter than this would lapse between two renewals of a live driver.
MIN_BATCH_LEASE_MS = 100


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """How the gateway listens and what it accepts; each field's declaration says what it does.

    Invariants (checked at construction): ``auth`` and ``on_disconnect`` are known modes; the
    port is a TCP port; sizes, counts and the processes are positive, the batch lease at least
    ``MIN_BATCH_LEASE_MS``, the submit wait >= 0, the keep-alive interval in (0, 3600] s.
    """

    host: str = setting(
        "127.0.0.1", env="TOKENFLEET_GATEWAY_HOST", flag="--host", help="where to listen"
    )
    port: int = setting(
        8000, env="TOKENFLEET_GATEWAY_PORT", flag="--port", help="the TCP port to listen on"
    )
    auth: str = setting(
        "off",
        env="TOKENFLEET_GATEWAY_AUTH",
        flag="--auth",
        choices=AUTH_MODES,
        help="off: anyone who reaches the port may submit (for local use); required: every /v1 "
        "call needs an API key from tokenfleet keys create",
        see=("API keys and quotas", "security.md#api-keys-and-quotas"),
    )
    on_disconnect: str = setting(
        "cancel",
        env="TOKENFLEET_GATEWAY_ON_DISCONNECT",
        flag="--on-disconnect",
        choices=DISCONNECT_MODES,
        help="what a client's disconnect does to its request when it sends no X-On-Disconnect "
        "header: cancel (free the KV at once) or continue",
    )
    keepalive_s: float = setting(
        15.0,
        env="TOKENFLEET_GATEWAY_KEEPALIVE_S",
        flag="--keepalive-s",
        help="seconds between SSE keep-alive comments on every stream "
        "(tokenfleet.producer.gateway.keepalive): 15 s keeps a stream well inside the common 60 s "
        "idle timeouts of proxies and load balancers (nginx, AWS ALB) at 14 bytes an interval",
        see=("Streams", "sse.md"),
    )
    max_body_bytes: int = setting(
        2_097_152,
        env="TOKENFLEET_GATEWAY_MAX_BODY_BYTES",
        help="a request body larger than this is answered 413 before it is parsed",
    )
    max_file_bytes: int = setting(
        104_857_600,
        env="TOKENFLEET_GATEWAY_MAX_FILE_BYTES",
        help="the same for a file upload (POST /v1/files: a batch's JSONL)",
    )
    submit_wait_s: float = setting(
        10.0,
        env="TOKENFLEET_GATEWAY_SUBMIT_WAIT_S",
        help="how long a submit may wait for room in a queue whose policy is block before it is "
        "answered 429 (seconds)",
    )
    default_max_tokens: int = setting(
        256,
        env="TOKENFLEET_GATEWAY_DEFAULT_MAX_TOKENS",
        help="chat max_tokens when a request gives none (completions default to 16, as OpenAI's)",
    )
    max_n: int = setting(
        8,
        env="TOKENFLEET_GATEWAY_MAX_N",
        help="the most choices one request may ask for (n); above it a 400 names n. Each "
        "choice is a request of its own in the queue",
        see=("n > 1", "structured-outputs.md#several-choices-n"),
    )
    batch_window: int = setting(
        DEFAULT_BATCH_WINDOW,
        env="TOKENFLEET_GATEWAY_BATCH_WINDOW",
        help="the most lines of one batch this process keeps in the fleet at once",
        see=("Batches", "batches.md"),
    )
    batch_lease_ms: int = setting(
        DEFAULT_BATCH_LEASE_MS,
        env="TOKENFLEET_GATEWAY_BATCH_LEASE_MS",
        help="how long a batch this process drives stays its own without a renewal: another "
        "gateway takes a batch over this long after its driver died (milliseconds)",
    )
    console: str = setting(
        "on",
        env="TOKENFLEET_GATEWAY_CONSOLE",
        flag="--console",
        choices=CONSOLE_MODES,
        help="on: serve the fleet console at /console (a live page of queues, workers, KV pools, "
        "requests, batches and dead letters; with --auth required it needs a viewer or admin "
        "key); off: not",
        see=("The fleet console", "console.md"),
    )
    console_refresh_s: float = setting(
        1.0,
        env="TOKENFLEET_GATEWAY_CONSOLE_REFRESH_S",
        flag="--console-refresh-s",
        help="seconds between the console's readings of the fleet: one reading per period for "
        "every console open on the process, none while no console is open",
        see=("The fleet console", "console.md"),
    )
    processes: int = setting(
        1,
        flag="--processes",
        help="uvicorn worker processes on the one port (each builds its own app from the "
        "environment)",
    )
    log_level: str = setting("info", flag="--log-level", help="uvicorn's log level")

    def __post_init__(self) -> None:
        cls = GatewaySettings
        if self.auth not in AUTH_MODES:
            raise SettingsError(
                f"{label(cls, 'auth')} must be 'off' or 'required', got {self.auth!r}"
            )
        if self.on_disconnect not in DISCONNECT_MODES:
            raise SettingsError(
                f"{label(cls, 'on_disconnect')} must be 'cancel' or 'continue', "
                f"got {self.on_disconnect!r}"
            )
        if not 0 < self.port < 65536:
            raise SettingsError(f"{label(cls, 'port')} must be in 1..65535, got {self.port}")
        for name in (
            "max_body_bytes",
            "max_file_bytes",
            "default_max_tokens",
            "max_n",
            "batch_window",
            "processes",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(
                    f"{label(cls, name)} must be positive, got {getattr(self, name)}"
                )
        _check_lease(cls, "batch_lease_ms", self.batch_lease_ms)
        if not 0 < self.keepalive_s <= 3600:  # 0 would make sse-starlette spin
            raise SettingsError(
                f"{label(cls, 'keepalive_s')} must be in (0, 3600], got {self.keepalive_s}"
            )
        if self.submit_wait_s < 0:
            raise SettingsError(
                f"{label(cls, 'submit_wait_s')} must be >= 0, got {self.submit_wait_s}"
            )
        if self.console not in CONSOLE_MODES:
            raise SettingsError(
                f"{label(cls, 'console')} must be 'on' or 'off', got {self.console!r}"
            )
        if not 0.1 <= self.console_refresh_s <= 3600:
            raise SettingsError(
                f"{label(cls, 'console_refresh_s')} must be in [0.1, 3600], "
                f"got {self.console_refresh_s}"
            )

    @property
    def auth_required(self) -> bool:
        """True when every ``/v1`` call needs an API key."""
        return self.auth == "required"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GatewaySettings:
        """``TOKENFLEET_GATEWAY_<FIELD>`` variables (default: ``os.environ``), then
        ``overrides`` (CLI flags; None skips one).

        Raises:
            SettingsError: an unknown ``TOKENFLEET_`` variable or a value that does not parse.
        """
        return declared_settings.from_env(cls, env, overrides)


@dataclass(frozen=True, slots=True)
class BatchRunnerSettings:
    """A batch runner in a process of its own (``python -m
    tokenfleet.producer.gateway.batches.runner``); its connection is the shared ``Settings``.

    Invariant (checked at construction): the window is positive, the lease at least
    ``MIN_BATCH_LEASE_MS``.
    """

    window: int = setting(
        DEFAULT_BATCH_WINDOW,
        flag="--window",
        help="the most lines of one batch this runner keeps in the fleet at once",
    )
    lease_ms: int = setting(
        DEFAULT_BATCH_LEASE_MS,
        flag="--lease-ms",
        help="how long a batch this runner drives stays its own without a renewal (milliseconds)",
    )

    def __post_init__(self) -> None:
        if self.window < 1:
            raise SettingsError(
                f"{label(BatchRunnerSettings, 'window')} must be positive, got {self.window}"
            )
        _check_lease(BatchRunnerSettings, "lease_ms", self.lease_ms)


def _check_lease(cls: type, name: str, value: int) -> None:
    if value < MIN_BATCH_LEASE_MS:
        raise SettingsError(
            f"{label(cls, name)} must be at least {MIN_BATCH_LEASE_MS} ms, got {value}"
        )
