"""Who may reach a server verb (`serve`, `view`): its API key, the non-loopback rule and the Host
names it answers besides loopback's, as flags both verbs share (docs/serve.md#safety)."""

from __future__ import annotations

KEY_ENV = "GLASSFORMER_API_KEY"


def add_access_arguments(p) -> None:
    """--api-key, --insecure-no-key and --allowed-host (the caller adds its own --host)."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require the key on every route but /health: 'Authorization: Bearer KEY', or in a browser "
                        f"the cookie got by opening /?key=KEY once (default: the {KEY_ENV} environment variable, if set)")
    p.add_argument("--insecure-no-key", action="store_true",
                   help="listen on a non-loopback --host without an API key (anyone who can reach it may use it)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeatable; default: only localhost, "
                        "127.0.0.0/8 and ::1 on a loopback --host, any name on another)")


def api_key(args) -> str | None:
    """--api-key, else the environment's key; a non-loopback bind without one refuses to start."""
    import os

    from ..errors import UserError
    from ..serve.http import is_loopback

    key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
    if key is not None and not key.strip():
        raise UserError("--api-key is empty: give a key, or leave the flag out")
    if key is None and not is_loopback(args.host) and not args.insecure_no_key:
        raise UserError(f"--host {args.host} lets other machines reach the server: give --api-key KEY (or set "
                        f"{KEY_ENV}), or --insecure-no-key to serve without one")
    return key


def allowed_hosts(args) -> tuple[str, ...]:
    """--allowed-host's names, each checked (UserError for one that is no host name, or has a port)."""
    from ..serve.http import allowed_host

    return tuple(allowed_host(name) for name in args.allowed_host)
