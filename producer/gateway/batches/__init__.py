"""The core of the OpenAI Batch API: files, batches and the runner that feeds a batch's lines
into the fleet and records each line's result exactly once.

Invariants:

* every valid line of a batch ends in exactly one of its two files (output or error), and so
  does every invalid one (in the error file, with its reason); a cancelled or expired batch
  gives the lines it did not finish an error line (``batch_cancelled`` / ``batch_expired``);
* the ledger ``P:batch:ID:done`` (line index -> ok | err) is the truth: a line is written to a
  file only by the script that adds its ledger entry (HSETNX), so never twice, by any number of
  runners; ``completed`` + ``failed`` count the entries;
* ``next_line`` (the lines handed to the fleet) only moves forward; a line below it without a
  ledger entry is in flight, and a runner taking the batch over re-attaches it by its request
  id ``{batch_id}-{index}`` (submitting is idempotent);
* nothing here imports FastAPI: the HTTP routes are built on this API.
"""

from __future__ import annotations

from tokenfleet.producer.gateway.batches.files import FileStore
from tokenfleet.producer.gateway.batches.objects import (
    BatchObject,
    FileObject,
    FileTooLarge,
    NotFound,
)
from tokenfleet.producer.gateway.batches.runner import BatchRunner
from tokenfleet.producer.gateway.batches.store import BatchStore

__all__ = [
    "BatchObject",
    "BatchRunner",
    "BatchStore",
    "FileObject",
    "FileStore",
    "FileTooLarge",
    "NotFound",
]
