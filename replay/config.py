"""The ledger's recorded settings: `memledger config show|get|set` (docs/recall.md,
"Embedders").

One setting so far, `embedder`: the embedder the vector index and recall use for this
ledger, recorded in the database (`meta` row `config.embedder`), so every process that
opens it (the SDK, the CLI, workers) indexes and queries with the same model, whatever
its own `MEMLEDGER_EMBEDDER` says (that variable is only the default of a ledger that
has none recorded). A ledger with neither uses the model its stored vectors carry (one
built before the default became hashgram-v2-512 keeps hashgram-v1-512), else the
default (`projections.vectors.resolve_embedder`). Changing it rebuilds the vector
index, so stored vectors of the old model are replaced; until the rebuild is done
recall compares queries only with vectors of the new model's name and width, never
with a mix.
"""

from __future__ import annotations

from typing import Any, Final

import structlog
from sqlalchemy import func, select

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.store import Store
from projections.embedding import Embedder
from projections.runner import Runner
from projections.vectors import (
    embedder_named,
    given_name,
    record_embedder,
    recorded_embedder,
    resolve_embedder,
)
from replay.progress import ProgressCallback
from replay.rebuild import rebuild

log = structlog.get_logger("memledger.config")

#: The settings `memledger config` knows.
SETTINGS: Final = ("embedder",)


def load_embedder(name: str | None) -> Embedder:
    """The embedder of a name, or a ValidationError saying why it cannot be used here
    (unknown name, or its package not installed)."""
    try:
        return embedder_named(name)
    except (ValueError, RuntimeError) as e:
        raise ValidationError("embedder", str(e)) from e


async def embedder_report(store: Store, *, load: bool = True) -> dict[str, Any]:
    """Which embedder the ledger uses and why, and which models the index holds; with
    `load`, also the model's vector name and width (building the embedder: a model
    takes seconds to load, so `status` does not)."""
    await store.open()
    async with store.read() as conn:
        recorded = await recorded_embedder(conn)
        name, source = await resolve_embedder(conn)
        vc = t.vectors.c
        held = {str(r[0]): int(r[1]) for r in (await conn.execute(
            select(vc.model, func.count()).group_by(vc.model))).all()}
    out: dict[str, Any] = {"name": name, "source": source,
                           "recorded": recorded, "index_models": held}
    if not load:
        return out
    try:
        emb = embedder_named(name)
    except (ValueError, RuntimeError) as e:
        out["error"] = str(e)
        return out
    out.update(model=emb.name, dim=emb.dim,
               index_current=set(held) <= {emb.name})
    if not out["index_current"]:
        out["hint"] = ("the vector index holds vectors of another model: run "
                       "`memledger replay rebuild --projection vectors`")
    return out


async def show(store: Store) -> dict[str, Any]:
    """Every setting (`memledger config show`)."""
    return {"embedder": await embedder_report(store)}


async def set_embedder(store: Store, name: str, *, rebuild_index: bool = True,
                       progress: ProgressCallback | None = None,
                       runner: Runner | None = None) -> dict[str, Any]:
    """Record the ledger's embedder and (unless `rebuild_index` is false) rebuild the
    vector index with it; returns what changed and the rebuild's report.

    The name is checked first by building the embedder (a model must be installed
    here), and recorded as its vectors are named (`hashgram`: the default,
    hashgram-v2-512; `given_name`). Recording the name it already has changes nothing,
    and rebuilds only when the index still holds vectors of another model.
    """
    name = given_name(name)
    emb = load_embedder(name)
    await store.open()
    async with store.view_write() as conn:
        before = await recorded_embedder(conn)
        await record_embedder(conn, name)
    report = await embedder_report(store)
    changed = before != name
    out: dict[str, Any] = {"embedder": name, "model": emb.name, "dim": emb.dim,
                           "was": before, "changed": changed}
    log.info("embedder_set", embedder=name, model=emb.name, was=before)
    if not changed and report.get("index_current", False):
        out["rebuild"] = None
        return out
    if not rebuild_index:
        out["rebuild"] = None
        out["next"] = "memledger replay rebuild --projection vectors"
        return out
    out["rebuild"] = await rebuild(store, ["vectors"], restart=True, progress=progress,
                                   runner=runner)
    return out
