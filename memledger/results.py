"""Typed results of the SDK: frozen values with attributes, `to_dict()` for JSON.

`to_dict()` gives exactly the JSON shapes the command line prints (docs/events.md,
docs/recall.md), so a typed result and the CLI's output never disagree.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Memory", "MemoryVersion", "Recall", "RecallItem", "RecalledTask",
           "TaskSummary"]


def _frozen_copy(d: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(dict(d))


@dataclass(frozen=True, slots=True)
class Memory:
    """The active version of a memory as a principal may read it."""

    memory_id: str
    namespace: tuple[str, ...]
    key: str
    value: Any
    layer: str
    version: int
    status: str
    source: Mapping[str, Any]
    task_key: str | None = None
    session_id: str | None = None
    scope: str | None = None
    expires_at: str | None = None
    _raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Memory:
        """Build from the dict form of a view row (`found` may be present)."""
        return cls(d["memory_id"], tuple(d["namespace"]), d["key"], d["value"], d["layer"],
                   d["version"], d["status"], d["source"], d.get("task_key"),
                   d.get("session_id"), d.get("scope"), d.get("expires_at"),
                   _frozen_copy(d))

    @property
    def redacted(self) -> bool:
        """An as-of read of a memory forgotten since: its value is withheld."""
        return bool(self._raw.get("redacted", False))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape `memledger get` prints (with `"found": true`)."""
        return {"found": True, **{k: v for k, v in _frozen_copy(self._raw).items()
                                  if k != "found"}}


@dataclass(frozen=True, slots=True)
class MemoryVersion:
    """One version of a key in its history: forgotten ones have `redacted` set."""

    memory_id: str
    key: str
    layer: str
    version: int
    status: str
    value: Any
    source: Mapping[str, Any]
    superseded_by: str | None = None
    redacted: bool = False
    _raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryVersion:
        """Build from one entry of the history's dict form."""
        return cls(d["memory_id"], d["key"], d["layer"], d["version"], d["status"],
                   d["value"], d["source"], d.get("superseded_by"),
                   bool(d.get("redacted", False)), _frozen_copy(d))

    def to_dict(self) -> dict[str, Any]:
        """The dict form of this version."""
        return _frozen_copy(self._raw)


@dataclass(frozen=True, slots=True)
class RecallItem:
    """A memory chosen by recall, with why and how much of the budget it took."""

    memory: Memory
    score: float
    reason: str
    tokens: int
    _raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> str:
        """The memory's key."""
        return self.memory.key

    @property
    def value(self) -> Any:
        """The memory's value."""
        return self.memory.value

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RecallItem:
        """Build from one item of recall's dict form."""
        return cls(Memory.from_dict(d), d["score"], d["reason"], d.get("tokens", 0),
                   _frozen_copy(d))

    def to_dict(self) -> dict[str, Any]:
        """The item as `memledger recall` prints it."""
        return _frozen_copy(self._raw)


@dataclass(frozen=True, slots=True)
class TaskSummary:
    """A task as its owner sees it: reports and corrections apart from system facts."""

    task_key: str
    status: str
    refs: Mapping[str, str]
    reports: Sequence[Mapping[str, Any]]
    corrections: Sequence[Mapping[str, Any]]
    system: Mapping[str, Any]
    todos: Sequence[Mapping[str, Any]]
    title: str | None = None
    _raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TaskSummary:
        """Build from a task summary's dict form."""
        return cls(d["task_key"], d["status"], d.get("refs", {}), d.get("reports", []),
                   d.get("corrections", []), d.get("system", {}), d.get("todos", []),
                   d.get("title"), _frozen_copy(d))

    @property
    def redacted(self) -> bool:
        """An as-of read of a task with notes forgotten since: they are withheld."""
        return bool(self._raw.get("redacted", False))

    def to_dict(self) -> dict[str, Any]:
        """The summary as `memledger tasks` prints it."""
        return _frozen_copy(self._raw)


@dataclass(frozen=True, slots=True)
class RecalledTask:
    """An open task chosen by recall, with its score and reason."""

    task: TaskSummary
    score: float
    reason: str
    _raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RecalledTask:
        """Build from one task of recall's dict form."""
        return cls(TaskSummary.from_dict(d), d["score"], d["reason"], _frozen_copy(d))

    def to_dict(self) -> dict[str, Any]:
        """The task as `memledger recall` prints it."""
        return _frozen_copy(self._raw)


@dataclass(frozen=True, slots=True)
class Recall:
    """What to put before a model turn: memories, open tasks, and the audit id (R25)."""

    items: tuple[RecallItem, ...]
    tasks: tuple[RecalledTask, ...]
    audit_id: str
    tokens: int
    budget: int | None
    _raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recall:
        """Build from recall's dict form."""
        return cls(tuple(RecallItem.from_dict(i) for i in d["items"]),
                   tuple(RecalledTask.from_dict(x) for x in d["tasks"]), d["audit_id"],
                   d.get("tokens", 0), d.get("budget"), _frozen_copy(d))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape `memledger recall` prints."""
        return _frozen_copy(self._raw)
