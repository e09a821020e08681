"""The embedding cache: a slow embedder's vectors kept by content digest.

A packaged model embeds about 10 texts a second on a small loaded CPU, so a vectors
rebuild, or a second tenant storing the same text, must not embed a text twice. Table
`embedding_cache` holds one vector per (embedder name, SHA-256 of the text as it is
embedded); `embedding_refs` which index items (tenant, item id) used which digest.

Forgetting (R20): the cached vector of a forgotten text is content (it says what the
text was about, and a vector can be partly inverted), and the text itself has left the
views by the time the index applies the forget. So the index, when it applies a forget,
erases every cache row whose digest a covered item used (`erase_items`), with those
items' references; a digest another item still uses is erased too (the cache is only a
cache: that item's own vector stays in `vectors`, a rebuild embeds its text again).
Cache rows are written only in the index's own transaction, for the entries it inserts,
which are read there from the current views: a vector computed beforehand for a text
that was forgotten meanwhile is never stored.

The default hashed embedder is not cached (`embedding.is_cached`): it computes a vector
faster than a look-up would fetch one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.store import Store
from projections.embedding import Embedder
from projections.sql import chunks, insert_ignore

K = TypeVar("K")

#: Vectors computed ahead of a transaction: (embedder name, digest) -> vector.
Ready = dict[tuple[str, bytes], NDArray[np.float32]]


def digest(text: str) -> bytes:
    """The cache key of a text: SHA-256 of its UTF-8 bytes (32 bytes)."""
    return hashlib.sha256(text.encode("utf-8")).digest()


async def cached(conn: AsyncConnection, emb: Embedder, digests: Iterable[bytes]
                 ) -> dict[bytes, NDArray[np.float32]]:
    """The vectors the cache holds for these digests under `emb`'s name and width."""
    ec = t.embedding_cache.c
    out: dict[bytes, NDArray[np.float32]] = {}
    for chunk in chunks(sorted(set(digests))):
        q = select(ec.digest, ec.vector).where(ec.model == emb.name, ec.dim == emb.dim,
                                               ec.digest.in_(chunk))
        for r in (await conn.execute(q)).all():
            out[bytes(r.digest)] = np.frombuffer(bytes(r.vector), dtype="<f4").astype(
                np.float32)
    return out


async def lookup(conn: AsyncConnection, emb: Embedder, texts: Mapping[K, str]
                 ) -> tuple[dict[K, NDArray[np.float32]], dict[K, str]]:
    """The cache's vectors of `texts` under `emb`'s name and width, and the texts it
    lacks, both by the caller's keys (an item, or the text itself), in `texts`' order.
    The one look-up of the index's `prepare` and the history view's embedding."""
    digests = {k: digest(x) for k, x in texts.items()}
    have = await cached(conn, emb, digests.values())
    found = {k: have[d] for k, d in digests.items() if d in have}
    return found, {k: x for k, x in texts.items() if k not in found}


def embed_into(emb: Embedder, texts: Iterable[str], ready: Ready) -> int:
    """Embed, into `ready`, those of `texts` it lacks (one call of the embedder, with no
    connection held); returns how many were embedded."""
    todo = [(k, x) for k, x in {digest(x): x for x in texts}.items()
            if (emb.name, k) not in ready]
    if not todo:
        return 0
    matrix = emb.embed([x for _, x in todo])
    for i, (k, _) in enumerate(todo):
        ready[(emb.name, k)] = matrix[i]
    return len(todo)


async def prepare(conn: AsyncConnection, emb: Embedder, texts: Sequence[str],
                  ready: Ready) -> int:
    """Embed, into `ready`, the texts the cache does not hold (`conn` is only read; the
    embedding runs after the look-up). Returns how many were embedded."""
    _found, todo = await lookup(conn, emb, {x: x for x in texts})
    return embed_into(emb, todo.values(), ready)


async def embed_items(store: Store, conn: AsyncConnection, emb: Embedder,
                      items: Sequence[tuple[str, str]], texts: Sequence[str],
                      ready: Ready | None = None) -> NDArray[np.float32]:
    """The vectors of `texts` (one per item, (tenant, item id)), inside the index's
    transaction: from `ready` (computed beforehand), else the cache, else embedded now;
    what was not cached is stored, and every item's digest recorded in `embedding_refs`."""
    keys = [digest(x) for x in texts]
    out = np.zeros((len(texts), emb.dim), dtype=np.float32)
    have = await cached(conn, emb, keys)
    new: dict[bytes, NDArray[np.float32]] = {}
    missing: dict[bytes, str] = {}
    for k, x in zip(keys, texts, strict=True):
        if k in have:
            continue
        got = None if ready is None else ready.get((emb.name, k))
        if got is not None:
            new[k] = got
        else:
            missing[k] = x
    if missing:
        matrix = emb.embed(list(missing.values()))
        new.update(zip(missing, matrix, strict=True))
    for i, k in enumerate(keys):
        out[i] = have[k] if k in have else new[k]
    if new:
        await conn.execute(insert_ignore(store, t.embedding_cache), [
            {"model": emb.name, "digest": k, "dim": emb.dim,
             "vector": np.asarray(v, dtype="<f4").tobytes()} for k, v in new.items()])
    refs = sorted({(tenant, item, k) for (tenant, item), k in zip(items, keys, strict=True)})
    if refs:
        await conn.execute(insert_ignore(store, t.embedding_refs), [
            {"tenant": a, "item_id": b, "digest": k} for a, b, k in refs])
    return out


async def erase_items(conn: AsyncConnection, items: Iterable[tuple[str, str]]) -> int:
    """Erase the cached vectors of every digest these items (tenant, item id) used, of
    every embedder, and the items' references; returns the cache rows erased."""
    er, ec = t.embedding_refs.c, t.embedding_cache.c
    grouped: dict[str, list[str]] = {}
    for tenant, item in sorted(set(items)):
        grouped.setdefault(tenant, []).append(item)
    digests: set[bytes] = set()
    for tenant, ids in grouped.items():
        for chunk in chunks(ids):
            q = select(er.digest).where(er.tenant == tenant, er.item_id.in_(chunk))
            digests.update(bytes(r[0]) for r in (await conn.execute(q)).all())
            await conn.execute(delete(t.embedding_refs).where(er.tenant == tenant,
                                                              er.item_id.in_(chunk)))
    erased = 0
    for chunk in chunks(sorted(digests)):
        res: Any = await conn.execute(delete(t.embedding_cache).where(ec.digest.in_(chunk)))
        erased += int(res.rowcount or 0)
    return erased
