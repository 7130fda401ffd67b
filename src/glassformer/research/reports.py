"""The answers `patch --json`, `attribute --json` and the explorer's POST /api/patch and
/api/attribute give: texts and tokens checked (one line each), the routine run, and its result with
the tokens it was read from."""

from __future__ import annotations

from ..errors import UserError
from .attribution import check_model, direct_logit_attribution
from .patching import METHODS, SITES, check_site, patch_sweep
from .tokens import encode, pieces, same_length, token_id

SERVER_TOKENS = 256  # the longest text the explorer sweeps: an exact sweep costs layers × T forwards of T tokens
PATCH_FIELDS = ("clean", "corrupt", "answer", "wrong", "site", "method")
ATTRIBUTE_FIELDS = ("text", "answer", "wrong", "position")


def check_names(site: str, method: str) -> None:
    """Refuse an unknown site or method before any model is read."""
    if site not in SITES:
        raise UserError(f"unknown site {site!r}: the sites are {', '.join(SITES)}")
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}: the methods are {', '.join(METHODS)}")


def _token(tokenizer, model, text: str, flag: str) -> dict:
    i = token_id(tokenizer, text, flag, model.config.vocab_size)
    return {"id": i, "token": pieces(tokenizer, [i])[0]}


def patch_report(model, tokenizer, clean: str, corrupt: str, answer: str, wrong: str, site: str = "resid_pre",
                 method: str = "exact", batch: int | None = None, max_tokens: int | None = None, prefix: str = "") -> dict:
    """The sweep's to_dict with the texts' tokens and the answer and wrong tokens. prefix: what the
    errors put before a field's name ('--' for the CLI's flags)."""
    check_names(site, method)
    check_site(model.config, site)
    limit = model.config.max_seq_len if max_tokens is None else min(max_tokens, model.config.max_seq_len)
    ids = {k: encode(tokenizer, text, prefix + k, limit) for k, text in (("clean", clean), ("corrupt", corrupt))}
    a, w = _token(tokenizer, model, answer, prefix + "answer"), _token(tokenizer, model, wrong, prefix + "wrong")
    same_length(tokenizer, ids["clean"], ids["corrupt"])
    out = patch_sweep(model, ids["clean"], ids["corrupt"], a["id"], w["id"], site, method, batch).to_dict()
    out.update(clean_tokens=pieces(tokenizer, ids["clean"]), corrupt_tokens=pieces(tokenizer, ids["corrupt"]),
               answer=a, wrong=w)
    return out


def attribute_report(model, tokenizer, text: str, answer: str, wrong: str, position: int = -1, prefix: str = "") -> dict:
    """direct_logit_attribution's answer with the text's tokens and the answer and wrong tokens."""
    check_model(model)
    ids = encode(tokenizer, text, prefix + "text", model.config.max_seq_len)
    a, w = _token(tokenizer, model, answer, prefix + "answer"), _token(tokenizer, model, wrong, prefix + "wrong")
    out = direct_logit_attribution(model, ids, a["id"], w["id"], position)
    out.update(tokens=pieces(tokenizer, ids), answer=a, wrong=w)
    return out


def research_answer(model, tokenizer, kind: str, req: dict) -> dict:
    """The explorer's answer to a POST /api/patch (kind 'patch') or /api/attribute ('attribute'):
    known fields only, each of the right type."""
    fields = PATCH_FIELDS if kind == "patch" else ATTRIBUTE_FIELDS
    unknown = sorted(set(req) - set(fields))
    if unknown:
        raise UserError(f"{kind} takes {', '.join(fields)}; unknown field {unknown[0]!r}")
    for k in fields:
        v = req.get(k)
        if k == "position":
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool)):
                raise UserError(f"position must be an integer, got {v!r}")
        elif v is not None and not isinstance(v, str):
            raise UserError(f"{k} must be a string, got {v!r}")
    need = [k for k in fields if k not in ("site", "method", "position") and not req.get(k)]
    if need:
        raise UserError(f"{kind} needs {', '.join(need)}")
    if kind == "patch":
        return patch_report(model, tokenizer, req["clean"], req["corrupt"], req["answer"], req["wrong"],
                            req.get("site") or "resid_pre", req.get("method") or "exact", max_tokens=SERVER_TOKENS)
    position = req.get("position")
    return attribute_report(model, tokenizer, req["text"], req["answer"], req["wrong"], -1 if position is None else position)
