"""The lexical index and recall's keyword arm (R14, R15, R20, R24, R2).

`projections/lexical.py`: terms (latin words, CJK character bigrams), the `lexical`
projection (entries = active memories, on SQLite and PostgreSQL), the principal-scoped
search, its fusion with the semantic arm, and forgetting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text

from ledger import schema as t
from ledger.store import Store
from ledger.validation import parse_event
from projections import reads
from projections.candidates import fuse
from projections.lexical import (
    MAX_DF_FRACTION,
    MIN_DF_DOCS,
    docid,
    frequent_terms,
    scope_term,
    search,
    terms,
)
from projections.recall import recall
from projections.runner import Runner
from replay.rebuild import rebuild
from tests.factories import event, src, write

U7 = reads.Principal("shop-a", "u7")
U8 = reads.Principal("shop-a", "u8")
NOW = 1_900_000_000_000_000


def at(minute: int) -> str:
    return f"2026-09-20T10:{minute:02d}:00+08:00"


async def append(store: Store, *events: dict[str, Any]) -> None:
    await store.append([parse_event(e) for e in events])


async def entries(store: Store) -> dict[str, str]:
    async with store.read() as conn:
        ld = t.lexical_docs.c
        return {r[0]: r[1] for r in (await conn.execute(select(ld.item_id, ld.terms))).all()}


async def found(store: Store, who: reads.Principal, query: str, *, session: str | None = None
                ) -> list[str]:
    async with store.read() as conn:
        return [m for m, _ in await search(conn, store, who, query, task=None,
                                           session=session, k=20)]


# -- terms ------------------------------------------------------------------------------------

def test_terms_are_words_and_cjk_bigrams() -> None:
    """Latin words casefolded and lightly stemmed, CJK runs as character bigrams, a set
    in sorted order."""
    assert terms("Replies in Simplified Chinese, reply!") == ["chinese", "in", "reply",
                                                              "simplifi"]
    assert terms("回复语言：简体中文") == ["中文", "体中", "回复", "复语", "简体", "语言"]
    assert terms("耳机A123左") == ["a123", "左", "耳机"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["order", "A123", "耳机", "左耳", "ticket", "工单", "7"]),
                min_size=1, max_size=8), st.randoms())
def test_terms_are_a_set_whatever_the_word_order(words: list[str], rnd: Any) -> None:
    """An entry holds no order: any permutation of the words gives the same terms."""
    shuffled = list(words)
    rnd.shuffle(shuffled)
    a, b = terms(" ".join(words)), terms(" ".join(shuffled))
    assert a == b == sorted(set(a))


# -- the projection and the scoped search --------------------------------------------------------

async def test_entries_follow_active_memories_and_stay_in_scope(store: Store) -> None:
    """One entry per active memory; a correction replaces it; search never crosses users."""
    await append(store,
                 write("code_language", "Java", memory_id="M18", source=src(at=at(1))),
                 write("code_language", "Python", memory_id="M31", supersedes="M18",
                       etype="memory.corrected", source=src(at=at(2))),
                 write("headset", "left earbud crackles", memory_id="U8A", user="u8",
                       source=src(at=at(3))),
                 write("draft", "maybe kotlin", memory_id="CAND",
                       source=src("model_inference", at=at(4))))
    await Runner(store).catch_up()
    got = await entries(store)
    assert set(got) == {"M31", "U8A"}
    assert "python" in got["M31"].split() and "java" not in got["M31"]
    assert await found(store, U8, "which earbud crackles") == ["U8A"]
    assert await found(store, U7, "which earbud crackles") == []
    assert await found(store, U7, "python") == ["M31"]
    assert await found(store, reads.Principal("shop-b", "u8"), "earbud") == []


async def test_session_entries_only_in_their_session(store: Store) -> None:
    """A session memory's terms are searched in that session only (R2)."""
    await append(store, write("order", "A123 refund", layer="session", session_id="C17",
                              memory_id="S1"))
    await Runner(store).catch_up()
    assert await found(store, U7, "refund A123", session="C17") == ["S1"]
    assert await found(store, U7, "refund A123", session="C18") == []
    assert await found(store, U7, "refund A123") == []


async def test_terms_in_most_entries_are_dropped_from_the_query(store: Store) -> None:
    """A query term in more than MAX_DF_FRACTION of the entries is not matched (its IDF
    is next to nothing); a query of only such terms keeps them."""
    n = 2 * MIN_DF_DOCS
    few = max(1, int(n * MAX_DF_FRACTION) // 4)
    await append(store, *(write(f"note_{i}", f"order note {i}" + (" earbud" if i < few else ""),
                                memory_id=f"N{i}") for i in range(n)))
    await Runner(store).catch_up()
    if store.dialect != "sqlite":
        async with store.write() as conn:
            await conn.execute(text("ANALYZE lexical_docs"))
    async with store.read() as conn:
        assert await frequent_terms(conn, store, ["order", "earbud"]) == {"order"}
    assert sorted(await found(store, U7, "order earbud")) == sorted(f"N{i}" for i in range(few))
    assert len(await found(store, U7, "order")) == 20


async def test_forget_removes_entries_and_rebuild_matches(store: Store) -> None:
    """A forget deletes the entry; a rebuild of `lexical` gives the same rows (R20)."""
    await append(store, write("pet", "zebrafinch named Kiwi", memory_id="P1",
                              source=src(at=at(1))),
                 write("style", "brief answers", memory_id="P2", source=src(at=at(1))))
    await Runner(store).catch_up()
    assert await found(store, U7, "zebrafinch") == ["P1"]
    await append(store, event("memory.forgotten", {"memory_id": "P1"}, source=src(at=at(5))))
    await Runner(store).catch_up()
    before = await entries(store)
    assert set(before) == {"P2"}
    assert await found(store, U7, "zebrafinch kiwi") == []
    await rebuild(store, ["lexical"], progress=False)
    assert await entries(store) == before
    if store.dialect == "sqlite":
        async with store.read() as conn:
            hits = (await conn.execute(text(
                f"SELECT rowid FROM {t.LEXICAL_FTS} WHERE {t.LEXICAL_FTS} MATCH 'zebrafinch'"
            ))).all()
        assert hits == []


# -- through recall --------------------------------------------------------------------------------

async def test_recall_fuses_both_arms_and_rechecks_lexical_hits(store: Store) -> None:
    """A rare word finds its memory through the lexical arm; a forged lexical entry
    filing u8's memory under u7 is dropped by the re-check (R14, R24)."""
    await append(store,
                 write("vet", "the vet for Mochi is Dr Okonkwo", memory_id="V1",
                       source=src(at=at(1))),
                 write("tea", "oolong without sugar", memory_id="T1", source=src(at=at(1))),
                 write("doctor", "Dr Okonkwo at noon", memory_id="U8D", user="u8",
                       source=src(at=at(1))))
    await Runner(store).catch_up()
    res = await recall(store, "shop-a/u7", query="when is okonkwo", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert [i["memory_id"] for i in res["items"]][:1] == ["V1"]
    assert "lexical" in res["items"][0]["reason"]
    # Forge: an entry in u7's scope for u8's memory (as a corrupted index could hold).
    ns7 = "\x1f".join(["shop-a", "u7", "preferences"]) + "\x1f"
    async with store.view_write() as conn:
        await conn.execute(t.lexical_docs.delete().where(t.lexical_docs.c.item_id == "U8D"))
        await conn.execute(t.lexical_docs.insert().values(
            tenant="shop-a", item_id="U8D", docid=docid("shop-a", "U8D"), ns_path=ns7,
            layer="long", task_key=None, session_id=None,
            scope=scope_term("shop-a", "u7"), terms="dr noon okonkwo"))
    assert "U8D" in await found(store, U7, "okonkwo noon")
    res = await recall(store, "shop-a/u7", query="okonkwo noon", session=None, task=None,
                       budget=None, limit=5, now_us=NOW)
    assert "U8D" not in [i["memory_id"] for i in res["items"]]
    assert all(i["namespace"][:2] == ["shop-a", "u7"] for i in res["items"])


def test_rrf_scales_to_one_and_keeps_both_arms() -> None:
    """First in both arms is 1.0, first in one arm 0.5; a lexical-only hit is kept."""
    got = fuse({"a": 0.9, "b": 0.5}, [("a", 3.0), ("c", 2.0)], ("rrf", 0.0))
    assert got["a"].relevance == 1.0 and got["a"].basis == "semantic + lexical match"
    assert got["c"].basis == "lexical match" and got["b"].basis == "semantic match"
    assert got["c"].relevance == got["b"].relevance < 0.5


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.floats(0.05, 1.0), max_size=6),
       st.lists(st.floats(0.01, 50.0), max_size=6), st.floats(0.0, 1.0))
def test_weighted_fusion_is_bounded_and_ties_stay_ties(sem: dict[str, float],
                                                       lex_scores: list[float],
                                                       a: float) -> None:
    """Weighted fusion stays in [0, 1], covers both arms' ids, and two ids equal in both
    arms get equal relevance (so reliability, then recency, decide: R19)."""
    lex = sorted(zip("cdefgh", lex_scores, strict=False), key=lambda p: -p[1])
    got = fuse(sem, lex, ("weighted", a))
    assert set(got) == set(sem) | {m for m, _ in lex}
    assert all(-1e-9 <= c.relevance <= 1.0 + 1e-9 for c in got.values())
    twin = fuse({"x": 0.4, "y": 0.4}, [("x", 2.0), ("y", 2.0)], ("weighted", a))
    assert twin["x"].relevance == twin["y"].relevance


async def test_forgotten_terms_leave_the_sqlite_files(sqlite_url: str, register_path: str,
                                                      tmp_path: Path) -> None:
    """After a forget, not even the casefolded term is in the database files (FTS5
    segments and shadow tables included) once the WAL is checkpointed (R20)."""
    store = Store(sqlite_url, register_path=register_path)
    try:
        await append(store, write("pet", "Quagmirefox the cat", memory_id="P1",
                                  source=src(at=at(1))),
                     write("style", "brief answers", memory_id="P2", source=src(at=at(1))))
        await Runner(store).catch_up()
        assert await found(store, U7, "quagmirefox") == ["P1"]
        await append(store, event("memory.forgotten", {"memory_id": "P1"},
                                  source=src(at=at(5))))
        await Runner(store).catch_up()
        await store.reclaim()
    finally:
        await store.close()
    db = Path(sqlite_url.split(":///", 1)[1])
    blob = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
    assert b"quagmirefox" not in blob.lower()


def _terms_match_by_match(text: str) -> list[str]:
    """The terms read one regex match at a time (`finditer`, each match's group)."""
    import unicodedata

    from projections.embedding import light_stem
    from projections.lexical import _TERM

    out: list[str] = []
    for m in _TERM.finditer(unicodedata.normalize("NFKC", text).casefold()):
        tok = m.group()
        if m.lastgroup == "cjk" and len(tok) > 1:
            out.extend(tok[i:i + 2] for i in range(len(tok) - 1))
        elif m.lastgroup == "lat":
            out.append(light_stem(tok))
        else:
            out.append(tok)
    return out


_MIXED_SCRIPTS = [*"abcxyz019 ,.-éÉüß", "ﬁ", "Ａ", "中", "文", "日", "テ", "한", "국", "α", "Ж",
                  "\u0301"]


@given(st.text(alphabet=st.sampled_from(_MIXED_SCRIPTS), max_size=40) | st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_terms_equal_match_by_match_reading(text_: str) -> None:
    """The tokenizer (`findall` over the two groups) gives, for any text, the terms
    reading each match (`finditer`) gives, in order (property)."""
    from projections.lexical import _ordered_terms

    assert _ordered_terms(text_) == _terms_match_by_match(text_)
