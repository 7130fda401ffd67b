"""A trace (design.md "Trace files") → one explorer page.

`build_payload` gathers what the page draws (the trace, next tokens, stream wiring, RMS pre-
vs post-norm, FlashAttention walks, costs, calculations); `render_html` writes the page, all
inlined for a saved file, linking /static/ for the server. The data block is \\u-escaped and
the script pinned by its hash: docs/viewer.md#safety.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import html
import itertools
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import UserError
from ..probes import stream_wiring
from ..text.labels import token_label
from ..tracing.stream import stream_rms
from ..tracing.tiles import head_walk
from ..tracing.trace import expert_of
from .families import families_part

STATIC = Path(__file__).parent / "static"
# The page's scripts in the order they run: glass.js first (its helpers, as window.Glass), then
# each view that lives in a file of its own and registers with Glass.view.
VIEW_SCRIPTS = ("glass.js", "tokenizer.js", "generated.js", "training.js", "layout.js", "heads.js", "map.js", "tour.js",
                "families.js", "research.js")
STYLES = ("glass.css", "tour.css")  # the page's style sheets, in order
FEATURE_CAP = 8  # numbers shown per vector (per head); glass.js uses the same cap
TOP_K = 5  # next-token candidates shown per position
EXPLAIN_LIMIT = 1200  # calculations stored in a saved page at most
PAGE_LIMIT = 5_000_000  # bytes a saved page may take (issue 23); write_html trims to fit
BIG_VOCAB = 64  # above this, logits/probs leave the embedded trace (the top-k stay)

Explainer = Callable[[str, list[int]], Any]  # (probe, index) -> calculation


# ----------------------------------------------------------------------------- data


def _finite(x: Any) -> Any:
    """Replace NaN/±inf by None everywhere: JSON has no spelling for them."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def to_plain(obj: Any) -> Any:
    """An explain/cost result as plain JSON data (dicts, dataclasses, objects with to_dict)."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        obj = obj.to_dict()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy / torch scalars and arrays
        return obj.tolist()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    return [x / s for x in e]


def next_tokens(trace: dict, pieces: Callable[[int], str] | None = None, k: int = TOP_K) -> list[list[dict]]:
    """Per position, the k most probable next tokens: id, piece, label (text.labels.token_label:
    what the page draws), logit, prob.

    Reads `logits` (with `logsumexp` when the trace kept only the top entries, whose ids
    are in `index.vocab`, one list per token) and `probs` when present.
    """
    probes = trace.get("probes", {})
    lg, pr = probes.get("logits"), probes.get("probs")
    src = lg or pr
    if src is None:
        return []
    vocab = (src.get("index") or {}).get("vocab")
    lse = (lg or {}).get("logsumexp")
    out = []
    for t in range(len(trace["tokens"])):
        logits = lg["data"][t] if lg else None
        ids = vocab[t] if vocab else None
        if pr is not None:
            probs = pr["data"][t]
        elif lse is not None:
            probs = [math.exp(x - lse[t]) for x in logits]
        else:
            probs = _softmax(logits)
        order = sorted(range(len(probs)), key=lambda i: -probs[i])[:k]
        row = []
        for i in order:
            tid = ids[i] if ids else i
            piece = pieces(tid) if pieces else f"#{tid}"
            row.append({"id": tid, "piece": str(piece), "label": token_label(str(piece)), "prob": probs[i],
                        "logit": None if logits is None else logits[i]})
        out.append(row)
    return out


def token_labels(tokens: Iterable) -> list[str]:
    """What the page draws for each token: its text with whitespace made visible (the page
    keeps the raw tokens too, e.g. for the sentence box)."""
    return [token_label(str(t)) for t in tokens]


def cost_rows(costs: dict, about: str | None = None) -> dict:
    """A cost report (nested dict of numbers) → rows the page lists, nested keys joined by '.'."""
    rows: list[dict] = []

    def walk(prefix: str, d: Any) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(d, (int, float, str, bool)) or d is None:
            rows.append({"key": prefix, "value": d})

    walk("", to_plain(costs))
    return {"rows": rows, "about": about}


# ----------------------------------------------------------------------------- calculations


def _vector_indices(data, prefix: list[int]) -> Iterator[list[int]]:
    """Indices of the numbers the page shows for one token's entry of a probe (capped per vector)."""
    if data and isinstance(data[0], list):
        for h, sub in enumerate(data):
            yield from _vector_indices(sub, prefix + [h])
    else:
        for f in range(min(len(data), FEATURE_CAP)):
            yield prefix + [f]


_BLOCK = ["attn_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rot", "attn.k_rot",
          "attn.sink_weight", "attn.z", "attn.out", "attn_post_norm", "resid_mid", "ffn_norm", "ffn.router_probs",
          "ffn.expert_weights", "ffn.up", "ffn.gate", "ffn.act", "ffn.down", "ffn_post_norm", "resid_out"]


def _model_index(entry: dict, idx: list[int]) -> list[int]:
    """A stored index as the model's index: axes kept in part (--heads) list their ids in `index`."""
    sub = entry.get("index") or {}
    out = []
    for axis, i in zip(entry.get("axes", []), idx):
        ids = sub.get(axis)
        if ids and isinstance(ids[0], list):  # one list per token (top-k vocab)
            ids = ids[idx[0]]
        out.append(ids[i] if ids else i)
    return out


def shown_numbers(trace: dict, focus: int, nxt: list[list[dict]]) -> Iterator[tuple[str, list[int]]]:
    """The (probe, model index) of every clickable number the page draws, the focus token's first."""
    T = len(trace["tokens"])
    layers = trace.get("layers") or range(trace["config"]["n_layers"])
    order = [focus] + [t for t in range(T) if t != focus]
    names = ["embed"] + [f"blocks.{i}.{leaf}" for i in layers for leaf in _BLOCK] + ["final_norm"]
    probes = trace["probes"]
    for t in order:
        for name in names:
            if name in probes:
                e = probes[name]
                yield from ((name, _model_index(e, idx)) for idx in _vector_indices(e["data"][t], [t]))
        for i in layers:
            e = probes.get(f"blocks.{i}.attn.weights")
            if e is None:
                continue
            for h, row in enumerate(e["data"][t]):
                for j, x in enumerate(row):
                    if x is not None:
                        yield f"blocks.{i}.attn.weights", _model_index(e, [t, h, j])
                        if t in (focus, T - 1):  # the decode and FlashAttention views show these rows' scores
                            yield f"blocks.{i}.attn.scores", _model_index(e, [t, h, j])
        if t < len(nxt):
            for c in nxt[t]:
                yield "probs", [t, c["id"]]
                yield "logits", [t, c["id"]]


def rms_operands(norm: dict | None) -> Iterator[tuple[str, list[int]]]:
    """(probe, index) of the stream numbers that the comparison's RMS calculations link to."""
    for rows in ((norm or {}).get("calc") or {}).values():
        for row in rows:
            for calc in row:
                for st in calc.get("steps", []):
                    for term in st.get("terms") or []:
                        for o in term:
                            if o.get("source") == "probe":
                                yield o["name"], o["index"]


def precompute_explain(trace: dict, explain: Explainer, numbers: Iterable[tuple[str, list[int]]],
                       limit: int = EXPLAIN_LIMIT) -> tuple[dict[str, Any], int]:
    """{'probe|i,j,k': calculation} for the first `limit` numbers; also how many were left out."""
    out: dict[str, Any] = {}
    skipped = 0
    for name, idx in numbers:
        key = f"{name}|{','.join(map(str, idx))}"
        if key in out:
            continue
        if len(out) >= limit:
            skipped += 1
            continue
        try:
            out[key] = to_plain(explain(name, list(idx)))
        except (KeyError, IndexError, ValueError, NotImplementedError, UserError):
            continue  # a number explain does not cover: the page says so when clicked
    return out, skipped


# ----------------------------------------------------------------------------- the payload


def build_payload(
    trace: Any,
    *,
    mode: str = "static",
    sentence: str | None = None,
    model_name: str | None = None,
    pieces: Callable[[int], str] | None = None,
    explain: Explainer | None = None,
    explain_limit: int = EXPLAIN_LIMIT,
    costs: dict | None = None,
    norm: dict | None = None,
    vocab: list[str] | None = None,
    focus_token: int | None = None,
    flash_tile: int | None = None,
    flash: dict | None = None,
    notes: list[str] | None = None,
    slim: bool = False,
    sampling: dict | None = None,
    tokenizer: dict | None = None,
    generated: dict | None = None,
    tour: dict | None = None,
) -> dict:
    """Everything the page draws, as one JSON-ready dict.

    mode: 'static' (calculations precomputed for the numbers shown) or 'server' (the page asks
    /api/explain). slim: only the first FEATURE_CAP features of the FFN's wide probes. explain:
    `explain(probe, index)` for this trace; norm: source.norm_table's output; costs: `cost_rows`;
    flash: source.flash_walks's output. The page reads the stream's probes from `wiring` and
    draws each token as its `labels` entry (text.labels.token_label: ␣ for a space, ↵ for a newline).
    sampling: a saved page's grid of sampling answers (source.sample_grid); tokenizer: the
    tokenizer view's steps for the sentence (source.tokenizer_view); generated: the generated-text
    view's data (viewer/generated.generated_part), None for a sentence that was not generated;
    tour: the guided walk's numbers that the trace does not hold (viewer/tour.tour_part).
    """
    trace = _checked_trace(trace, mode)
    T = len(trace["tokens"])
    focus = T - 1 if focus_token is None else max(0, min(int(focus_token), T - 1))
    nxt = next_tokens(trace, pieces)
    notes = list(notes or [])
    explained: dict[str, Any] = {}
    left = 0
    if explain is not None and mode == "static":
        numbers = itertools.chain(shown_numbers(trace, focus, nxt), rms_operands(norm))
        explained, left = precompute_explain(trace, explain, numbers, explain_limit)
        if left:
            notes.append(_stored_text(len(explained), left))
    cfg = trace["config"]
    # Trace files hold no NaN (masked cells are null); the rest is small, so cleaning it is cheap.
    return {"trace": _shown_trace(trace, slim), **_finite({
        "format": "glassformer-explorer", "version": 1, "mode": mode,
        "sentence": sentence if sentence is not None else " ".join(map(str, trace["tokens"])),
        "model_name": model_name, "labels": token_labels(trace["tokens"]), "next": nxt, "explain": explained,
        "explain_left": left,
        "costs": None if costs is None else (costs if "rows" in costs else cost_rows(costs)),
        "norm": norm, "vocab": vocab, "focus_token": focus, "flash_tile": flash_tile, "notes": notes,
        "wiring": stream_wiring(int(cfg["n_layers"]), cfg["norm_placement"], cfg.get("ffn", "swiglu")),
        "rms": lane_rms(trace),
        "flash": _with_traced_tiles(trace, flash), "sampling": sampling, "tokenizer": tokenizer,
        "generated": generated, "tour": tour, "families": families_part(trace),  # families.js draws the last
    })}


def _checked_trace(trace: Any, mode: str) -> dict:
    """The trace as its dict (a Trace is converted), checked to be one."""
    if hasattr(trace, "to_dict"):  # a glassformer.trace.Trace
        trace = trace.to_dict()
    if mode not in ("static", "server"):
        raise ValueError(f"mode must be 'static' or 'server', got {mode!r}")
    for key in ("tokens", "config", "probes"):
        if key not in trace:
            raise ValueError(f"not a trace: the key {key!r} is missing (see docs/trace-format.md)")
    return trace


def _shown_trace(trace: dict, slim: bool) -> dict:
    """The part of the trace the page draws."""
    # Full logits of a real vocabulary are most of a trace's size and the page draws only
    # the top few per position, which `next` already holds.
    # Weight matrices feed `explain` (whose results are stored already), not the drawing.
    shown = {k: v for k, v in trace.items() if k not in ("weights", "analysis")}
    # An expert's own probes (blocks.i.ffn.experts.e.*, its routed tokens only) are k times a dense
    # feed-forward's numbers and are not drawn: the page shows the routes and each slot's output, and
    # a calculation that reads an expert's numbers carries them in its operands.
    shown["probes"] = {k: v for k, v in trace["probes"].items()
                       if not (k in ("logits", "probs") and v["data"] and len(v["data"][0]) > BIG_VOCAB)
                       and expert_of(k) is None}
    if slim:
        for name, entry in list(shown["probes"].items()):
            if name.endswith((".ffn.up", ".ffn.gate", ".ffn.act", ".ffn.shared.up", ".ffn.shared.gate", ".ffn.shared.act")) \
                    and entry["shape"][-1] > FEATURE_CAP:
                shown["probes"][name] = {**entry, "data": [row[:FEATURE_CAP] for row in entry["data"]], "cut": True}
    if not shown.get("positions"):
        shown["positions"] = list(range(len(trace["tokens"])))
    return shown


def lane_rms(trace: dict) -> dict[str, list[float]]:
    """{probe: RMS of each token's vector} (tracing.stream.stream_rms) of the (token, feature)
    probes the page's lanes draw: the stream and what each branch adds to it."""
    out = {}
    for name, e in trace["probes"].items():
        if e.get("axes") == ["token", "feature"] and name not in ("logits", "probs") and not e.get("cut") \
                and "token" not in (e.get("index") or {}):  # an expert's rows are its routed tokens, not every token
            out[name] = stream_rms(torch.tensor(e["data"], dtype=torch.float64)).tolist()
    return out


def flash_key(layer: int, head: int, row: int, tile: int) -> str:
    """The key of one tile walk in the page's data (glass.js builds the same string)."""
    return f"{layer}|{head}|{row}|{tile}"


def _with_traced_tiles(trace: dict, flash: dict | None) -> dict:
    """`flash` ({'tiles': [...], 'walks': {key: walk}}, and 'fetch' where a live page asks for
    more) plus the walks of the trace's own tile logs (`blocks.i.attn.tiles`, run by the tiled
    kernel while tracing)."""
    out = {**(flash or {}), "tiles": list((flash or {}).get("tiles") or []),
           "walks": dict((flash or {}).get("walks") or {}), "left_out": (flash or {}).get("left_out", 0)}
    for name, e in trace["probes"].items():
        if name.endswith(".attn.tiles"):
            layer = int(name.split(".")[1])
            sink = trace["probes"].get(f"blocks.{layer}.attn.sink_weight")  # attention sinks: the row's share
            for j, head in enumerate(e["heads"]):
                tiles = {**e, "steps": e["data"]}
                out["walks"].setdefault(flash_key(layer, head, e["query"], e["tile_size"]),
                                        head_walk(tiles, head, None if sink is None else sink["data"][e["query"]][j]))
            if e["tile_size"] not in out["tiles"]:
                out["tiles"] = sorted(out["tiles"] + [e["tile_size"]])
    return out


# ----------------------------------------------------------------------------- the page


def json_for_html(data: Any) -> str:
    """JSON that is safe inside <script type="application/json">: no `<`, `>`, `&` or line
    separators appear literally, so no string in the data can end the block."""
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except ValueError:  # a NaN somewhere: JSON has no spelling for it
        text = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def static_file(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def render_html(payload: dict, *, inline: bool = True, title: str | None = None) -> str:
    """The page. inline=True: one self-contained file; False: links each of STYLES and
    VIEW_SCRIPTS under /static/."""
    css = "\n".join(static_file(name) for name in STYLES)
    js = "\n".join(static_file(name) for name in VIEW_SCRIPTS)
    if inline:
        js_hash = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
        csp = (f"default-src 'none'; script-src 'sha256-{js_hash}'; style-src 'unsafe-inline'; "
               "img-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'")
        style, script = f"<style>\n{css}</style>", f"<script>{js}</script>"
    else:
        csp = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src data:; "
               "connect-src 'self'; base-uri 'none'; form-action 'none'")
        style = "".join(f'<link rel="stylesheet" href="static/{name}">' for name in STYLES)
        script = "".join(f'<script src="static/{name}"></script>' for name in VIEW_SCRIPTS)
    if title is None:
        title = f"glassformer · {payload.get('sentence', '')}"
    page = static_file("page.html")
    # The data goes in last: it cannot contain '@@' placeholders that a later replace would hit.
    for key, value in (("@@CSP@@", csp), ("@@TITLE@@", html.escape(title)), ("@@STYLE@@", style), ("@@SCRIPT@@", script)):
        page = page.replace(key, value)
    return page.replace("@@DATA@@", json_for_html(payload))


def _stored_text(kept: int, left: int) -> str:
    """A saved page's note on how many calculations it stores."""
    return f"This file stores the calculations of {kept} numbers; {left} more are computed live by `glassformer view`."


def _stored_note(payload: dict, left: int) -> None:
    """The note again, after fit_page dropped some calculations."""
    notes = [n for n in payload["notes"] if not n.startswith(_stored_text(0, 0).split(" 0 ")[0])]
    payload["notes"] = notes + ([_stored_text(len(payload["explain"]), left)] if left else [])


def fit_page(payload: dict, limit: int = PAGE_LIMIT) -> str:
    """The inline page of `payload`, at most `limit` bytes of UTF-8.

    A long sentence on a big model stores more than a file should hold; what goes first is what a
    live page computes on a click anyway: the stored calculations, last-listed first (the focus
    token's come first), then the FlashAttention walks of rows other than the focus row's.
    The page's note says how many calculations it keeps.
    """
    page = render_html(payload, inline=True)
    excess = len(page.encode("utf-8")) - limit
    if excess <= 0:
        return page
    explained = payload["explain"]
    left = int(payload.get("explain_left") or 0)
    for key in reversed(list(explained)):
        if excess <= 0:
            break
        excess -= len(json_for_html(explained.pop(key)).encode("utf-8")) + len(key) + 4
        left += 1
    walks = payload["flash"].get("walks") or {}
    focus = int(payload.get("focus_token") or 0)
    for key in [k for k in walks if int(k.split("|")[2]) != focus]:
        if excess <= 0:
            break
        excess -= len(json_for_html(walks.pop(key)).encode("utf-8")) + len(key) + 4
        payload["flash"]["left_out"] = payload["flash"].get("left_out", 0) + 1
    payload["explain_left"] = left
    _stored_note(payload, left)
    page = render_html(payload, inline=True)
    if len(page.encode("utf-8")) > limit:
        raise UserError(f"the page needs {len(page.encode('utf-8')) / 1e6:.1f} MB even without its stored calculations, "
                        f"over the {limit / 1e6:.0f} MB a saved page may take: give a shorter text")
    return page


def write_html(path: str | Path, trace: dict, **payload_args: Any) -> Path:
    """Write the self-contained page for `trace` to `path` (see build_payload for the options)."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"the page is HTML: give a file name ending in .html, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload_args.setdefault("slim", True)  # the page shows 8 features of the FFN's wide probes
    page = fit_page(build_payload(trace, mode="static", **payload_args))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
