"""Tests for secret detection (R23): credentials and card data never enter memory."""

from __future__ import annotations

import dataclasses
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.secrets import SecretFinding, find_secret_in_text, find_secrets, luhn_valid

# --------------------------------------------------------------------------- Luhn


@pytest.mark.parametrize(
    "digits",
    [
        "4111111111111111",
        "5500005555555559",
        "378282246310005",
        "79927398713",
        "4111-1111-1111 1111",
    ],
)
def test_luhn_accepts_valid_numbers(digits: str) -> None:
    """R23: the Luhn checksum accepts known-valid numbers, ignoring spaces and dashes."""
    assert luhn_valid(digits)


@pytest.mark.parametrize("digits", ["4111111111111112", "1234567812345678", "", "41a1", "４１１１"])
def test_luhn_rejects_invalid_or_non_digit_input(digits: str) -> None:
    """R23: the Luhn checksum rejects wrong check digits, empty and non-ASCII-digit input."""
    assert not luhn_valid(digits)


# --------------------------------------------------------------------------- positive cases

CARD_TEXTS = [
    "4111 1111 1111 1111",
    "4111-1111-1111-1111",
    "5500005555555559",
    "pay with card 4111111111111111 please",
    "Amex 3782 822463 10005 expires 12/28",
    "card 4111 1111 1111 1111 cvv 123 on file",
    "4222222222222",
    "CVV 123",
    "cvc: 4567",
    "我的卡号是4111111111111111",
    "银行卡号：6011 1111 1111 1117，有效期 12/28",
    "信用卡 ４１１１ １１１１ １１１１ １１１１",
    "卡的安全码是 123",
]

PASSWORD_TEXTS = [
    "password is hunter2",
    "my password is Sunshine",
    "password: hunter",
    "Password = correct-horse-battery",
    "pwd=abc",
    "passwd s3cret!",
    "my password Hunter2!",
    "export DB_PASSWORD=xyz",
    "the wifi passphrase is Tr0ub4dor",
    "PIN: 1234",
    "my pin is 9876",
    "密码是abc123",
    "密码：hunter2",
    "密码为 12345678",
    "家里WiFi密码是 12345678",
    "支付密码:135790",
]

API_KEY_TEXTS = [
    "sk-abcdefghijklmnopqrstu12345",
    "OPENAI_API_KEY=sk-proj-AbCdEfGhIjKlMnOpQrStUv",
    "sk_live_abcdefghij12",
    "use sk_test_4eC39HqLyjWDarjtT1zdp7dc for staging",
    "pk_live_abcdefghij12",
    "AKIAIOSFODNN7EXAMPLE",
    "AIzaSyA-1234567890abcdefghijklmnopqrstu",
    "api key is AbCdEf1234567890xyz",
    "API_KEY: 0123456789abcdef0123",
    "client secret = f3a9c2b7e1d4a6c8b0e2",
    "API密钥：abcd1234efgh5678ijkl",
    "我的密钥是 Zx81kQ0pLm27Ty55Rv",
]

TOKEN_TEXTS = [
    "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
    "gho_16C7e42F292c6912E7710c838347Ae178B4a",
    "xoxb-1234567890-abcdefghij",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "Authorization: Bearer abcdef1234567890abcdef",
    "token: abcd1234efgh5678ijkl",
    "refresh_token=Qm9vZ2llV29vZ2llMTIzNDU2",
    "令牌：abcd1234efgh5678ijkl",
]

PRIVATE_KEY_TEXTS = [
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
    "-----BEGIN OPENSSH PRIVATE KEY-----",
    "-----BEGIN PRIVATE KEY-----",
    "-----BEGIN PGP PRIVATE KEY BLOCK-----",
]

OTP_TEXTS = [
    "code is 123456",
    "Your code: 839201",
    "verification code 4821",
    "Your verification code is 004821.",
    "OTP 123456",
    "otp: 12345678",
    "your one-time code: 839201",
    "one time password 551234",
    "2FA code 123 456",
    "login code is 9911",
    "验证码是123456",
    "验证码：123456",
    "验证码 8421",
    "您的验证码为：123456，5分钟内有效",
    "动态码 123456",
    "校验码为5678",
    "短信验证码是 246810",
]

_ALL_POSITIVE = (
    [(text, "payment_card") for text in CARD_TEXTS]
    + [(text, "password") for text in PASSWORD_TEXTS]
    + [(text, "api_key") for text in API_KEY_TEXTS]
    + [(text, "token") for text in TOKEN_TEXTS]
    + [(text, "private_key") for text in PRIVATE_KEY_TEXTS]
    + [(text, "one_time_code") for text in OTP_TEXTS]
)


@pytest.mark.parametrize(("text", "kind"), _ALL_POSITIVE)
def test_secret_text_is_detected_with_its_kind(text: str, kind: str) -> None:
    """R23: each kind of secret, in English and Chinese, is detected and classified."""
    assert find_secret_in_text(text) == kind


# --------------------------------------------------------------------------- negative cases

ORDINARY_TEXTS = [
    "",
    "order A123",
    "ticket T900",
    "prefer Python",
    "User prefers Python over Java",
    "2026-09-20",
    "2026-09-20T10:30:00Z",
    "meeting at 2026-09-20 10:30:00+08:00",
    "phone 138 0013 8000",
    "phone +86 138 0013 8000",
    "call 13800138000 or 139-0013-9000",
    "order 482913",
    "订单号 482913",
    "order number 482913 shipped",
    "¥1299",
    "price ¥1,299.00, 2 items",
    "请用简体中文回复",
    "用户喜欢喝咖啡，不加糖",
    "会议时间：2026年9月20日 10:30",
    "4111111111111112",
    "1234 5678 9012 3456",
    "ts 1758326400000",
    "snowflake id 1789012345678901234",
    "barcode 6901234567892",
    "身份证号 310105199001010229",
    "IBAN DE89 3704 0044 0532 0130 00",
    "uuid 550e8400-e29b-41d4-a716-446655440000",
    "version 1.2.3 released",
    "pi is 3.1415926535897932",
    "password is required",
    "Password Is Required",
    "the password is case-sensitive",
    "password is 8 characters long",
    "I forgot my password yesterday",
    "use a password manager",
    "reset password link sent",
    "password: ********",
    "密码是什么？",
    "密码是6位数字",
    "密码：******",
    "密码学是一门学科",
    "run pwd to see the directory",
    "pin the note to the top",
    "my pin is 2",
    "the secret is out",
    "token: short",
    "max tokens: 4096",
    "bearer of good news",
    "sk-learn-style-pipeline-rocks",
    "zip code is 100080",
    "area code: 0755",
    "error code is 5001",
    "hotel confirmation code is 839201",
    "取件码 1234",
    "邮编 100080",
    "the code is clean",
    "room 1203, floor 12",
]


@pytest.mark.parametrize("text", ORDINARY_TEXTS)
def test_ordinary_memory_text_is_not_a_secret(text: str) -> None:
    """R23: dates, phones, prices, order numbers and ordinary prose are not flagged."""
    assert find_secret_in_text(text) is None


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize(("text", "kind"), _ALL_POSITIVE)
def test_message_never_echoes_the_secret(text: str, kind: str) -> None:
    """R23: the rejection message names the place and kind but never the secret itself."""
    findings = find_secrets({"note": text}, "data")
    assert findings == [SecretFinding(kind, "data.note")]
    message = findings[0].describe()
    assert "data.note" in message
    assert "R23" in message
    assert text not in message
    digits = "".join(ch for ch in text if ch.isdigit())
    if len(digits) >= 4:
        assert digits not in "".join(ch for ch in message if ch.isdigit())


def test_describe_matches_documented_wording() -> None:
    """R23: describe() explains what was found and what to do instead."""
    finding = SecretFinding("payment_card", "data.value.card")
    assert finding.describe() == (
        "data.value.card looks like a payment card number; secrets never enter the ledger "
        "(R23): remove it or store a reference instead"
    )


@pytest.mark.parametrize(
    "kind", ["payment_card", "password", "api_key", "token", "one_time_code", "private_key"]
)
def test_every_kind_has_a_readable_description(kind: str) -> None:
    """R23: every finding kind produces a sentence that names the path and the rule."""
    message = SecretFinding(kind, "data.text").describe()
    assert message.startswith("data.text looks like ")
    assert "secrets never enter the ledger (R23)" in message


def test_finding_is_immutable() -> None:
    """R23: a finding is a frozen value, so it cannot be altered after detection."""
    finding = SecretFinding("password", "data.text")
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.kind = "token"  # type: ignore[misc]


# --------------------------------------------------------------------------- JSON walking


def test_nested_object_path_is_reported() -> None:
    """R23: a secret inside an object is reported at the caller's path plus the key."""
    findings = find_secrets({"card": "4111 1111 1111 1111"}, "data.value")
    assert findings == [SecretFinding("payment_card", "data.value.card")]


def test_list_indexes_are_reported_in_brackets() -> None:
    """R23: a secret inside a list is reported with its index as "[i]"."""
    value = {"items": ["fine", {"note": "验证码是123456"}], "tags": ["密码：hunter2"]}
    assert find_secrets(value, "data.value") == [
        SecretFinding("one_time_code", "data.value.items[1].note"),
        SecretFinding("password", "data.value.tags[0]"),
    ]


def test_top_level_string_uses_the_given_path() -> None:
    """R23: a bare string is reported at exactly the path the caller passed."""
    assert find_secrets("password is hunter2", "data.text") == [
        SecretFinding("password", "data.text")
    ]
    assert find_secrets(["x", "OTP 123456"], "data.list") == [
        SecretFinding("one_time_code", "data.list[1]")
    ]


def test_clean_values_have_no_findings() -> None:
    """R23: ordinary memory payloads pass without findings."""
    value = {
        "text": "用户偏好：请用简体中文回复",
        "order": "A123",
        "date": "2026-09-20",
        "phone": "138 0013 8000",
        "price": 1299,
        "ts": 1758326400000,
        "ratio": 0.5,
        "pinned": True,
        "token_count": 512,
        "max_tokens": 4096,
        "tags": ["prefer Python", None, False],
    }
    assert find_secrets(value, "data") == []


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("password", "password"),
        ("Password", "password"),
        ("passwd", "password"),
        ("pwd", "password"),
        ("PIN", "password"),
        ("secret", "api_key"),
        ("api_key", "api_key"),
        ("apikey", "api_key"),
        ("API-Key", "api_key"),
        ("apiKey", "api_key"),
        ("access_token", "token"),
        ("refresh-token", "token"),
        ("Refresh Token", "token"),
        ("accessToken", "token"),
        ("token", "token"),
        ("otp", "one_time_code"),
        ("one_time_code", "one_time_code"),
        ("verification-code", "one_time_code"),
        ("cvv", "payment_card"),
        ("CVC", "payment_card"),
        ("card_number", "payment_card"),
        ("private_key", "private_key"),
        ("密码", "password"),
        ("验证码", "one_time_code"),
    ],
)
def test_secret_named_keys_are_caught(key: str, kind: str) -> None:
    """R23: keys that name a secret are rejected when they hold a non-empty scalar."""
    expected_path = f'data.login["{key}"]' if " " in key else f"data.login.{key}"
    assert find_secrets({"login": {key: "x"}}, "data") == [SecretFinding(kind, expected_path)]


@pytest.mark.parametrize("held", [123, 4.5, "abc"])
def test_secret_named_key_with_any_scalar_is_caught(held: object) -> None:
    """R23: numbers and strings under a secret-named key are both caught."""
    assert find_secrets({"cvv": held}, "data") == [SecretFinding("payment_card", "data.cvv")]


@pytest.mark.parametrize("held", ["", "   ", None, True, False, "********", {}, []])
def test_secret_named_key_without_a_value_is_allowed(held: object) -> None:
    """R23: empty, masked, null and boolean values under secret-named keys are not secrets."""
    assert find_secrets({"password": held, "pin": held}, "data") == []


def test_secret_named_key_holding_an_object_is_walked() -> None:
    """R23: a container under a secret-named key is walked like any other value."""
    value = {"password": {"hint": "first pet", "value": "密码是abc123"}}
    assert find_secrets(value, "data") == [SecretFinding("password", "data.password.value")]


def test_keys_that_only_contain_secret_words_are_allowed() -> None:
    """R23: keys like token_count or password_policy are not secret names."""
    value = {"token_count": 12, "password_policy": "min 12 chars", "tokens": 99, "pin_note": 1}
    assert find_secrets(value, "data") == []


@pytest.mark.parametrize("number", [4111111111111111, 5500005555555559, -4111111111111111])
def test_card_number_integers_are_caught(number: int) -> None:
    """R23: integers of 13..19 digits that are Luhn-valid card numbers are caught."""
    assert find_secrets({"n": number}, "data") == [SecretFinding("payment_card", "data.n")]
    assert find_secrets(number, "data.value") == [SecretFinding("payment_card", "data.value")]


@pytest.mark.parametrize(
    "number", [4111111111111112, 1758326400000, 1758326400000000000, 123456, 10**30, 0]
)
def test_other_integers_are_allowed(number: int) -> None:
    """R23: non-Luhn numbers, timestamps, short and huge integers are not cards."""
    assert find_secrets({"n": number}, "data") == []


def test_booleans_and_floats_are_not_cards() -> None:
    """R23: booleans and floats are never read as card numbers."""
    assert find_secrets([True, 4111111111111111.0, 0.4111111111111111], "data") == []


def test_secret_in_a_key_is_redacted_from_the_path() -> None:
    """R23: a key that is itself a secret is reported without echoing it in the path."""
    value = {"4111 1111 1111 1111": {"note": "password is hunter2"}}
    findings = find_secrets(value, "data")
    assert findings == [
        SecretFinding("payment_card", "data.<redacted>"),
        SecretFinding("password", "data.<redacted>.note"),
    ]
    for finding in findings:
        assert "4111" not in finding.describe()
        assert "hunter2" not in finding.describe()


def test_findings_follow_document_order() -> None:
    """R23: several findings are listed in the order they appear in the value."""
    value = {
        "a": [{"b": "OTP 123456"}],
        "password": "hunter2",
        "c": {"d": 4111111111111111},
        "e": "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    }
    assert [finding.path for finding in find_secrets(value, "data")] == [
        "data.a[0].b",
        "data.password",
        "data.c.d",
        "data.e",
    ]


def test_unusual_keys_are_quoted_in_the_path() -> None:
    """R23: keys with dots or spaces are quoted so the reported path stays unambiguous."""
    assert find_secrets({"my card": "4111111111111111"}, "data") == [
        SecretFinding("payment_card", 'data["my card"]')
    ]


def test_self_referencing_container_does_not_loop() -> None:
    """R23: a list that contains itself is walked once instead of looping forever."""
    looped: list[object] = ["password is hunter2"]
    looped.append(looped)
    assert find_secrets(looped, "data") == [SecretFinding("password", "data[0]")]


# --------------------------------------------------------------------------- properties

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5)
    ),
    max_leaves=40,
)


@given(value=_json_values, path=st.text(max_size=10))
def test_find_secrets_never_raises_on_json_values(value: object, path: str) -> None:
    """R23: any JSON-like value is walked without raising and yields well-formed findings."""
    findings = find_secrets(value, path)
    kinds = {"payment_card", "password", "api_key", "token", "one_time_code", "private_key"}
    for finding in findings:
        assert finding.kind in kinds
        assert finding.path.startswith(path)
        assert finding.describe()


_words = st.one_of(
    st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=12),
    st.sampled_from(
        [
            "password", "passwd", "pwd", "passcode", "pin", "my", "is", "was", "token",
            "secret", "api", "key", "apikey", "code", "otp", "verification", "one",
            "time", "bearer", "sk", "card", "cvv", "access", "refresh", "the",
        ]
    ),
)  # fmt: skip


@given(words=st.lists(_words, min_size=1, max_size=30))
def test_plain_lowercase_words_have_no_findings(words: list[str]) -> None:
    """R23: text made only of lowercase ASCII words and spaces is never a secret."""
    text = " ".join(words)
    assert find_secret_in_text(text) is None
    assert find_secrets({"text": text}, "data") == []
