"""API keys of the HTTP API: created by the operator, stored as a keyed hash only.

A key is `mlk_<key_id>_<secret>`. The `api_keys` table keeps the public `key_id`, what
the key stands for (one principal `TENANT/USER`, a tenant's service, or the operator)
and the HMAC-SHA256 of the whole key. The HMAC's key (the pepper) is
`MEMLEDGER_API_KEY_PEPPER` when set, else a random one kept in the `meta` table, so a
copy of `api_keys` alone verifies no guess. The key itself is shown once, by
`create_key`, and never stored or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import schema as t
from ledger.errors import ValidationError
from ledger.records import now_iso
from ledger.store import Store

PREFIX: Final = "mlk_"
KINDS: Final = ("principal", "tenant", "operator")
PEPPER_ENV: Final = "MEMLEDGER_API_KEY_PEPPER"
_PEPPER_META: Final = "api_key_pepper"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What a key stands for; never the key or its digest."""

    key_id: str
    kind: str  # principal | tenant | operator
    tenant: str | None
    user: str | None
    label: str | None
    created_at: str
    revoked_at: str | None = None

    @property
    def revoked(self) -> bool:
        """True once the operator revoked the key."""
        return self.revoked_at is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form `memledger keys list` prints."""
        return {"key_id": self.key_id, "kind": self.kind, "tenant": self.tenant,
                "user": self.user, "label": self.label, "created_at": self.created_at,
                "revoked_at": self.revoked_at}


def _info(r: Any) -> KeyInfo:
    return KeyInfo(r.key_id, r.kind, r.tenant, r.user_id, r.label, r.created_at,
                   r.revoked_at)


def _check_name(field: str, value: str | None) -> None:
    if value is None or not value or "/" in value or any(ord(c) < 32 for c in value):
        raise ValidationError(field, "must be a non-empty name without '/' or control "
                                     "characters")


async def _pepper(conn: AsyncConnection, *, create: bool) -> bytes | None:
    env = os.environ.get(PEPPER_ENV)
    if env:
        return env.encode()
    row = (await conn.execute(select(t.meta.c.value).where(
        t.meta.c.name == _PEPPER_META))).first()
    if row is not None:
        return bytes.fromhex(row[0])
    if not create:
        return None
    pepper = secrets.token_bytes(32)
    await conn.execute(t.meta.insert().values(name=_PEPPER_META, value=pepper.hex()))
    return pepper


def _digest(pepper: bytes, key: str) -> str:
    return hmac.new(pepper, key.encode(), hashlib.sha256).hexdigest()


def _split(key: str) -> str | None:
    """The key_id of a well-formed key, else None."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX):].partition("_")
    if not sep or not key_id or not secret or len(key_id) > 32:
        return None
    return key_id


async def create_key(store: Store, kind: str, *, tenant: str | None = None,
                     user: str | None = None, label: str | None = None
                     ) -> tuple[str, KeyInfo]:
    """Create a key; returns the key (show it once) and what it stands for.

    `principal` needs `tenant` and `user`, `tenant` needs `tenant`, `operator` neither.
    """
    if kind not in KINDS:
        raise ValidationError("kind", f"must be one of {', '.join(KINDS)}")
    if kind in ("principal", "tenant"):
        _check_name("tenant", tenant)
    if kind == "principal":
        _check_name("user", user)
    if kind == "operator" and (tenant is not None or user is not None):
        raise ValidationError("kind", "an operator key names no tenant or user")
    if kind == "tenant" and user is not None:
        raise ValidationError("user", "a tenant service key names no user")
    await store.open()
    key_id = secrets.token_hex(8)
    key = f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    info = KeyInfo(key_id, kind, tenant, user, label, now_iso())
    async with store.write() as conn:
        pepper = await _pepper(conn, create=True)
        assert pepper is not None
        await conn.execute(t.api_keys.insert().values(
            key_id=key_id, digest=_digest(pepper, key), kind=kind, tenant=tenant,
            user_id=user, label=label, created_at=info.created_at, revoked_at=None))
    return key, info


async def list_keys(store: Store) -> list[KeyInfo]:
    """Every key, revoked ones included, oldest first."""
    await store.open()
    async with store.read() as conn:
        rows = (await conn.execute(select(t.api_keys).order_by(
            t.api_keys.c.created_at, t.api_keys.c.key_id))).all()
    return [_info(r) for r in rows]


async def revoke_key(store: Store, key_id: str) -> KeyInfo | None:
    """Revoke a key (effective for the next request); None if there is no such key."""
    await store.open()
    async with store.write() as conn:
        ak = t.api_keys.c
        await conn.execute(update(t.api_keys).where(
            ak.key_id == key_id, ak.revoked_at.is_(None)).values(revoked_at=now_iso()))
        row = (await conn.execute(select(t.api_keys).where(ak.key_id == key_id))).first()
    return _info(row) if row is not None else None


async def authenticate(store: Store, key: str) -> KeyInfo | None:
    """What a presented key stands for, or None (unknown, malformed or revoked)."""
    key_id = _split(key)
    if key_id is None:
        return None
    # One statement (the key's row and the stored secret) on a connection without an
    # explicit transaction: every HTTP request pays for this check, and on SQLite each
    # statement, BEGIN and COMMIT is a round trip to the driver's thread.
    stored = select(t.meta.c.value).where(t.meta.c.name == _PEPPER_META).scalar_subquery()
    async with store.read_once() as conn:
        row = (await conn.execute(select(t.api_keys, stored.label("stored_pepper")).where(
            t.api_keys.c.key_id == key_id))).first()
    if row is None or row.revoked_at is not None:
        return None
    env = os.environ.get(PEPPER_ENV)
    pepper = env.encode() if env else (
        bytes.fromhex(row.stored_pepper) if row.stored_pepper is not None else None)
    if pepper is None:
        return None
    if not hmac.compare_digest(row.digest, _digest(pepper, key)):
        return None
    return _info(row)
