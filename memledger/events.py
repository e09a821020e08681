"""Event builders: one per event type, each validated exactly as the wire path validates.

    import memledger
    ev = memledger.events.write(tenant="shop-a", actor="u7",
                                namespace=["shop-a", "u7", "preferences"],
                                key="reply_language", value="Simplified Chinese",
                                source=memledger.Source.user_request("C17", seq=2))
    await ml.append(ev, wait=True)

Most apps call the `Principal` methods instead, which fill in tenant, actor and the
namespace prefix. The idempotency key defaults to one derived from the source
(`derive_idempotency_key`): a retried call is a duplicate, never a second memory.
"""

from __future__ import annotations

from ledger.builders import (
    Source,
    close_task,
    confirm,
    correct,
    derive_idempotency_key,
    forget_key,
    forget_memory,
    forget_prefix,
    note_task,
    open_task,
    purge_task,
    supersede,
    wire,
    write,
)

__all__ = [
    "Source",
    "close_task",
    "confirm",
    "correct",
    "derive_idempotency_key",
    "forget_key",
    "forget_memory",
    "forget_prefix",
    "note_task",
    "open_task",
    "purge_task",
    "supersede",
    "wire",
    "write",
]
