"""memledger: an event-sourced memory ledger for AI agent apps.

`import memledger` is the one public import. Everything under the internal packages
(`ledger`, `projections`, `workers`, `replay`) may change between releases.
"""

from __future__ import annotations

from memledger._ledger import MemoryLedger

__all__ = ["MemoryLedger"]
