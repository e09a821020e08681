"""The problems a `replay verify` check finds, and the command's output object."""

from __future__ import annotations

from typing import Any, Final

MAX_PROBLEMS: Final = 50


class Report:
    """Problems found so far (the first `limit` kept, all counted)."""

    def __init__(self, limit: int = MAX_PROBLEMS) -> None:
        self.limit = limit
        self.problems: list[dict[str, Any]] = []
        self.count = 0

    def add(self, check: str, **detail: Any) -> None:
        """Record one problem."""
        self.count += 1
        if len(self.problems) < self.limit:
            self.problems.append({"check": check, **detail})

    def result(self, **counts: Any) -> dict[str, Any]:
        """The command's output object."""
        if self.count:
            return {"ok": False, "problem_count": self.count, "problems": self.problems,
                    **counts}
        return {"ok": True, **counts}
