"""The server commands: `serve` (the HTTP API) and `keys` (its API keys).

`memledger keys create --principal T/U | --tenant T | --operator` prints the new key
once, as JSON; only its keyed hash is stored (`ledger.keys`). `serve` needs the
`server` extra (FastAPI and uvicorn, docs/http.md).
"""

from __future__ import annotations

import argparse

from ledger import keys
from ledger.errors import ValidationError
from memledger.cli.common import REDIS_HELP, Audience, handles, open_store, out, say

TITLE = "server commands (the HTTP API and its keys)"


async def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the HTTP API until stopped."""
    try:
        import uvicorn

        from memledger.server import Settings, create_app
    except ImportError as e:
        say(f"error: the HTTP API needs the server extra: pip install 'memledger[server]' "
            f"({e.name} is missing)")
        return 1
    if args.rate_limit < 0 or args.max_body < 1 or args.max_batch < 1:
        say("error: --rate-limit must be >= 0, --max-body and --max-batch >= 1")
        return 2
    app = create_app(Settings(db_url=args.db, register_path=args.forget_register,
                              broker=args.redis, rate_limit=args.rate_limit,
                              burst=args.burst or max(1, int(args.rate_limit * 2)),
                              max_body=args.max_body, max_batch=args.max_batch,
                              max_lag=args.max_lag))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    say(f"memledger serving on http://{args.host}:{args.port} (OpenAPI: /openapi.json)")
    await server.serve()
    return 0


async def cmd_keys_create(args: argparse.Namespace) -> int:
    """Create an API key and print it once."""
    tenant = user = None
    if args.principal is not None:
        kind = "principal"
        tenant, sep, user = args.principal.partition("/")
        if not sep or "/" in user:
            raise ValidationError("principal", f"{args.principal!r} is not TENANT/USER")
    elif args.tenant is not None:
        kind, tenant = "tenant", args.tenant
    else:
        kind = "operator"
    store = open_store(args)
    try:
        key, info = await keys.create_key(store, kind, tenant=tenant, user=user,
                                          label=args.label)
    finally:
        await store.close()
    out({"key": key, **info.to_dict()})
    say("the key is shown only this once: store it now")
    return 0


async def cmd_keys_list(args: argparse.Namespace) -> int:
    """List every key (never the key itself)."""
    store = open_store(args)
    try:
        listed = await keys.list_keys(store)
    finally:
        await store.close()
    out({"keys": [k.to_dict() for k in listed if args.all or not k.revoked]})
    return 0


async def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """Revoke a key by its id; exit 1 if there is no such key."""
    store = open_store(args)
    try:
        info = await keys.revoke_key(store, args.key_id)
    finally:
        await store.close()
    if info is None:
        say(f"error: no key {args.key_id!r}")
        out({"error": f"no key {args.key_id!r}"})
        return 1
    out(info.to_dict())
    return 0


def add_commands(aud: Audience) -> None:
    """Add the server commands."""
    s = aud.command("serve", "the HTTP API (needs memledger[server]); /openapi.json, "
                             "/healthz, /metrics", cmd_serve)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--redis", default=None,
                   help=f"publish ?wait=false writes to this broker; {REDIS_HELP}")
    s.add_argument("--rate-limit", type=float, default=50.0,
                   help="requests per second per key (default 50; 0: no limit)")
    s.add_argument("--burst", type=int, default=None,
                   help="requests a key may send at once (default twice the rate)")
    s.add_argument("--max-body", type=int, default=1 << 20,
                   help="largest request body in bytes (default 1 MiB)")
    s.add_argument("--max-batch", type=int, default=1000,
                   help="most events in one POST /v1/events (default 1000)")
    s.add_argument("--max-lag", type=int, default=10_000,
                   help="/readyz fails when a projection lags more events than this")

    k = aud.command("keys", "API keys of the HTTP API: create, list, revoke")
    actions = k.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = handles(actions.add_parser("create", help="create a key and print it once"),
                cmd_keys_create, {"principal": "--principal", "tenant": "--tenant",
                                  "user": "--principal"})
    who = c.add_mutually_exclusive_group(required=True)
    who.add_argument("--principal", metavar="TENANT/USER", help="one user's key")
    who.add_argument("--tenant", help="a tenant's service key (POST /v1/events)")
    who.add_argument("--operator", action="store_true", help="the operator's key")
    c.add_argument("--label", help="a note to tell keys apart in `keys list`")
    ls = handles(actions.add_parser("list", help="every key's id and identity, never the "
                                                 "key"), cmd_keys_list)
    ls.add_argument("--all", action="store_true", help="include revoked keys")
    rv = handles(actions.add_parser("revoke", help="revoke a key by its id"),
                 cmd_keys_revoke)
    rv.add_argument("key_id")
