"""One principal's vectors as recall holds them in memory, and the scoring over them.

Loaded and kept current by `projections.index_cache`; searched by
`projections.candidates`.
"""

from __future__ import annotations

import bisect
import re
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import numpy as np
from numpy.typing import NDArray

T = TypeVar("T")


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
    # Per long-term row: lists after a load from the database, packed columns (read an
    # item at a time) after a snapshot's (`projections.matrix_snapshot`).
    ids: list[str] | PackedText
    keys: list[str] | PackedText
    orders: list[bytes] | PackedOrders
    row_of: dict[str, int] | RowOf  # live long-term rows by memory id
    key_rows: dict[str, list[int]] | KeyRows  # normalised key -> long-term rows (live or not)
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
        add_key_row(self.key_rows, norm_key(key), row)
        self.n += 1
        self._recency = None


def _ints(a: NDArray[Any]) -> memoryview:
    """int64 items readable one at a time as Python ints (faster than numpy scalars)."""
    return np.ascontiguousarray(a, dtype=np.int64).data


class _Packed(Sequence[T]):
    """A column of a snapshot's rows (`projections.matrix_snapshot`) as it lies in the
    file: one blob and the end offset of each item, an item cut out and decoded only
    when asked for (100k strings decoded up front cost more than the rest of a cold
    load); items appended since are kept in a list after them."""

    __slots__ = ("_blob", "_ends", "_extra", "_mv", "_n0")

    def __init__(self, blob: bytes, ends: NDArray[np.int64],
                 extra: list[T] | None = None) -> None:
        self._blob = blob
        self._ends = ends
        self._mv = _ints(ends)
        self._n0 = len(ends)
        self._extra: list[T] = [] if extra is None else extra

    def _cut(self, i: int) -> bytes:
        mv = self._mv
        return self._blob[mv[i - 1] if i else 0:mv[i]]

    @abstractmethod
    def _item(self, i: int) -> T:
        """Item `i` of the file's column, decoded (each subclass knows its encoding)."""

    @abstractmethod
    def _encode(self, item: T) -> bytes:
        """The bytes `item` takes in the file's column."""

    def __len__(self) -> int:
        return self._n0 + len(self._extra)

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if 0 <= i < self._n0:
            return self._item(i)
        if i < 0:
            raise IndexError(i)
        return self._extra[i - self._n0]

    def __iter__(self) -> Iterator[T]:
        for i in range(self._n0):
            yield self._item(i)
        yield from self._extra

    def append(self, item: T) -> None:
        """Add an item after the others."""
        self._extra.append(item)

    def frozen(self, n: int) -> _Packed[T]:
        """The first `n` items, unaffected by later appends (the blob is shared)."""
        if n <= self._n0:
            return type(self)(self._blob, self._ends[:n])
        return type(self)(self._blob, self._ends, self._extra[:n - self._n0])

    def packed(self) -> tuple[bytes, NDArray[np.int64]]:
        """(blob, end offsets) of every item, the blob's items copied as they are."""
        more = [self._encode(x) for x in self._extra]
        base = self._mv[self._n0 - 1] if self._n0 else 0
        ends = np.concatenate([self._ends, base + np.cumsum([len(b) for b in more],
                                                             dtype=np.int64)])
        return self._blob[:base] + b"".join(more), ends


class PackedText(_Packed[str]):
    """A `_Packed` column of UTF-8 text (memory ids, keys)."""

    __slots__ = ()

    def _item(self, i: int) -> str:
        return self._cut(i).decode()

    def _encode(self, item: str) -> bytes:
        return item.encode()


class PackedOrders(_Packed[bytes]):
    """A `_Packed` column of bytes (the rows' source orders)."""

    __slots__ = ()

    def _item(self, i: int) -> bytes:
        return self._cut(i)

    def _encode(self, item: bytes) -> bytes:
        return item


def pack(items: Sequence[Any], text: bool) -> tuple[bytes, NDArray[np.int64]]:
    """(blob, end offsets) of a column: a packed one as it is, a list encoded."""
    if isinstance(items, _Packed):
        return items.packed()
    raw = [x.encode() for x in items] if text else [bytes(x) for x in items]
    return b"".join(raw), np.cumsum([len(b) for b in raw], dtype=np.int64)


class _Sorted(Sequence[bytes]):
    """The items of a packed column in the order of `rows` (for `bisect`)."""

    def __init__(self, col: _Packed[Any], rows: NDArray[np.int64]) -> None:
        self._col, self._rows = col, _ints(rows)

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._col._cut(self._rows[i])


class RowOf:
    """Memory id -> live long-term row, for a snapshot's index: its live rows sorted by
    id (found by binary search in the packed ids, never all decoded) and the changes
    made since (`PrincipalIndex.add` / `remove`). The part of the `dict` interface the
    index uses."""

    def __init__(self, ids: _Packed[str], by_id: NDArray[np.int64]) -> None:
        self._sorted = _Sorted(ids, by_id)
        self._rows = _ints(by_id)
        self._gone: set[str] = set()  # base ids removed (or given another row) since
        self._new: dict[str, int] = {}

    def _base(self, m: str) -> int | None:
        if m in self._gone:
            return None
        b = m.encode()
        i = bisect.bisect_left(self._sorted, b)
        if i < len(self._rows) and self._sorted[i] == b:
            return int(self._rows[i])
        return None

    @overload
    def get(self, m: str) -> int | None: ...

    @overload
    def get(self, m: str, default: int) -> int: ...

    def get(self, m: str, default: int | None = None) -> int | None:
        """The row of `m`, or `default`."""
        got = self._new.get(m)
        if got is None:
            got = self._base(m)
        return default if got is None else got

    def __contains__(self, m: object) -> bool:
        return isinstance(m, str) and self.get(m) is not None

    def __getitem__(self, m: str) -> int:
        got = self.get(m)
        if got is None:
            raise KeyError(m)
        return got

    def __setitem__(self, m: str, row: int) -> None:
        if m not in self._new and self._base(m) is not None:
            self._gone.add(m)
        self._new[m] = row

    def pop(self, m: str, default: int | None = None) -> int | None:
        """Remove `m`; its row, or `default`."""
        if m in self._new:
            return self._new.pop(m)
        got = self._base(m)
        if got is None:
            return default
        self._gone.add(m)
        return got

    def __len__(self) -> int:
        return len(self._rows) - len(self._gone) + len(self._new)

    def items(self) -> Iterator[tuple[str, int]]:
        """(memory id, row) of every live row."""
        gone, new = self._gone, self._new
        for i in range(len(self._rows)):
            m = self._sorted[i].decode()
            if m not in gone and m not in new:
                yield m, int(self._rows[i])
        yield from new.items()

    def __iter__(self) -> Iterator[str]:
        return (m for m, _ in self.items())

    def values(self) -> Iterator[int]:
        """Every live row."""
        return (r for _, r in self.items())


class KeyRows:
    """Normalised key -> long-term rows (live or not), for a snapshot's index: its keys
    sorted and packed with the rows of each (found by binary search, never all
    decoded), and the rows added since. The part of the `dict` interface recall
    uses."""

    def __init__(self, keys: PackedOrders, starts: NDArray[np.int64],
                 rows: NDArray[np.int64]) -> None:
        self._keys = keys
        self._starts = _ints(starts)
        self._rows = rows
        self._new: dict[str, list[int]] = {}

    def _base(self, k: str) -> list[int]:
        b = k.encode()
        i = bisect.bisect_left(self._keys, b)
        if i < len(self._keys) and self._keys[i] == b:
            return self._rows[self._starts[i]:self._starts[i + 1]].tolist()  # type: ignore[no-any-return]
        return []

    @overload
    def get(self, k: str) -> list[int] | None: ...

    @overload
    def get(self, k: str, default: list[int]) -> list[int]: ...

    def get(self, k: str, default: list[int] | None = None) -> list[int] | None:
        """The rows of key `k` (a new list), or `default` when it has none."""
        got = self._base(k) + self._new.get(k, [])
        return got if got else default

    def add(self, k: str, row: int) -> None:
        """Record another row of key `k`."""
        self._new.setdefault(k, []).append(row)

    def items(self) -> Iterator[tuple[str, list[int]]]:
        """(key, rows) of every key."""
        new = self._new
        seen = set()
        for i in range(len(self._keys)):
            k = self._keys[i].decode()
            rows = self._rows[self._starts[i]:self._starts[i + 1]].tolist()
            seen.add(k)
            yield k, rows + new.get(k, [])
        yield from ((k, v) for k, v in new.items() if k not in seen)

    def frozen(self, n: int) -> KeyRows:
        """A copy whose rows stop before `n` (unaffected by later additions)."""
        out = KeyRows(self._keys, np.asarray(self._starts), self._rows)
        out._new = {k: [r for r in v if r < n] for k, v in self._new.items()}
        return out


def add_key_row(key_rows: dict[str, list[int]] | KeyRows, k: str, row: int) -> None:
    """Record row `row` under normalised key `k` (either form of `key_rows`)."""
    if isinstance(key_rows, KeyRows):
        key_rows.add(k, row)
    else:
        key_rows.setdefault(k, []).append(row)


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

