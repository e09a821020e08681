"""memledger: an event-sourced memory ledger for AI agent apps.

`import memledger` is the one public import::

    async with memledger.MemoryLedger("sqlite+aiosqlite:///./memledger.db") as ml:
        u7 = ml.principal("shop-a", "u7")
        await u7.remember(["preferences"], "reply_language", "Simplified Chinese",
                          source=memledger.Source.user_request("C17", seq=2))
        m = await u7.get(["preferences"], "reply_language")

It exports the SDK (`MemoryLedger`, `Principal`), the typed results, the event
builders (`memledger.events`) and the error tree. Everything under the internal
packages (`ledger`, `projections`, `workers`, `replay`) may change between releases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ledger.errors import (
    AccessDenied,
    BackupError,
    BrokerUnavailable,
    ConcurrencyConflict,
    IdempotencyConflict,
    IntegrityError,
    MemledgerError,
    RegisterError,
    SchemaOutOfDate,
    StoreUnavailable,
    ValidationError,
)
from ledger.events import Event
from ledger.records import AppendResult
from memledger import events
from memledger._ledger import EmbedderSetting, MemoryLedger, Principal, Source
from memledger.results import Memory, MemoryVersion, Recall, RecalledTask, RecallItem, TaskSummary

if TYPE_CHECKING:
    from workers.publish import PublishResult

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`memledger.PublishResult` on first use (PEP 562): its module loads the broker's
    client, which a process that never publishes does not need at start-up."""
    if name == "PublishResult":
        from workers.publish import PublishResult
        return PublishResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AccessDenied",
    "AppendResult",
    "BackupError",
    "BrokerUnavailable",
    "ConcurrencyConflict",
    "EmbedderSetting",
    "Event",
    "IdempotencyConflict",
    "IntegrityError",
    "MemledgerError",
    "Memory",
    "MemoryLedger",
    "MemoryVersion",
    "Principal",
    "PublishResult",
    "Recall",
    "RecallItem",
    "RecalledTask",
    "RegisterError",
    "SchemaOutOfDate",
    "Source",
    "StoreUnavailable",
    "TaskSummary",
    "ValidationError",
    "events",
]
