"""The client library a web app or a cron job uses to submit generation requests.

``Client`` (sync) and ``AsyncClient`` (asyncio) submit requests and return handles that stream
tokens and results; see docs/client.md.
"""

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.async_handle import AsyncHandle
from tokenfleet.producer.client import Client
from tokenfleet.producer.core.models import ModelInfo
from tokenfleet.producer.core.result import Result
from tokenfleet.producer.handle import Handle
from tokenfleet.shared.errors import (
    IdempotencyConflict,
    InvalidRequest,
    ModelNotServed,
    Overloaded,
    RequestFailed,
    UnknownRequest,
)
from tokenfleet.shared.queue_config import OverflowPolicy, QueueConfig, QueueStats
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import TerminalEvent, TokenEvent

__all__ = [
    "AsyncClient",
    "AsyncHandle",
    "Client",
    "Handle",
    "IdempotencyConflict",
    "InvalidRequest",
    "ModelInfo",
    "ModelNotServed",
    "OverflowPolicy",
    "Overloaded",
    "QueueConfig",
    "QueueStats",
    "RequestFailed",
    "RequestRecord",
    "Result",
    "TerminalEvent",
    "TokenEvent",
    "UnknownRequest",
]
