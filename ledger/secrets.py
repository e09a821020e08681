"""Secret detection that keeps credentials out of the ledger (R23).

Credentials, passwords, payment card data and one-time codes never enter memory.
This module holds pure functions that look for values shaped like secrets in
free text and in JSON values, so that callers can reject a write before it is
stored. Findings name *where* a secret was seen and *what kind* it looks like;
they never carry the secret text itself, so error messages built from them are
safe to log and to show.

The rules are tuned to stay quiet on ordinary English and Chinese memory text:
dates, times, phone numbers, prices, order and ticket numbers and plain prose
do not match. The notable trade-offs are:

* A card number must be 13..19 digits, pass the Luhn check and start with a
  digit from 2 to 6 (every major card network does). This keeps millisecond
  and nanosecond Unix timestamps, snowflake IDs and Chinese mobile numbers
  (all starting with 1) from being taken for cards. A 13-digit number must
  start with 4 (only Visa issued those; EAN-13 barcodes look alike), and an
  18-digit number that is a well-formed Chinese resident ID is not a card.
* A grouped card number must follow a card layout: a first group of 4 digits,
  middle groups of 4..6 digits and a last group of 3..6 digits (4-4-4-4,
  4-6-5, 4-4-4-4-3 ...). Digits glued to ASCII letters, or after ``+``, ``.``
  or ``/``, are not cards (IDs, international phone numbers, decimals).
* After "password is" the value must contain something other than lowercase
  letters, and after a bare "password" it must contain a digit or a symbol;
  otherwise "password is required" or "a password manager" would match.
  Chinese "密码是/为/：" needs an ASCII value, so "密码是什么" passes; numbers
  under 4 digits are counts ("密码是6位数字"), not passwords.
* Keyword-introduced keys and tokens ("api key: X", "token: X") need 16+
  characters mixing digits or letter cases; prefixed keys (``sk-``, ``ghp_``,
  ``AKIA`` ...) are matched on their prefix.
* "code is 1234" counts as a one-time code unless the word before "code" names
  an ordinary code (zip, postal, area, country, error, promo, confirmation ...).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

__all__ = ["SecretFinding", "find_secret_in_text", "find_secrets", "luhn_valid", "may_hold_secret",
           "secret_key_kind"]

_KIND_PHRASES: Final[dict[str, str]] = {
    "payment_card": "a payment card number",
    "password": "a password",
    "api_key": "an API key",
    "token": "an access token",
    "one_time_code": "a one-time code",
    "private_key": "a private key",
}


@dataclass(frozen=True, slots=True)
class SecretFinding:
    """A place in a value that looks like a secret, without the secret itself."""

    kind: str
    path: str

    def describe(self) -> str:
        """Return a user-facing explanation that never includes the secret text."""
        what = _KIND_PHRASES.get(self.kind, "a secret")
        where = self.path or "value"
        return (
            f"{where} looks like {what}; secrets never enter the ledger (R23): "
            "remove it or store a reference instead"
        )


# --------------------------------------------------------------------------- cards


def luhn_valid(digits: str) -> bool:
    """Return True when ``digits`` passes the Luhn checksum.

    Spaces and dashes are ignored; anything else that is not an ASCII digit,
    or an empty input, makes the result False.
    """
    compact = digits.replace(" ", "").replace("-", "")
    if not compact or not all("0" <= ch <= "9" for ch in compact):
        return False
    total = 0
    for index, ch in enumerate(reversed(compact)):
        value = ord(ch) - 48
        if index % 2 == 1:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _card_number_ok(compact: str) -> bool:
    """Return True when a digit string has the length, prefix and checksum of a card."""
    if not 13 <= len(compact) <= 19 or compact[0] not in "23456":
        return False
    if len(compact) == 13 and compact[0] != "4":
        return False  # only Visa issued 13-digit cards; EAN-13 barcodes look alike
    return luhn_valid(compact) and not _is_cn_resident_id(compact)


_CN_ID_WEIGHTS: Final = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def _is_cn_resident_id(compact: str) -> bool:
    """Return True when an 18-digit string is a well-formed Chinese resident ID number.

    Such numbers are personal data but not payment cards; telling them apart
    keeps "身份证号 ..." notes from being rejected as card numbers.
    """
    if len(compact) != 18 or compact[6:8] not in ("19", "20"):
        return False
    month, day = int(compact[10:12]), int(compact[12:14])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return False
    total = sum(int(ch) * weight for ch, weight in zip(compact, _CN_ID_WEIGHTS, strict=False))
    return "10X98765432"[total % 11] == compact[17]


# A maximal run of ASCII digit groups joined by single spaces or dashes that is
# not glued to a preceding ASCII letter or digit and does not follow "+", "." or
# "/", which leaves out IDs such as "A4111...", international phone numbers and
# the fraction part of decimals. What may follow the run is checked in code, so
# a rejected run is skipped whole instead of being rescanned from inside.
_DIGIT_RUN: Final = re.compile(r"(?<![0-9A-Za-z_+./-])[0-9]++(?:[ -][0-9]++)*+")
_RUN_END_BLOCKER: Final = re.compile(r"[0-9A-Za-z]|[.,/][0-9]")


# A card written with one other separator throughout: "4111.1111.1111.1111",
# "4111_1111_1111_1111", "4111/1111/1111/1111", "4111,1111,1111,1111". The same
# separator between every group (and the card layout below) keeps dates, decimals,
# fractions and lists of small numbers out.
_OTHER_SEP_RUN: Final = re.compile(
    r"(?<![0-9A-Za-z_+./,-])[0-9]{4}([._/,])[0-9]{3,6}(?:\1[0-9]{3,6}){1,3}"
    r"(?![0-9A-Za-z]|[._/,][0-9])"
)


def _has_card_number(text: str) -> bool:
    """Return True when ``text`` holds a Luhn-valid card number in a card layout."""
    for match in _OTHER_SEP_RUN.finditer(text):
        groups = match.group(0).split(match.group(1))
        if (all(3 <= len(g) <= 6 for g in groups[1:]) and all(len(g) >= 4 for g in groups[1:-1])
                and _card_number_ok("".join(groups))):
            return True
    for match in _DIGIT_RUN.finditer(text):
        if _RUN_END_BLOCKER.match(text, match.end()):
            continue
        groups = re.split(r"[ -]", match.group(0))
        for group in groups:
            if _card_number_ok(group):
                return True
        for start, first in enumerate(groups):
            if len(first) != 4:
                continue
            collected = first
            for position in range(start + 1, len(groups)):
                group = groups[position]
                if not 3 <= len(group) <= 6:
                    break
                collected += group
                if len(collected) > 19:
                    break
                if _card_number_ok(collected):
                    return True
                if len(group) < 4:
                    break  # a 3-digit group can only be the last one
    return False


_CVV: Final = re.compile(
    r"(?:(?<![A-Za-z0-9])(?:cvv2?|cvc2?|cvn)(?![A-Za-z0-9])\s*(?:code|number)?|安全码)"
    r"\s*(?:(?:is|was)(?![A-Za-z0-9])\s*[:=]?|[:=是为])?\s*[0-9]{3,4}(?![0-9])",
    re.IGNORECASE,
)

# --------------------------------------------------------------------------- keys and tokens

_PREFIXED: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    (re.compile(r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"), "private_key"),
    (re.compile(r"(?<![A-Za-z0-9])[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"), "api_key"),
    (re.compile(r"(?<![A-Za-z0-9])pk_live_[A-Za-z0-9]{10,}"), "api_key"),
    (re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Za-z])"), "api_key"),
    (re.compile(r"(?<![A-Za-z0-9_-])AIza[0-9A-Za-z_-]{35}"), "api_key"),
    (re.compile(r"(?<![A-Za-z0-9])gh[pousr]_[A-Za-z0-9]{20,}"), "token"),
    (re.compile(r"(?<![A-Za-z0-9])github_pat_[A-Za-z0-9_]{20,}"), "token"),
    (re.compile(r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}"), "token"),
    (
        re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"),
        "token",
    ),
)

# "sk-" keys need a digit or an upper-case letter, so "sk-learn-style-..." prose passes.
_SK_DASH: Final = re.compile(r"(?<![A-Za-z0-9_-])sk-([A-Za-z0-9_-]{20,})")
_BEARER: Final = re.compile(r"(?<![A-Za-z0-9])bearer\s+([A-Za-z0-9._~+/=-]{20,})", re.IGNORECASE)

_SEP_EN: Final = r"\s*(?:(?:is|was)(?![A-Za-z0-9])\s*[:=]?|[:=]|[是为][:：]?)\s*"
_SEP_OPT: Final = r"\s*(?:(?:is|was)(?![A-Za-z0-9])\s*[:=]?|[:=]|[是为][:：]?)?\s*"

_KEYWORD_SECRETS: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    (
        re.compile(
            r"(?<![A-Za-z0-9])(?:api[ _-]?(?:key|secret)|secret[ _-]?(?:access[ _-]?)?key"
            r"|client[ _-]?secret|access[ _-]?key(?:[ _-]?id)?|secret)(?![A-Za-z0-9])"
            + _SEP_EN
            + r"[\"']?([A-Za-z0-9_/+=-]{16,})",
            re.IGNORECASE,
        ),
        "api_key",
    ),
    (re.compile(r"(?:API\s*)?(?:密钥|秘钥)" + _SEP_EN + r"[\"']?([A-Za-z0-9_-]{16,})"), "api_key"),
    (
        re.compile(
            r"(?<![A-Za-z0-9])(?:(?:access|refresh|auth|id|session|bearer)[ _-]?)?token"
            r"(?![A-Za-z0-9])" + _SEP_EN + r"[\"']?([A-Za-z0-9_-]{16,})",
            re.IGNORECASE,
        ),
        "token",
    ),
    (re.compile(r"令牌" + _SEP_EN + r"[\"']?([A-Za-z0-9_-]{16,})"), "token"),
)


def _looks_random(value: str) -> bool:
    """Return True when a candidate key mixes digits or letter cases like a real key."""
    has_digit = any(ch.isdigit() for ch in value)
    has_upper = any("A" <= ch <= "Z" for ch in value)
    has_lower = any("a" <= ch <= "z" for ch in value)
    return has_digit or (has_upper and has_lower)


def _key_or_token_kind(text: str) -> str | None:
    """Return "api_key", "token" or "private_key" for the first credential in ``text``."""
    for pattern, kind in _PREFIXED:
        if pattern.search(text):
            return kind
    for match in _SK_DASH.finditer(text):
        if any(ch.isdigit() or "A" <= ch <= "Z" for ch in match.group(1)):
            return "api_key"
    for match in _BEARER.finditer(text):
        if re.search(r"[^a-z]", match.group(1)):
            return "token"
    for pattern, kind in _KEYWORD_SECRETS:
        for match in pattern.finditer(text):
            if _looks_random(match.group(1)):
                return kind
    return None


# --------------------------------------------------------------------------- one-time codes

_CODE_DIGITS: Final = r"(?:[0-9]{4,8}|[0-9]{3}[ -][0-9]{3})(?![0-9]|[-/:.][0-9])"

_OTP_PATTERNS: Final[tuple[re.Pattern[str], ...]] = (
    # "verification code 4821", "one-time code: 123456", "2-step code is 123 456"
    re.compile(
        r"(?<![A-Za-z0-9])(?:verification|verify|security|log[ -]?in|sign[ -]?in"
        r"|auth(?:entication|enticator|orization)?|sms|text|access|one[ -]?time"
        r"|2[ -]?step|two[ -]?(?:step|factor)|2fa|mfa|otp|totp)"
        r"[ -]+(?:code|passcode|password|pin)(?![A-Za-z0-9])" + _SEP_OPT + _CODE_DIGITS,
        re.IGNORECASE,
    ),
    # "OTP 123456", "2FA: 123456", "TOTP is 123456"
    re.compile(
        r"(?<![A-Za-z0-9])(?:otp|totp|2fa|mfa)(?![A-Za-z0-9])" + _SEP_OPT + _CODE_DIGITS,
        re.IGNORECASE,
    ),
    # 验证码是123456, 验证码：123456, 验证码 8421, 动态码, 校验码 ...
    re.compile(
        r"(?:验证码|校验码|动态码|动态密码|短信码|认证码|一次性密码|一次性口令)"
        r"\s*(?:[是为][:：]?|[:：])?\s*" + _CODE_DIGITS
    ),
)

# "code is 123456" / "code: 123456": a one-time code unless the word before
# "code" names an everyday code that is fine to remember.
_GENERIC_CODE: Final = re.compile(
    r"(?<![A-Za-z0-9])code(?![A-Za-z0-9])\s*(?:(?:is|was)(?![A-Za-z0-9])\s*[:=]?|[:=])\s*"
    + _CODE_DIGITS,
    re.IGNORECASE,
)
_WORD_BEFORE: Final = re.compile(r"([A-Za-z]+)[\s-]*\Z")
_ORDINARY_CODES: Final = frozenset(
    {
        "zip", "postal", "post", "area", "country", "dial", "dialing", "dialling",
        "calling", "phone", "error", "status", "exit", "return", "response", "http",
        "promo", "promotional", "coupon", "discount", "voucher", "gift", "referral",
        "invite", "invitation", "product", "item", "sku", "color", "colour", "source",
        "airport", "iata", "icao", "bank", "branch", "swift", "sort", "routing", "tax",
        "course", "class", "station", "stock", "ticker", "region", "city", "zone",
        "currency", "language", "locale", "reference", "ref", "tracking", "order",
        "booking", "reservation", "confirmation", "pickup", "parcel", "locker",
        "postcode", "diagnosis", "icd", "hs", "naics", "building", "room", "seat",
        "flight", "train", "model", "part", "series", "style", "dress", "qr", "bar",
        "barcode", "machine", "op", "shortcut", "key", "keyboard", "unicode", "ascii",
        "fare", "rate", "plan", "account",
    }
)  # fmt: skip


# The code first, as text messages put it: "482193 is your login code", "G-482193 is
# your Google verification code", "Your code: ..." is above. The word before "code"
# must not name an ordinary code ("482193 is your booking code").
_CODE_FIRST: Final = re.compile(
    r"(?<![0-9A-Za-z-])(?:[A-Z]{1,3}-)?[0-9]{4,8}(?![0-9])\s+is\s+your\s+"
    r"(?P<words>(?:[A-Za-z]+[\s-]+){0,3}?)(?:code|passcode|pin|otp|password)(?![A-Za-z0-9])",
    re.IGNORECASE,
)


def _has_one_time_code(text: str) -> bool:
    """Return True when ``text`` announces a one-time or verification code."""
    if any(pattern.search(text) for pattern in _OTP_PATTERNS):
        return True
    for match in _CODE_FIRST.finditer(text):
        words = match.group("words").split()
        if not words or words[-1].strip("-").lower() not in _ORDINARY_CODES:
            return True
    for match in _GENERIC_CODE.finditer(text):
        before = _WORD_BEFORE.search(text, max(0, match.start() - 40), match.start())
        if before is None or before.group(1).lower() not in _ORDINARY_CODES:
            return True
    return False


# --------------------------------------------------------------------------- passwords

_PASSWORD_EN: Final = re.compile(
    r"(?<![A-Za-z0-9])(?P<kw>pass(?:word|wd|code|phrase)|pwd|pw|pin)(?![A-Za-z0-9])"
    r"(?:(?P<is>\s*(?:is|was)(?![A-Za-z0-9])\s*[:=]?\s*)|(?P<sep>\s*[:=]\s*)|(?P<ws>\s+))"
    r"(?P<tok>\S{1,256})",
    re.IGNORECASE,
)
_PASSWORD_ZH: Final = re.compile(r"(?:密码|口令)\s*(?:[是为][:：]?|[:：])\s*(?P<tok>[!-~]{1,256})")
_DATE_OR_TIME: Final = re.compile(r"[0-9]{4}[-/.][0-9]{1,2}|[0-9]{1,2}:[0-9]{2}")
_EDGE_PUNCTUATION: Final = "\"'`“”‘’「」『』《》()[]{}<>.,;!?。，；！？、"
_MASK_CHARS: Final = frozenset("*•●·")
_NOT_A_PASSWORD: Final = frozenset(
    {
        "a", "an", "the", "is", "was", "not", "too", "very", "so", "and", "or", "but",
        "required", "needed", "necessary", "optional", "mandatory", "wrong", "incorrect",
        "invalid", "correct", "valid", "weak", "strong", "secure", "insecure", "expired",
        "missing", "empty", "blank", "none", "null", "nil", "n/a", "na", "unset", "set",
        "reset", "changed", "updated", "stored", "saved", "hashed", "encrypted",
        "protected", "hidden", "masked", "redacted", "long", "short", "same", "different",
        "case-sensitive", "sensitive", "manager", "managers", "policy", "field", "hint",
        "length", "strength", "rules", "requirements", "change", "update", "in", "on",
        "at", "of", "for", "to", "with", "from", "by", "still", "now", "being", "also",
        "my", "your", "their", "his", "her", "its", "our", "this", "that", "these",
        "those", "here", "there", "what", "which", "how", "where", "when", "why", "who",
        "it", "you", "me", "we", "they", "i", "if", "unknown", "known", "forgotten",
        "forgot", "lost", "compromised", "leaked", "please", "later", "again", "yet",
        "ok", "okay", "true", "false", "yes", "no", "tbd", "todo", "placeholder",
    }
)  # fmt: skip


def _password_token_ok(token: str, form: str, keyword: str) -> bool:
    """Return True when the token after a password keyword plausibly is the password.

    ``form`` is "is" (after "is"/"was"), "sep" (after ":" or "="), "ws" (after
    whitespace only) or "zh" (after 是/为/：).
    """
    clean = token.strip(_EDGE_PUNCTUATION)
    if not clean or not any("!" <= ch <= "~" for ch in clean):
        return False
    if clean.lower() in _NOT_A_PASSWORD or all(ch in _MASK_CHARS for ch in clean):
        return False
    if clean.isdigit() and len(clean) < 4:
        return False  # "password is 8 characters", "密码是6位数字"
    if keyword == "pin" and not clean.isdigit():
        return False  # "pin the note", "pin: top"; a PIN is digits
    if keyword == "pwd" and clean[0] in "/~$":
        return False  # "pwd: /home/me" is a working directory
    if form in ("is", "ws") and (len(clean) < 4 or _DATE_OR_TIME.match(clean)):
        return False
    if form == "is":
        return any(not "a" <= ch <= "z" for ch in clean)
    if form == "ws":
        return any(not ch.isalpha() for ch in clean)
    return True


def _has_password(text: str) -> bool:
    """Return True when ``text`` states a password, passcode or PIN."""
    for match in _PASSWORD_EN.finditer(text):
        form = "is" if match.group("is") is not None else "sep"
        if match.group("ws") is not None:
            form = "ws"
        keyword = match.group("kw").lower()
        if keyword == "pin" and form == "ws":
            continue  # "pin 1234" is too often a list or a reference number
        if keyword == "pw" and form == "ws":
            continue  # a bare "pw" is too short a word to trust without ":" or "is"
        if _password_token_ok(match.group("tok"), form, keyword):
            return True
    return any(
        _password_token_ok(match.group("tok"), "zh", "密码")
        for match in _PASSWORD_ZH.finditer(text)
    )


# --------------------------------------------------------------------------- text


# Decimal digits of other scripts (NFKC leaves them as they are): Arabic-Indic,
# Extended Arabic-Indic, NKo, Devanagari and the other Indic scripts, Thai, Lao,
# Tibetan, Myanmar, Khmer, Mongolian. Each block holds 0..9 in order.
_DIGIT_BLOCKS: Final = (
    0x0660, 0x06F0, 0x07C0, 0x0966, 0x09E6, 0x0A66, 0x0AE6, 0x0B66, 0x0BE6, 0x0C66,
    0x0CE6, 0x0D66, 0x0DE6, 0x0E50, 0x0ED0, 0x0F20, 0x1040, 0x1090, 0x17E0, 0x1810,
)  # fmt: skip
_FOLD: Final[dict[int, str | None]] = {
    **{start + d: str(d) for start in _DIGIT_BLOCKS for d in range(10)},
    # Invisible characters that split a number without showing: zero-width space,
    # non-joiner, joiner, word joiner, BOM, soft hyphen.
    **dict.fromkeys((0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF, 0x00AD), None),
}
_SPACES_BETWEEN_DIGITS: Final = re.compile(r"(?<=[0-9])[ \t]{2,}(?=[0-9])")


def _fold(text: str) -> str:
    """NFKC, other scripts' digits as ASCII, invisible characters dropped, and runs of
    spaces between digits made one: what a reader sees, in the form the rules match."""
    folded = unicodedata.normalize("NFKC", text)
    if not folded.isascii():
        folded = folded.translate(_FOLD)
    if "  " in folded or "\t" in folded:
        folded = _SPACES_BETWEEN_DIGITS.sub(" ", folded)
    return folded


_MAY_HOLD_SHORT: Final = re.compile(r"[\s:=]")

#: A card number needs 13 digits in one group (`_DIGIT_RUN` alone), or a group of 4
#: digits, a separator and a group of 3 or more (a grouped run, `_DIGIT_RUN` after
#: folding spaces between digits, or `_OTHER_SEP_RUN`); the group starts a run or
#: follows a separator, so no letter, digit or `_+./` comes before it.
_CARD_DIGITS: Final = r"(?<![0-9A-Za-z_+./])[0-9]{4}(?:[0-9]{9}|[ \t._/,-]+[0-9]{3})"
#: What every rule above needs, loosened: a text (folded) in which this finds nothing
#: matches no rule, so the rules are skipped. Each alternative is a part that a rule's
#: match must contain, with the same case sensitivity and the same left boundary where
#: the rule has one: the literal prefixes of `_PREFIXED` and `_SK_DASH`; "bearer" and
#: the CVV words; a keyword of `_KEYWORD_SECRETS` followed later by a 16-character run of
#: its value's characters; the words every one-time-code and password rule is built
#: around ("code", "pass...", "pw...", "pin", "otp", "2fa", "mfa", 码, 口令); "://" of
#: URL credentials; and `_CARD_DIGITS`. NUL never occurs in a scanned string
#: (validation refuses it first), so several strings joined by NUL can be searched in
#: one pass (`may_hold_secret`): `[^\x00]` keeps a keyword and its value in one string.
#: `tests/ledger/test_secret_prefilter.py` checks, for generated texts, that the rules
#: find nothing where this finds nothing.
_MAY_HOLD_SECRET: Final = re.compile(
    r"-----BEGIN|k_(?:live|test)_|AKIA|ASIA|AIza|gh[pousr]_|github_pat_|xox[abposr]-|eyJ|sk-"
    r"|(?i:bearer|cvv|cvc|cvn)"
    r"|(?i:key|secret|token)[^\x00]*?[A-Za-z0-9_/+=-]{16}"
    r"|(?:密钥|秘钥|令牌)[^\x00]*?[A-Za-z0-9_-]{16}"
    r"|(?<![A-Za-z0-9])(?i:code|pass|pw|pin|t?otp|2fa|mfa)"
    r"|码|口令|://|" + _CARD_DIGITS
)
_CARD_START: Final = re.compile(_CARD_DIGITS)
#: A looser, faster first pass for ASCII text: lowered, it contains one of these words
#: (`_MAY_HOLD_SECRET`'s literal parts, lowered, without boundaries or values), or it
#: holds `_CARD_DIGITS`. Substring tests run at memory speed; an alternation of these
#: words in one regex is ten times slower.
_ROUGH_WORDS: Final = (
    "key", "code", "pass", "pw", "pin", "otp", "2fa", "mfa", "token", "secret", "://",
    "sk-", "eyj", "bearer", "cvv", "cvc", "cvn", "akia", "asia", "aiza", "ghp_", "gho_",
    "ghu_", "ghs_", "ghr_", "github_pat_", "xox", "k_live_", "k_test_", "-----begin",
)


def _may_hold(folded: str) -> bool:
    """False when no rule can match `folded` (NUL-free strings joined by NUL allowed)."""
    if folded.isascii():
        low = folded.lower()
        for word in _ROUGH_WORDS:
            if word in low:
                break
        else:
            if _CARD_START.search(folded) is None:
                return False
    return _MAY_HOLD_SECRET.search(folded) is not None


def may_hold_secret(texts: Sequence[str]) -> bool:
    """False when no text of `texts` can hold a secret by `find_secret_in_text`'s rules
    (one regex pass over all of them); True means "maybe": ask `find_secret_in_text`.

    The texts must not contain NUL (validation refuses it before scanning).
    """
    joined = "\x00".join(texts)
    if not joined.isascii():
        joined = "\x00".join(t if t.isascii() else _fold(t) for t in texts)
    return _may_hold(joined)


def find_secret_in_text(text: str) -> str | None:
    """Return the kind of secret that ``text`` appears to contain, or None.

    The kind is one of "private_key", "api_key", "token", "payment_card",
    "one_time_code" or "password"; when several apply, the first in that order
    wins. Full-width characters are folded (NFKC) before matching, so
    "４１１１ …" and "密码：x" are seen like their ASCII forms.
    """
    if not text or (len(text) < 13 and text.isascii() and _MAY_HOLD_SHORT.search(text) is None):
        # Every rule needs 13+ characters, or a separator (space, ":", "=") between a
        # word and a value, or non-ASCII text: short plain identifiers are skipped fast.
        return None
    folded = _fold(text)
    if not _may_hold(folded):
        return None
    return _secret_kind_of_folded(folded)


def _secret_kind_of_folded(folded: str) -> str | None:
    """Every rule of `find_secret_in_text`, on text already folded (no prefilter)."""
    kind = _key_or_token_kind(folded)
    if kind is not None:
        return kind
    if _has_card_number(folded) or _CVV.search(folded):
        return "payment_card"
    if _has_one_time_code(folded):
        return "one_time_code"
    if _has_password(folded) or _URL_CREDENTIALS.search(folded):
        return "password"
    return None


# "postgres://admin:S3cret@host", "https://user:pw@example.com/": a password inside a URL.
_URL_CREDENTIALS: Final = re.compile(
    r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:(?P<pw>[^\s/@*]+)@[^\s@]"
)


# --------------------------------------------------------------------------- JSON values

_SECRET_KEYS: Final[dict[str, str]] = {
    **dict.fromkeys(
        ("password", "passwd", "pwd", "passcode", "passphrase", "pin", "pincode",
         "密码", "口令", "支付密码"),
        "password",
    ),
    **dict.fromkeys(
        ("secret", "apikey", "apisecret", "secretkey", "clientsecret", "accesskey",
         "secretaccesskey", "密钥", "秘钥"),
        "api_key",
    ),
    **dict.fromkeys(
        ("token", "accesstoken", "refreshtoken", "authtoken", "idtoken", "sessiontoken",
         "bearertoken", "令牌"),
        "token",
    ),
    **dict.fromkeys(
        ("otp", "totp", "onetimecode", "onetimepassword", "verificationcode", "smscode",
         "2facode", "mfacode", "验证码", "校验码", "动态码"),
        "one_time_code",
    ),
    **dict.fromkeys(
        ("cvv", "cvv2", "cvc", "cvc2", "cardnumber", "cardno", "creditcard",
         "creditcardnumber", "卡号", "银行卡号", "信用卡号"),
        "payment_card",
    ),
    **dict.fromkeys(("privatekey",), "private_key"),
}  # fmt: skip

_SIMPLE_KEY: Final = re.compile(r"[^\s.\[\]\"']+")
_REDACTED_KEY: Final = "<redacted>"


#: A key whose last word is one of these names a secret: "user_pass", "db_password",
#: "smtpPw", "session_token", "login_pin". Only the last word counts, so "pin_note",
#: "token_count" and "password_policy" describe a secret without holding one.
_SECRET_LAST_WORDS: Final[dict[str, str]] = {
    **dict.fromkeys(("pass", "password", "passwd", "pwd", "pw", "passcode", "passphrase",
                     "pin"), "password"),
    **dict.fromkeys(("secret", "apikey"), "api_key"),
    **dict.fromkeys(("token",), "token"),
    **dict.fromkeys(("otp", "totp"), "one_time_code"),
    **dict.fromkeys(("cvv", "cvc"), "payment_card"),
}  # fmt: skip


@lru_cache(maxsize=4096)
def secret_key_kind(key: str) -> str | None:
    """Return the kind of secret a dict key names, ignoring case and separators (cached:
    the same few keys recur in every event)."""
    camel_split = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key)
    normal = unicodedata.normalize("NFKC", camel_split)
    compact = re.sub(r"[\s_-]+", "", normal).lower()
    kind = _SECRET_KEYS.get(compact)
    if kind is None:
        words = re.split(r"[\s_.:-]+", normal.strip(" _.:-").lower())
        kind = _SECRET_LAST_WORDS.get(words[-1]) if len(words) > 1 else None
    return kind


def _scalar_kind(value: object) -> str | None:
    """Return the kind of secret a scalar JSON value looks like, or None."""
    if isinstance(value, str):
        return find_secret_in_text(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    magnitude = abs(value)
    if 10**12 <= magnitude < 10**19 and _card_number_ok(str(magnitude)):
        return "payment_card"
    return None


def _holds_value(value: object) -> bool:
    """Return True when a value under a secret-named key is a non-empty, unmasked scalar."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, str):
        stripped = value.strip()
        if not stripped or all(ch in _MASK_CHARS for ch in stripped):
            return False
        return stripped.lower() not in {"redacted", "[redacted]", "<redacted>", "n/a", "none"}
    return isinstance(value, int | float)


def _child_path(path: str, segment: str) -> str:
    """Return ``path`` extended by a dict key, quoting keys that are not simple names."""
    if _SIMPLE_KEY.fullmatch(segment) is None:
        segment = "[" + json.dumps(segment, ensure_ascii=False) + "]"
        return path + segment
    return f"{path}.{segment}" if path else segment


def find_secrets(value: object, path: str) -> list[SecretFinding]:
    """Return every place in a JSON value that looks like a secret, in document order.

    ``path`` names ``value`` itself; nested places extend it with ``.key`` for
    object members and ``[i]`` for list items. Strings (including object keys)
    are checked with :func:`find_secret_in_text`, integers of 13..19 digits
    with the card rules, and keys that name a secret (``password``, ``api_key``,
    ``access_token``, ``otp``, ``cvv``, ``card_number``, ``private_key`` ...)
    are reported when they hold a non-empty scalar. A key that itself holds a
    secret is shown as ``<redacted key>``, so paths never echo secret text.
    Values of other types are ignored and the function never raises on them.
    """
    findings: list[SecretFinding] = []
    # Work items are either a finding to emit or (value, path, ids of the
    # containers above it); the ids guard against self-referencing containers.
    stack: list[SecretFinding | tuple[object, str, frozenset[int]]] = [(value, path, frozenset())]
    while stack:
        item = stack.pop()
        if isinstance(item, SecretFinding):
            findings.append(item)
            continue
        current, where, above = item
        if isinstance(current, Mapping | list | tuple):
            if id(current) in above:
                continue
            inside = above | {id(current)}
            children: list[SecretFinding | tuple[object, str, frozenset[int]]] = []
            if isinstance(current, Mapping):
                for key, child in current.items():
                    children.extend(_member_work(key, child, where, inside))
            else:
                children.extend(
                    (element, f"{where}[{index}]", inside) for index, element in enumerate(current)
                )
            stack.extend(reversed(children))
            continue
        kind = _scalar_kind(current)
        if kind is not None:
            findings.append(SecretFinding(kind, where))
    return findings


def _member_work(
    key: object, child: object, where: str, inside: frozenset[int]
) -> list[SecretFinding | tuple[object, str, frozenset[int]]]:
    """Return the work for one object member: findings about its key, then its value."""
    key_kind = _scalar_kind(key)
    if key_kind is not None:
        child_where = _child_path(where, _REDACTED_KEY)
        return [SecretFinding(key_kind, child_where), (child, child_where, inside)]
    key_text = key if isinstance(key, str) else str(key)
    child_where = _child_path(where, key_text)
    named_kind = secret_key_kind(key_text)
    if named_kind is not None and _holds_value(child):
        return [SecretFinding(named_kind, child_where)]
    return [(child, child_where, inside)]
