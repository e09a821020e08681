"""One principal's vectors as recall holds them in memory, and the scoring over them.

Loaded and kept current by `projections.index_cache`; searched by
`projections.candidates`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray


@dataclass(eq=False)
class Group:
    """The memories of one task or one session: few, kept apart from long-term rows."""

    ids: list[str]
    keys: list[str]
    columns: NDArray[np.float32]  # (dim, k)


@dataclass(eq=False)
class PrincipalIndex:
    """One principal's vectors of one model, as of a `vectors` checkpoint.

    Long-term rows live in one transposed matrix (`columns[d, row]`), append-only with
    a liveness mask, so an update of a few entries patches the cache instead of
    reloading 100k vectors; task and session memories live in small per-group
    matrices, so the layer filter picks groups before any score is computed. Storing
    the matrix transposed makes a sparse query (the hashed n-gram embedder's sets ~60
    of 512 dimensions) read only its own dimensions (see `long_scores`).
    """

    position: int
    #: Entries of writes after this position may be missing (vectors ran ahead of views).
    pending: int | None
    model: str
    dim: int
    columns: NDArray[np.float32]  # (dim, capacity), rows [0, n) used
    n: int
    alive: NDArray[np.bool_]
    ids: list[str]
    keys: list[str]
    orders: list[bytes]
    row_of: dict[str, int]  # live long-term rows by memory id
    key_rows: dict[str, list[int]]  # normalised key -> long-term rows (live or not)
    groups: dict[tuple[str, str], Group]
    task_ids: list[str]
    task_matrix: NDArray[np.float32]
    stamp: float = 0.0
    other_models: int = 0  # entries of another embedder (the index awaits a rebuild)
    #: The position of the snapshot file written from or read into this index, if any.
    saved_at: int | None = None
    _recency: NDArray[np.int64] | None = None

    @property
    def nbytes(self) -> int:
        """Approximate memory held."""
        extra = sum(g.columns.nbytes for g in self.groups.values())
        return int(self.columns.nbytes + self.task_matrix.nbytes + extra + 200 * self.n)

    @property
    def dead(self) -> int:
        """Long-term rows removed since the last full load."""
        return self.n - len(self.row_of)

    def has(self, memory_id: str) -> bool:
        """Does the index hold an entry for this memory?"""
        return memory_id in self.row_of or any(
            memory_id in g.ids for g in self.groups.values())

    def long_scores(self, q: NDArray[np.float32]) -> NDArray[np.float32]:
        """Cosine of the query with every long-term row (removed rows: -inf).

        Exact either way: with few non-zero query dimensions, sum those dimensions'
        rows (memory traffic ~ non-zeros x rows); otherwise one matrix product.
        """
        out = cosine_scores(self.columns[:, :self.n], q)
        if self.dead:
            out[~self.alive[:self.n]] = -np.inf
        return out

    def recency(self) -> NDArray[np.int64]:
        """Live long-term rows, newest source order first."""
        if self._recency is None:
            rows = sorted(self.row_of.values(), key=self.orders.__getitem__, reverse=True)
            self._recency = np.asarray(rows, dtype=np.int64)
        return self._recency

    def remove(self, memory_id: str) -> None:
        """Drop an entry (its vector is zeroed: a forgotten memory leaves no copy here)."""
        row = self.row_of.pop(memory_id, None)
        if row is not None:
            self.alive[row] = False
            self.columns[:, row] = 0.0
            self._recency = None
        for key, g in list(self.groups.items()):
            if memory_id in g.ids:
                keep = [i for i, m in enumerate(g.ids) if m != memory_id]
                if not keep:
                    del self.groups[key]
                    continue
                self.groups[key] = Group([g.ids[i] for i in keep], [g.keys[i] for i in keep],
                                         np.ascontiguousarray(g.columns[:, keep]))

    def add(self, r: Any, vec: NDArray[np.float32]) -> None:
        """Add one entry (a row of `_ROW_COLUMNS`)."""
        key = r.mkey or ""
        if r.layer != "long":
            gk = group_key(r)
            g = self.groups.get(gk)
            col = vec.reshape(self.dim, 1)
            self.groups[gk] = (Group([r.item_id], [key], col) if g is None else Group(
                [*g.ids, r.item_id], [*g.keys, key], np.hstack([g.columns, col])))
            return
        if self.n == self.columns.shape[1]:
            grown = np.zeros((self.dim, max(16, self.n * 5 // 4)), dtype=np.float32)
            grown[:, :self.n] = self.columns[:, :self.n]
            alive = np.zeros(grown.shape[1], dtype=bool)
            alive[:self.n] = self.alive[:self.n]
            self.columns, self.alive = grown, alive
        row = self.n
        self.columns[:, row] = vec
        self.alive[row] = True
        self.ids.append(r.item_id)
        self.keys.append(key)
        self.orders.append(bytes(r.order_key) if r.order_key is not None else b"")
        self.row_of[r.item_id] = row
        self.key_rows.setdefault(norm_key(key), []).append(row)
        self.n += 1
        self._recency = None


class PackedOrders(list[bytes]):
    """The source orders of a snapshot's rows (`projections.matrix_snapshot`), split
    into a list only when first used: most recalls never look at them (recency
    ranking and appends do), and 100k slices cost more than the rest of a cold load."""

    def __init__(self, blob: bytes, ends: NDArray[np.int64]) -> None:
        super().__init__()
        self._packed: tuple[bytes, NDArray[np.int64]] | None = (blob, ends)

    def _unpack(self) -> None:
        if self._packed is not None:
            blob, ends = self._packed
            self._packed = None
            e = ends.tolist()
            super().extend(blob[a:b] for a, b in zip([0, *e[:-1]], e, strict=True))

    def __getitem__(self, i: Any) -> Any:
        self._unpack()
        return super().__getitem__(i)

    def __len__(self) -> int:
        self._unpack()
        return super().__len__()

    def __iter__(self) -> Any:
        self._unpack()
        return super().__iter__()

    def append(self, item: bytes) -> None:
        self._unpack()
        super().append(item)


def cosine_scores(columns: NDArray[np.float32], q: NDArray[np.float32]) -> NDArray[np.float32]:
    """Cosine of a unit query with the unit columns of a transposed matrix."""
    nz = np.flatnonzero(q)
    if len(nz) * 3 > columns.shape[0]:
        return np.asarray(q @ columns, dtype=np.float32)
    out = np.zeros(columns.shape[1], dtype=np.float32)
    for d in nz:
        out += q[d] * columns[d]
    return out


def group_key(r: Any) -> tuple[str, str]:
    return (r.layer, (r.task_key if r.layer == "task" else r.session_id) or "")


def norm_key(text: str) -> str:
    return " ".join(re.findall(r"[^\W_]+", text.casefold()))

