"""POST bodies are JSON, and must say so: `Content-Type: application/json` (415 otherwise).

Why a server that parses the body as JSON anyway insists on the header: a browser sends a POST
whose type is `text/plain`, `application/x-www-form-urlencoded` or `multipart/form-data` from any
web page without asking the server first (a CORS "simple request"), so any site the user visits
could make a loopback server compute for it. A POST that says `application/json` needs a CORS
preflight, which these servers answer only for the origins they were told to allow.
"""

from __future__ import annotations

JSON_TYPE = "application/json"


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (parameters such as a charset allowed).

    >>> [is_json(t) for t in ("application/json", "Application/JSON; charset=utf-8", "text/plain", None, "")]
    [True, True, False, False, False]
    """
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == JSON_TYPE


def not_json(content_type: str | None) -> str:
    """The one-line error for a body of another type (answered with 415).

    >>> not_json("text/plain;charset=UTF-8")
    "send the body as JSON with the header 'Content-Type: application/json' (got 'text/plain')"
    """
    got = "no Content-Type" if not content_type else repr(content_type.split(";", 1)[0].strip()[:40])
    return f"send the body as JSON with the header 'Content-Type: {JSON_TYPE}' (got {got})"
