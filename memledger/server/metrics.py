"""The server's metrics in the Prometheus text format (`GET /metrics`).

Counters and histograms kept in process, labelled by route template, method, status,
event status and error class: never by a value, a key, an id or a namespace.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping

#: Upper bounds (seconds) of the latency histograms.
BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                              2.5, 5.0, 10.0)

Labels = tuple[tuple[str, str], ...]


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(labels: Labels, extra: Iterable[tuple[str, str]] = ()) -> str:
    items = [*labels, *extra]
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in items) + "}"


class Histogram:
    """Cumulative buckets, a sum and a count per label set."""

    def __init__(self) -> None:
        self.counts: dict[Labels, list[int]] = defaultdict(lambda: [0] * len(BUCKETS))
        self.sums: dict[Labels, float] = defaultdict(float)
        self.totals: dict[Labels, int] = defaultdict(int)

    def observe(self, labels: Labels, seconds: float) -> None:
        """Record one observation."""
        i = bisect.bisect_left(BUCKETS, seconds)
        row = self.counts[labels]
        for j in range(i, len(BUCKETS)):
            row[j] += 1
        self.sums[labels] += seconds
        self.totals[labels] += 1

    def lines(self, name: str) -> list[str]:
        """The sample lines of this histogram."""
        out: list[str] = []
        for labels in sorted(self.totals):
            for bound, n in zip(BUCKETS, self.counts[labels], strict=True):
                out.append(f"{name}_bucket{_fmt(labels, [('le', repr(bound))])} {n}")
            out.append(f"{name}_bucket{_fmt(labels, [('le', '+Inf')])} "
                       f"{self.totals[labels]}")
            out.append(f"{name}_sum{_fmt(labels)} {self.sums[labels]:.6f}")
            out.append(f"{name}_count{_fmt(labels)} {self.totals[labels]}")
        return out


class Metrics:
    """Every metric of one server process."""

    def __init__(self) -> None:
        self.requests: dict[Labels, int] = defaultdict(int)
        self.latency = Histogram()
        self.events: dict[Labels, int] = defaultdict(int)
        self.rejects: dict[Labels, int] = defaultdict(int)
        self.recall = Histogram()
        self.rate_limited = 0

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one HTTP request and its latency."""
        self.requests[(("method", method), ("route", route), ("status", str(status)))] += 1
        self.latency.observe((("method", method), ("route", route)), seconds)

    def event(self, status: str) -> None:
        """Count one event of `POST /v1/events` or a typed write by its outcome."""
        self.events[(("status", status),)] += 1

    def reject(self, reason: str) -> None:
        """Count one rejected event or request by the error's class."""
        self.rejects[(("reason", reason),)] += 1

    def render(self, lag: Mapping[str, int], queues: Mapping[str, int],
               shard_lag: Mapping[tuple[str, int], int] | None = None,
               owners: Mapping[int, str] | None = None) -> str:
        """The text exposition; `lag` per projection (its slowest shard's), `shard_lag`
        per (projection, shard), shard lease `owners` and `queues` are read at scrape."""
        out: list[str] = []

        def counter(name: str, help_: str, data: Mapping[Labels, int]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} counter"])
            out.extend(f"{name}{_fmt(k)} {v}" for k, v in sorted(data.items()))

        def gauge(name: str, help_: str, label: str, data: Mapping[str, int]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge"])
            out.extend(f"{name}{_fmt(((label, k),))} {v}" for k, v in sorted(data.items()))

        counter("memledger_http_requests_total", "HTTP requests by route template, method "
                "and status.", self.requests)
        out.extend(["# HELP memledger_http_request_duration_seconds Request latency.",
                    "# TYPE memledger_http_request_duration_seconds histogram"])
        out.extend(self.latency.lines("memledger_http_request_duration_seconds"))
        counter("memledger_events_total", "Events written through the API by outcome "
                "(appended, duplicate, rejected, published, not_sent).", self.events)
        counter("memledger_rejects_total", "Rejected events and requests by reason (the "
                "error's class).", self.rejects)
        out.extend(["# HELP memledger_recall_duration_seconds Recall latency.",
                    "# TYPE memledger_recall_duration_seconds histogram"])
        out.extend(self.recall.lines("memledger_recall_duration_seconds"))
        out.extend(["# HELP memledger_http_rate_limited_total Requests answered 429.",
                    "# TYPE memledger_http_rate_limited_total counter",
                    f"memledger_http_rate_limited_total {self.rate_limited}"])
        gauge("memledger_projection_lag", "Events the projection is behind the head.",
              "projection", lag)
        if shard_lag:
            out.extend(["# HELP memledger_projection_shard_lag Events a shard of the "
                        "projection is behind the head.",
                        "# TYPE memledger_projection_shard_lag gauge"])
            out.extend(f"memledger_projection_shard_lag"
                       f"{_fmt((('projection', n), ('shard', str(k))))} {v}"
                       for (n, k), v in sorted(shard_lag.items()))
        if owners:
            out.extend(["# HELP memledger_shard_lease 1 for each shard lease and its holder.",
                        "# TYPE memledger_shard_lease gauge"])
            out.extend(f"memledger_shard_lease{_fmt((('shard', str(k)), ('owner', o)))} 1"
                       for k, o in sorted(owners.items()))
        if queues:
            gauge("memledger_queue_depth", "Messages ready in the broker's queue.", "queue",
                  queues)
        return "\n".join(out) + "\n"
