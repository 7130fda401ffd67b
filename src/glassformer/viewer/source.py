"""Where the page's data comes from: a model and a tokenizer, traced with `glassformer.trace`.

`page_args(model, tokenizer, text)` traces one sentence and gathers everything the page
draws besides the trace (the pre-norm vs post-norm comparison, costs, next-token pieces,
the calculations of the numbers shown); `explorer(...)` wraps the same for the server
(`LiveParts`: what a live page asks for later);
`worked_*` do it for the walkthrough's toy model.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..explaining.explain import explain, explain_rms
from ..generation.sampling_stages import sampling_stages, stage_outputs
from ..generation.sampling import check_sampling
from ..generation.session import cache_length, prefill
from ..kv_cache import KVCache
from ..text.bpe_steps import bpe_steps
from ..text.labels import token_label
from ..tracing.analysis import norm_rms
from ..tracing.format import FORMAT, FORMAT_VERSION, _tiles_json, as_trace, json_ready
from ..tracing.interventions import logit_lens_top
from ..tracing.stream import PLACEMENTS, placement_twins
from ..tracing.tiles import head_walks, kernel_log
from ..tracing.trace import score_inputs, trace
from ..worked import model as worked
from .cost_calc import cost_calcs
from .heads import averaged_weights, info as heads_info, kind as heads_kind, pooled_model
from .generated import EXPLAIN_LIMIT, check_max_tokens, full_logits, generated_part, new_tokens
from .render import cost_rows, flash_key, to_plain, write_html
from .sample_calc import probability_calcs, stage_calcs
from ..research.reports import research_answer
from .server import GENERATE_TOKENS, Explorer
from .tour import tour_part
from .training import RunCheckpoints, run_name

TOP_K = 10  # logits kept per token in a trace for the page (the page shows 5)


def flash_tile(T: int) -> int:
    """A tile size that gives the FlashAttention view a few tiles to walk: about T/4, at least 2."""
    return max(2, 2 ** round(math.log2(max(T, 1) / 4))) if T > 1 else 1


def tokens_of(tokenizer, ids: list[int]) -> list[str]:
    return [str(tokenizer.id_to_piece(i)) for i in ids]


def encode(tokenizer, text: str, max_len: int) -> tuple[list[int], list[str]]:
    """ids and token strings of `text`, checked against the model's context."""
    if not text.strip():
        raise UserError("the sentence is empty: type a few words")
    try:
        ids = list(tokenizer.encode(text))
    except UserError:
        raise
    except Exception as e:  # e.g. a word-level vocabulary without an unknown-word token
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the model's tokenizer cannot read this sentence ({msg}): use words it knows") from None
    if not ids:
        raise UserError("the sentence gives no tokens: type a few words")
    if len(ids) > max_len:
        raise UserError(f"the sentence is {len(ids)} tokens; this model reads at most {max_len}: shorten it")
    return ids, tokens_of(tokenizer, ids)


def trace_for_page(model, ids: list[int], tokens: list[str], focus: int | None = None, with_weights: bool = False):
    """The trace the page draws: every layer and head, the top logits, and the tiled kernel's
    own log for the focus row (default the last token) at the page's tile size."""
    cfg = model.config
    old_tile = cfg.attention_tile
    cfg.attention_tile = flash_tile(len(ids))
    try:
        top_k = TOP_K if cfg.vocab_size > TOP_K else None
        return trace(model, ids, tokens=tokens, top_k=top_k, with_weights=with_weights, attention="tiled",
                     query=len(ids) - 1 if focus is None else focus)
    finally:
        cfg.attention_tile = old_tile


def _rounded(t, decimals: int):
    """Nested lists of `t` rounded to `decimals` places, NaN/±inf as None (vectorised: the
    server's answer must be quick, and short numbers keep it small; the page shows 3)."""
    x = torch.round(t.detach().double(), decimals=decimals)
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return x.tolist()

    def fix(a, ok):  # masked attention cells: null, as in the trace file
        return [fix(u, v) for u, v in zip(a, ok)] if isinstance(a, list) else (a if ok else None)

    return fix(x.tolist(), finite.tolist())


def page_dict(tr, decimals: int = 6) -> dict:
    """A Trace as the dict its file holds (docs/trace-format.md), built straight from the
    tensors for the server's answers; weights are left out (the page never draws them)."""
    probes = {}
    for name, p in tr.probes.items():
        entry = {"shape": list(p.data.shape), "axes": p.axes}
        if p.index:
            entry["index"] = p.index
        entry.update(json_ready(p.extra))
        entry["data"] = _rounded(p.data, decimals)
        probes[name] = entry
    for i, t in tr.tiles.items():
        probes[f"blocks.{i}.attn.tiles"] = json_ready(_tiles_json(t))
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "tokens": tr.tokens, "ids": tr.ids,
            "positions": tr.positions, "config": tr.config, "rope_inv_freq": tr.rope_inv_freq, "layers": tr.layers,
            "heads": tr.heads, "top_k": tr.top_k, "query": tr.query, "probes": probes,
            **({"analysis": json_ready(tr.analysis)} if tr.analysis else {})}


def norm_traces(models: dict, ids: list[int], tokens: list[str], model=None, traced=None) -> dict:
    """{'pre': Trace, 'post': Trace} of the same text: `models` is tracing.stream.placement_twins
    of one model. `traced`, the Trace of `model` itself, is reused when `model` is one of the pair."""
    return {kind: traced if (traced is not None and models[kind] is model) else trace(models[kind], ids, tokens=tokens, top_k=1)
            for kind in PLACEMENTS}


NORM_ABOUT = "the same weights with the norms before each sublayer (pre) or after each addition (post)"


def norm_view(models: dict, ids: list[int], tokens: list[str], model=None, traced=None,
              rows: list[int] | None = None) -> dict:
    """RMS of the stream after every addition for the same text, pre-norm and post-norm
    (norm_traces, then norm_table; `rows`: the tokens whose calculations are included)."""
    return norm_table(norm_traces(models, ids, tokens, model, traced), own={kind: models[kind] is model for kind in PLACEMENTS},
                      about=NORM_ABOUT, rows=rows)


def norm_table(traces: dict, own: dict | None = None, about: str | None = None, rows: list[int] | None = None) -> dict:
    """{'pre': Trace, 'post': Trace} (or one of them) of one text → the RMS tables the page plots
    side by side (tracing.analysis.norm_rms of each), with the calculation of every RMS.
    own[kind]: the trace is of the page's own model, so its operands link to the page's numbers.
    rows: only these tokens' calculations (the others None: a live page asks for them)."""
    out: dict[str, Any] = {"rms": {}, "about": about}
    for kind, tr in traces.items():
        r = norm_rms(tr)
        out["rms"][kind] = [list(row) for row in zip(*r["rms"])]  # [token][step]
        mine = True if own is None else own[kind]
        out.setdefault("calc", {})[kind] = rms_calcs(tr, r["points"], own=mine, rows=rows,
                                                     model=None if own is None else f"the {kind}-norm model")
        out["steps"] = [lab.replace(": + ", " +").replace("attention", "attn") for lab in r["labels"]]
        out["tokens"] = list(tr.tokens)
    return out


FLASH_LIMIT = 60_000  # numbers of FlashAttention walks a page stores at most


def flash_tiles(T: int) -> list[int]:
    """The tile sizes the FlashAttention view offers for T tokens."""
    return [x for x in (1, 2, 4, 8, 16, 32, 64) if x <= max(1, T)]


def walkable(tr) -> bool:
    """Whether the kernel can be run again over the trace's q, k, v: every head of every traced
    layer is kept (else the trace's own tile log is all there is)."""
    return len(tr.heads) == int(tr.config["n_heads"]) and all(f"blocks.{i}.attn.v" in tr.probes for i in tr.layers)


def _kernel_log(tr, layer: int, tile: int) -> list[dict]:
    """The tiled kernel's log, run again over layer `layer`'s traced q, k, v (those the scores read:
    after RoPE where the layer turns them), with the layer's window, scale and score cap. (A sink
    joins each row's denominator after its last tile: the walk multiplies o / l by 1 − its weight.)"""
    cfg = ModelConfig.from_dict(tr.config)
    q, k = (tr[n] for n in score_inputs(cfg, layer))
    v = tr[f"blocks.{layer}.attn.v"]
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    return kernel_log(q, k, v, tile=tile, positions=tr.positions, window=cfg.window_at(layer), scale=scale,
                      softcap=cfg.attn_softcap)[1]


def tile_walks(tr, tile: int, rows: list[int]) -> dict[str, dict]:
    """{render.flash_key: walk} of every traced layer and head for query rows `rows`, tiles of
    `tile`: one run of the tiled kernel per layer over the traced q, k, v, every row and head
    read out of its log in one pass (tracing.tiles.head_walks)."""
    out = {}
    for i in tr.layers:
        sink = tr.probes.get(f"blocks.{i}.attn.sink_weight")  # attention sinks: each row's share, (T, heads)
        walks = head_walks(_kernel_log(tr, i, tile), rows, tr.heads, int(tr.config["n_heads"]), tr.positions, tile,
                           None if sink is None else sink.data.tolist())
        out.update({flash_key(i, h, row, tile): w for (row, h), w in walks.items()})
    return out


def walk_numbers(log: list[dict], row: int, head_dim: int) -> int:
    """Numbers one head's walk of `row` stores (each tile's scores and o, and m, l, alpha), read
    off the tiles of a kernel log: the same in every layer and head."""
    return sum(3 + (0 if e["skipped"] else e["k"][1] - e["k"][0] + head_dim) for e in log if e["q"][0] <= row < e["q"][1])


def flash_walks(tr, tile: int, focus: int, limit: int = FLASH_LIMIT) -> dict:
    """Walks of the tiled kernel (tile_walks) for a saved page's FlashAttention view:
    {'tiles', 'walks': {render.flash_key: tiles.head_walk}, 'left_out'}.

    A row's walks go in together (every layer and head): first the focus row at `tile`, then
    the other rows, then the other tile sizes, while they fit in `limit` numbers; the first
    row that does not fit ends it (its walks and all after are counted in left_out). Only the
    rows that fit are walked: one layer's run of the kernel sizes them first.
    """
    T = len(tr.tokens)
    tiles = flash_tiles(T)
    out = {"tiles": tiles, "walks": {}, "left_out": 0}
    if not walkable(tr):
        return out
    rows = [focus] + [r for r in range(T) if r != focus]
    per_row, head_dim = len(tr.layers) * len(tr.heads), int(tr.config["head_dim"])
    numbers = 0
    for t in [tile] + [x for x in tiles if x != tile]:
        log, fit = _kernel_log(tr, tr.layers[0], t), []
        for row in rows:
            size = per_row * walk_numbers(log, row, head_dim)
            if numbers + size > limit:
                break
            fit.append(row)
            numbers += size
        if fit:
            out["walks"].update(tile_walks(tr, t, fit))
        if len(fit) < len(rows):
            out["left_out"] = len(tiles) * T * per_row - len(out["walks"])
            break
    return out


def rms_calcs(tr, points: list[str], own: bool = True, model: str | None = None,
              rows: list[int] | None = None) -> list[list[dict] | None]:
    """The calculation (explain_rms) of every RMS of the comparison, [token][step].

    model: a few words naming the model traced (shown with the calculation).
    own=False: the trace is of the twin model, not of the page's trace, so its operands
    cannot be explained on this page: they are marked source 'twin' (shown, not linked).
    rows: only these tokens (the others None).
    """
    out: list[list[dict] | None] = []
    for t in range(len(tr.tokens)):
        if rows is not None and t not in rows:
            out.append(None)
            continue
        row = []
        for p in points:
            c = to_plain(explain_rms(tr, p, t))
            for st in c["steps"]:  # kept small: a long sentence has hundreds of these
                st.pop("text", None)  # the one step's text is the calculation's own text
                for term in st.get("terms") or []:
                    for o in term:
                        o["value"] = float(f"{o['value']:.7g}")  # the page shows 4 digits
            if model:
                c["model"] = model  # whose stream: the page says so under the title
            if not own:
                for st in c["steps"]:
                    for term in st.get("terms") or []:
                        for o in term:
                            if o.get("source") == "probe":
                                o["source"] = "twin"
            row.append(c)
        out.append(row)
    return out


COST_ROWS = [
    ("params", "weights in all"), ("params_non_embedding", "weights outside the embedding"),
    ("params_by_part", "weights by part"),
    ("flops_forward", "FLOPs of one forward over this sentence (matrix products, full score grid)"),
    ("flops_per_token", "forward FLOPs per token"), ("flops_train_step", "FLOPs of a training step (about 3 forwards)"),
    ("crossover_seq", "context length where the score FLOPs pass the feed-forward's"),
    ("activations", "numbers saved for backward, one row of this length"),
    ("train_memory_bytes", "training memory (weights, gradients, AdamW moments, activations)"),
    ("kv_cache_bytes_per_token", "KV cache per token"), ("kv_cache_numbers_per_token_per_layer", "numbers cached per token per layer"),
    ("kv_cache_bytes", "KV cache for this sentence"),
]


def costs_view(cfg, T: int) -> dict | None:
    """The cost rows the page lists, from `glassformer.cost` (None when that module is missing)."""
    try:
        from ..cost import estimate
    except ImportError:
        return None
    r = estimate(cfg, batch=1, seq=T, dtype="fp32", hardware="h100")
    calcs = cost_calcs(cfg, r)  # each figure's formula, numbers put in: shown on a click
    rows = []
    for key, what in COST_ROWS:
        if key not in r:
            continue
        part = cost_rows({key: r[key]})["rows"]
        for row in part:
            row["what"] = what if row["key"] == key else ""
            if row["key"] in calcs:
                row["calc"] = calcs[row["key"]]
        rows.extend(part)
    return {"rows": rows, "about": f"For one row of {T} tokens in fp32 (glassformer cost --seq {T} --dtype fp32 prints them all)."}


def page_args(model, tokenizer, text: str, *, model_name: str, mode: str = "static", norm: dict | None = None,
              focus: int | None = None, vocab: list[str] | None = None,
              known: tuple[list[int], list[str]] | None = None) -> tuple[Any, dict]:
    """(trace, build_payload keyword arguments) for one sentence (known: its ids and tokens, when
    they are not the text's encoding: a generated continuation)."""
    ids, tokens = known if known is not None else encode(tokenizer, text, model.config.max_seq_len)
    focus = focus if focus is not None and focus < len(ids) else None
    tr = trace_for_page(model, ids, tokens, focus)
    args: dict[str, Any] = dict(
        sentence=text, model_name=model_name, pieces=functools.partial(_piece, tokenizer),
        norm=norm_view(norm or placement_twins(model), ids, tokens, model, tr), costs=costs_view(model.config, len(ids)),
        vocab=vocab, focus_token=focus, flash_tile=flash_tile(len(ids)),
        flash=flash_walks(tr, flash_tile(len(ids)), tr.query), tour=tour_part(model, model_name == WORKED_NAME),
    )
    if mode == "static":
        args["explain"] = lambda probe, index: named(explain(tr, probe, index, model=model), tokenizer)
        args["sampling"] = sample_grid(Sampler(model, tokenizer), ids, tr.query)
    args["tokenizer"] = tokenizer_view(tokenizer, text)
    return tr, args


VOCAB_REF = re.compile(r"\[#(\d+)\]")  # explaining.rules.Context.vocab's name of an id not in the text


def named(e, tokenizer):
    """The explanation `e` with every vocabulary entry named as the page draws it (token_label of its
    piece: ↵, ␣cat) where the trace alone could only say #id: a softmax's inputs read as its title does."""
    if tokenizer is None:
        return e
    d = to_plain(e)

    def fix(text):
        return VOCAB_REF.sub(lambda m: f"[{token_label(_piece(tokenizer, int(m.group(1))))}]", text)

    def walk(x):
        if isinstance(x, dict):
            return {k: (fix(v) if k in ("label", "text", "title") and isinstance(v, str) else walk(v)) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(d)


def _piece(tokenizer, i: int) -> str:
    try:
        return str(tokenizer.id_to_piece(int(i)))
    except (IndexError, KeyError, ValueError, UserError):  # an id past the tokenizer's (a model's padded vocabulary)
        return f"#{i}"


def write_page(path, model, tokenizer, text: str, *, model_name: str, **kw):
    """Trace `text` and write the self-contained page to `path`; returns the path."""
    tr, args = page_args(model, tokenizer, text, model_name=model_name, **kw)
    return write_html(path, tr, **args)


def generation(model, tokenizer, prompt: str, ids: list[int], tokens: list[str], max_tokens: int | None,
               settings: dict) -> tuple[list[int], list[str], dict, str]:
    """(ids, tokens, generated part, text): the prompt (its ids and tokens) continued by
    glassformer.generate with these settings (up to max_tokens, stopping at the end-of-text token as
    `glassformer generate` does), and the generated-text view's data (viewer/generated.py) from
    one full forward over the whole text. max_tokens None: default_tokens."""
    if max_tokens is None:
        max_tokens = default_tokens(len(ids), model.config.max_seq_len)
    check_max_tokens(max_tokens, len(ids), model.config.max_seq_len)
    check_sampling(**{k: v for k, v in settings.items() if k != "seed"})
    eot = getattr(tokenizer, "eot_id", None)
    new = new_tokens(model, ids, max_tokens, settings, None if eot is None else [eot])
    every = ids + new
    # The text as generate's stream writes it: the prompt, then the new tokens decoded (a word
    # tokenizer that joins words decodes the whole text instead).
    text = tokenizer.decode(every) if tokenizer.decode(ids) == prompt else prompt + tokenizer.decode(new)
    try:
        roundtrip = list(tokenizer.encode(text)) == every
    except Exception:  # a word vocabulary that cannot read its own output back
        roundtrip = False
    part = generated_part(full_logits(model, every), ids, new, settings, functools.partial(_piece, tokenizer),
                          text=text, roundtrip=roundtrip, max_tokens=max_tokens)
    return every, tokens + tokens_of(tokenizer, new), part, text


def default_tokens(prompt_len: int, context: int) -> int:
    """New tokens when none are asked for: the server's GENERATE_TOKENS, or the room the prompt leaves
    in the context where that is less (the toy model's 16 tokens of context hold 12 after 'I like cats too').

    >>> default_tokens(4, 16), default_tokens(4, 1024)
    (12, 20)
    """
    return max(1, min(GENERATE_TOKENS, context - prompt_len))


GENERATED_NORM_ROWS = 16  # tokens whose RMS calculations a generated page stores (~35 kB a token)


def write_generated_page(path, model, tokenizer, prompt: str, max_tokens: int, settings: dict, *,
                         model_name: str) -> tuple[Path, dict]:
    """`glassformer generate --html`: `prompt` continued by generate, as one self-contained page with
    the generated-text view filled in; returns (the path, the generated part)."""
    model.eval()
    ids, tokens = encode(tokenizer, prompt, model.config.max_seq_len)
    every, tokens, part, text = generation(model, tokenizer, prompt, ids, tokens, max_tokens, settings)
    tr, args = page_args(model, tokenizer, text, model_name=model_name, known=(every, tokens))
    _lighter(args, len(every))
    return write_html(path, tr, generated=part, explain_limit=EXPLAIN_LIMIT, **args), part


def _lighter(args: dict, T: int) -> None:
    """A generated text is long for a saved page: it stores fewer calculations (EXPLAIN_LIMIT, of
    ~2.6 kB each), the first quarter of the tile walks (the focus row's first) and the RMS
    calculations of the last GENERATED_NORM_ROWS tokens only (their numbers are drawn, not linked);
    `glassformer view` computes the rest."""
    walks = list(args["flash"]["walks"].items())
    kept = dict(walks[:max(1, len(walks) // 4)])
    args["flash"] = {**args["flash"], "walks": kept, "left_out": args["flash"].get("left_out", 0) + len(walks) - len(kept)}
    norm = args.get("norm")
    if norm and norm.get("calc"):
        first = T - GENERATED_NORM_ROWS
        norm["calc"] = {kind: [row if t >= first else [] for t, row in enumerate(rows)] for kind, rows in norm["calc"].items()}


def explorer(model, tokenizer, default_text: str, *, model_name: str, norm: dict | None = None, vocab=None, focus=None):
    """The server's Explorer for a model: recompute the trace of any sentence, explain any number
    (and the parts a live page asks for as it shows them: LiveParts)."""
    model.eval()
    live = LiveParts(model, norm or placement_twins(model))
    tour = tour_part(model, model_name == WORKED_NAME)  # weights only: the same for every sentence

    def enc(text):
        return encode(tokenizer, text, model.config.max_seq_len)

    def focus_of(n):
        return focus if focus is not None and focus < n else None

    def trace_fn(ids, tokens):
        return trace_for_page(model, ids, tokens, focus_of(len(ids)))

    def extras(ids, tokens, tr, traced):
        return dict(model_name=model_name, pieces=functools.partial(_piece, tokenizer), norm=live.norm_view(traced),
                    costs=costs_view(model.config, len(ids)), vocab=vocab, focus_token=focus_of(len(ids)),
                    flash_tile=flash_tile(len(ids)), flash=live.flash_view(traced), tour=tour)

    def calculation(tr, probe, index):
        if probe in LiveParts.PARTS:
            return live.part(tr, probe, index)
        return named(explain(tr, probe, index, model=model), tokenizer)

    return Explorer(encode=enc, trace=trace_fn, default_text=default_text, as_dict=page_dict,
                    explain=calculation, extras=extras, sampler=Sampler(model, tokenizer),
                    text_extras=lambda text: {"tokenizer": tokenizer_view(tokenizer, text)},
                    generator=functools.partial(generation, model, tokenizer),
                    research=functools.partial(research_answer, model, tokenizer))


class Sampler:
    """The sampling view of the token after a text (POST /api/sample): the text's last logits,
    computed as generate's first step computes them (one prefill into a cache of generate's size;
    a prefill runs the plain model's products, glassformer.speed or not) and kept for the next few settings, then every stage
    of the sampler (generation.sampling_stages), the seen tokens being the text's own."""

    KEPT = 32  # texts whose last logits are kept: moving a control recomputes no forward

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.logits: OrderedDict = OrderedDict()  # ids -> ((V,) logits, (D,) the final norm's output)

    def _run(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last position's logits (V,) and the head's input (D,), from one prefill."""
        model, caught = self.model, []  # the final norm's output, caught on its way to the head
        cache = KVCache.for_model(model, 1, cache_length(model, [ids], 1))
        x = torch.tensor([ids], device=next(model.parameters()).device)  # (1, T)
        hook = model.final_norm.register_forward_hook(lambda mod, args, out: caught.append(out[0, -1]))
        try:
            with torch.inference_mode():
                logits = prefill(model, x, cache)[0]  # (V,)
        finally:
            hook.remove()
        return logits, caught[-1]  # (V,), (D,)

    def _logits(self, ids: list[int]) -> torch.Tensor:
        return self._kept(ids)[0]

    def _kept(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(ids)
        if key not in self.logits:
            self.logits[key] = self._run(ids)
            while len(self.logits) > self.KEPT:
                self.logits.popitem(last=False)
        self.logits.move_to_end(key)
        return self.logits[key]

    def head_weight(self) -> torch.Tensor | None:
        """The output head's weight (V, D) where the logits are h·W (not a quantized head, nor one
        whose logits a soft cap bends: then a raw logit's calculation is not that product alone)."""
        if self.model.config.logit_softcap:
            return None
        w = getattr(self.model.lm_head, "weight", None)
        return w if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point() else None

    CALCS = 10  # bars of each stage with their calculation (the page draws 10 bars a stage)

    def __call__(self, ids: list[int], settings: dict) -> dict:
        logits, hidden = self._kept(ids)
        filters = {k: v for k, v in settings.items() if k != "seed"}
        check_sampling(**filters)
        outs = stage_outputs(logits, ids, **filters)
        out = sampling_stages(logits, ids, **settings, outputs=outs)
        shown = {i for st in out["stages"] for i in st["ids"]} | {out["chosen"]}
        out["pieces"] = {str(i): _piece(self.tokenizer, i) for i in sorted(shown)}
        out["labels"] = {i: token_label(piece) for i, piece in out["pieces"].items()}  # what the page draws
        out["calc"] = probability_calcs(outs, settings, out["stages"][-1]["ids"][:self.CALCS], out["labels"])
        w = self.head_weight()
        out["calcs"] = stage_calcs(outs, settings, out["stages"], out["labels"], None if w is None else (hidden, w),
                                   position=len(ids) - 1, shown=self.CALCS)
        out["position"] = len(ids) - 1
        return out


# ----------------------------------------------------------------------------- a saved page's sampling grid

# A saved page cannot ask the sampler, so it holds the sampler's answers for a grid of settings:
# these temperatures × these top-p values (1: off), the other settings the plain sampler's,
# for at most GRID_POSITIONS tokens (the focus token first). The page's two sliders step over
# the grid. Each answer keeps the first SAMPLE_SHOWN ids of every stage (the bars the page
# draws) and their calculations: 75 answers of a 50,257-token model are about 1.5 MB.
GRID_TEMPERATURES = (0.0, 0.5, 0.8, 1.0, 1.5)
GRID_TOP_P = (0.5, 0.8, 0.9, 0.95, 1.0)
GRID_POSITIONS = 3
GRID_DEFAULTS = {"top_k": None, "min_p": None, "repetition_penalty": 1.0, "seed": 0}
SAMPLE_SHOWN = 10  # bars the page draws per stage (glass.js SAMPLE_SHOWN)


def grid_positions(T: int, focus: int | None) -> list[int]:
    """The tokens a saved page holds the sampling view of: the focus token (default the last),
    then the last and the middle one, at most GRID_POSITIONS."""
    focus = T - 1 if focus is None else focus
    out: list[int] = []
    for t in (focus, T - 1, T // 2, 0):
        if t not in out and len(out) < GRID_POSITIONS:
            out.append(t)
    return out


def grid_settings(temperature: float, top_p: float) -> dict:
    """The /api/sample settings of one cell of the grid."""
    return {"temperature": temperature, "top_p": None if top_p >= 1 else top_p, **GRID_DEFAULTS}


def grid_key(position: int, ti: int, pi: int) -> str:
    """The key of one answer in the grid (glass.js builds the same string)."""
    return f"{position}|{ti}|{pi}"


def compact_answer(ans: dict, shown: int = SAMPLE_SHOWN) -> dict:
    """A /api/sample answer cut to what a saved page draws: the first `shown` ids of every stage
    (rest: the mass of the others), their labels and calculations, the chosen id."""
    stages = []
    for st in ans["stages"]:
        ids = st["ids"][:shown]
        cut = {"name": st["name"], "kind": st["kind"], "ids": ids, "values": st["values"][:shown],
               "probs": st["probs"][:shown], "kept": st["kept"], "rest": st["rest"] + sum(st["probs"][shown:])}
        if "seen" in st:
            cut["seen"] = [i for i in st["seen"] if i in set(ids)]
        stages.append(cut)
    keep = {str(i) for st in stages for i in st["ids"]} | {str(ans["chosen"])}
    return {"stages": stages, "chosen": ans["chosen"], "position": ans["position"],
            "labels": {i: v for i, v in ans["labels"].items() if i in keep},
            "calc": {i: c for i, c in ans["calc"].items() if i in keep},
            "calcs": {name: dict(list(row.items())[:shown]) for name, row in ans.get("calcs", {}).items()}}


def sample_grid(sampler, ids: list[int], focus: int | None = None) -> dict:
    """{'temperature', 'top_p', 'positions', 'defaults', 'shown', 'answers': {grid_key: answer},
    'shared': [...]}: what a saved page's sampling view draws, computed by the server's Sampler.

    An answer is compact_answer's with each stage and each stage's calculations stored once in
    `shared` and named by their place in it (most repeat across the grid: the raw logits are
    the same for every setting, the ÷T stage for every top-p); expand_answer puts them back."""
    positions = grid_positions(len(ids), focus)
    answers, shared, seen = {}, [], {}

    def ref(obj) -> int:
        key = json.dumps(obj, sort_keys=True)
        if key not in seen:
            seen[key] = len(shared)
            shared.append(obj)
        return seen[key]

    for t in positions:
        for ti, temp in enumerate(GRID_TEMPERATURES):
            for pi, top_p in enumerate(GRID_TOP_P):
                ans = compact_answer(sampler(ids[:t + 1], grid_settings(temp, top_p)))
                ans["stages"] = [ref(st) for st in ans["stages"]]
                ans["calcs"] = {name: ref(row) for name, row in ans["calcs"].items()}
                answers[grid_key(t, ti, pi)] = ans
    return {"temperature": list(GRID_TEMPERATURES), "top_p": list(GRID_TOP_P), "positions": positions,
            "defaults": dict(GRID_DEFAULTS), "shown": SAMPLE_SHOWN, "answers": answers, "shared": shared}


def expand_answer(grid: dict, key: str) -> dict:
    """One answer of sample_grid with its shared parts put back (as glass.js does): compact_answer's."""
    ans = grid["answers"][key]
    return {**ans, "stages": [grid["shared"][r] for r in ans["stages"]],
            "calcs": {name: grid["shared"][r] for name, r in ans["calcs"].items()}}


# ----------------------------------------------------------------------------- the tokenizer view


def tokenizer_view(tokenizer, text: str) -> dict:
    """What the tokenizer view draws for `text` (text.bpe_steps): its UTF-8 bytes, the chunks, each
    merge with the pieces after it, the ids; every piece as token_label draws it (␣, ↵). A tokenizer
    that is not byte-level BPE gets {'text', 'error'}: the view shows why."""
    try:
        steps = bpe_steps(tokenizer, text)
    except UserError as e:
        return {"text": text, "error": str(e).replace("--steps shows", "the tokenizer view shows")
                .replace("; drop --steps to see its tokens", "")}
    except (AttributeError, TypeError, ValueError, KeyError):  # no tokenizer.json behind it (a word vocabulary)
        words = word_view(tokenizer, text)
        if words is not None:
            return words
        return {"text": text, "error": f"the tokenizer view shows byte-level BPE tokenizers only: this one "
                                       f"({type(tokenizer).__name__}) has no BPE merges to show"}
    return {"text": text, "label": token_label(text), "ids": steps.ids, "bytes": list(text.encode("utf-8")),
            "chunks": [_chunk_view(tokenizer, c) for c in steps.chunks]}


def word_view(tokenizer, text: str) -> dict | None:
    """A word-level tokenizer's steps (the walkthrough's toy one): the text split on whitespace, each
    word looked up whole in the vocabulary, one id each. None when its ids are not one per word."""
    words = text.split()
    try:
        ids = tokenizer.encode(text)
    except UserError as e:  # a word it does not know: the view says which
        return {"text": text, "kind": "words", "label": token_label(text), "error": str(e).splitlines()[0]}
    except Exception:  # noqa: BLE001 (any other tokenizer: not this view's)
        return None
    if not isinstance(ids, list) or len(ids) != len(words) or not all(isinstance(i, int) for i in ids):
        return None
    size = getattr(tokenizer, "vocab_size", None)
    return {"text": text, "kind": "words", "label": token_label(text), "ids": ids, "vocab_size": None if size is None else int(size),
            "words": [{"text": w, "id": i, "piece": token_label(_piece(tokenizer, i))} for w, i in zip(words, ids)]}


def _chunk_view(tokenizer, chunk) -> dict:
    """One chunk: its bytes, then the pieces after each merge (replayed: the leftmost pair merges)."""
    pieces = [bytes([b]) for b in chunk.raw]
    merges = []
    for m in chunk.merges:
        i = next((j for j in range(len(pieces) - 1) if pieces[j] == m.left and pieces[j + 1] == m.right), None)
        if i is None:  # symbols that are not single bytes (byte fallback, unknown token): merges listed only
            merges.append({"rank": m.rank, "left": token_label(m.left), "right": token_label(m.right)})
            continue
        pieces[i:i + 2] = [m.left + m.right]  # two pieces -> one
        merges.append({"rank": m.rank, "left": token_label(m.left), "right": token_label(m.right), "at": i,
                       "pieces": [token_label(x) for x in pieces]})
    return {"text": chunk.text, "label": token_label(chunk.text), "bytes": list(chunk.raw), "added": chunk.added,
            "start": [token_label(bytes([b])) for b in chunk.raw] if not chunk.added else [token_label(chunk.text)],
            "merges": merges, "ids": chunk.ids, "pieces": [token_label(_piece(tokenizer, i)) for i in chunk.ids]}


class LiveParts:
    """A live page's data in two goes: the server's answer to a sentence holds what the page
    draws first (the focus row's RMS calculations; of the walks, the trace's own), and the
    page asks /api/explain for the rest as it shows it, naming the part in the probe field
    (the answer's `fetch` keys): 'norm.calc' [token] is that token's row of RMS calculations
    of the pre/post table, 'flash.walks' [row, tile] every layer's and head's walk of that row.
    """

    PARTS = ("norm.calc", "flash.walks")
    KEPT = 8  # texts whose pre/post-norm traces are kept for later asks (as many as the page cache)

    def __init__(self, model, norm: dict):
        self.model, self.norm = model, norm
        self.own = {kind: norm[kind] is model for kind in PLACEMENTS}
        self.traces: OrderedDict = OrderedDict()  # ids -> norm_traces

    def _traces(self, tr, fresh: bool = False) -> dict:
        key = tuple(tr.ids)
        if fresh or key not in self.traces:
            self.traces[key] = norm_traces(self.norm, tr.ids, tr.tokens, self.model, tr)
            while len(self.traces) > self.KEPT:
                self.traces.popitem(last=False)
        return self.traces[key]

    def norm_view(self, tr) -> dict:
        """The pre/post table of the page's trace `tr`, calculations for its focus row only."""
        table = norm_table(self._traces(tr, fresh=True), own=self.own, about=NORM_ABOUT, rows=[tr.query])
        return {**table, "fetch": "norm.calc"}

    def flash_view(self, tr) -> dict:
        """The FlashAttention view's tile sizes; its walks come from the trace's own tile log
        (render.build_payload adds them) and then from 'flash.walks'."""
        return {"tiles": flash_tiles(len(tr.ids)), "walks": {}, "left_out": 0,
                **({"fetch": "flash.walks"} if walkable(tr) else {})}

    def part(self, tr, name: str, index: list[int]) -> dict:
        T = len(tr.ids)
        if name == "norm.calc":
            (t,) = _checked_index(index, [T], "norm.calc takes [token]")
            table = norm_table(self._traces(tr), own=self.own, rows=[t])
            return {kind: rows[t] for kind, rows in table["calc"].items()}
        row, tile = _checked_index(index, [T, None], "flash.walks takes [row, tile]")
        if tile not in flash_tiles(T) or not walkable(tr):
            raise UserError(f"no walks with tiles of {tile} here: the page offers {flash_tiles(T)}")
        return {"walks": tile_walks(tr, tile, [row])}


def _checked_index(index: list[int], bounds: list[int | None], usage: str) -> list[int]:
    """index, checked to hold one integer per bound and each under its bound (None: any)."""
    if len(index) != len(bounds) or any(b is not None and not 0 <= i < b for i, b in zip(index, bounds)):
        raise UserError(f"{usage}, each within the sentence: got {index}")
    return index


# ----------------------------------------------------------------------------- the toy model

WORKED_FOCUS = 2  # 'cats', the walkthrough's running example


WORKED_NAME = "the walkthrough's toy model"


def worked_parts(variant: str = "one_head") -> dict:
    """A walkthrough toy model (default the one-head one) with what its page needs: keyword
    arguments for page_args / explorer (the two-block pre-norm and post-norm models for the
    comparison)."""
    model, tokenizer = worked.load_worked(variant)
    norm = placement_twins(worked.build_two_blocks("pre").eval())
    name = WORKED_NAME if variant == "one_head" else f"{WORKED_NAME} ({variant})"
    return dict(model=model.eval(), tokenizer=tokenizer, model_name=name,
                norm=norm, vocab=list(worked.TOKENIZER.VOCAB), focus=WORKED_FOCUS)


def worked_explorer(variant: str = "one_head"):
    """The walkthrough's toy model behind the server, its head switch over the four-head model that the
    GQA and MQA variants are averaged from (the two-block ones: their own single head)."""
    parts = worked_parts(variant)
    model, tokenizer = parts.pop("model"), parts.pop("tokenizer")
    ex = explorer(model, tokenizer, worked.SENTENCE, **parts)
    if variant in ("one_head", "mha", "gqa", "mqa"):
        base = model if variant == "mha" else worked.build_four_heads().eval()
        opened = {"gqa": 2, "mqa": 1}.get(variant)
        return switchable(ex, model, tokenizer, worked.SENTENCE, base=base, base_name=f"{WORKED_NAME} (mha)",
                          opened_kv=opened, **parts)
    return switchable(ex, model, tokenizer, worked.SENTENCE, **parts)


def switchable(ex: Explorer, model, tokenizer, default_text: str, *, model_name: str, base=None,
               base_name: str | None = None, opened_kv: int | None = None, **kw) -> Explorer:
    """`ex` (the explorer of `model`) with the page's head switch (viewer/heads.py): the model `base`
    (default `model` itself) with any divisor of its KV heads, averaged, each on its own explorer made on
    first use. opened_kv: the count of `base`'s heads that `model` already is (the toy GQA variant: 2);
    None with another base: the opened model is none of them (the toy one-head model)."""
    base = model if base is None else base
    own = base is model
    mine = base.config.n_kv_heads if own else opened_kv
    made: dict[int, Explorer] = {}

    def switched(k: int) -> Explorer:
        if k == mine:
            return ex
        if k not in made:
            m = pooled_model(base, k)
            name = base_name or model_name
            if m is not base:
                name = f"{name}, KV heads averaged to {k} ({heads_kind(base.config.n_heads, k)})"
            sub = explorer(m, tokenizer, default_text, model_name=name, **kw)
            sub.heads_info = _switch_info(base, m, k)
            made[k] = sub
        return made[k]

    ex.heads = switched
    if mine is None:
        ex.heads_info = heads_info(base, None, f"as opened: {model.config.n_heads} query, {model.config.n_kv_heads} KV")
    else:
        ex.heads_info = _switch_info(base, model, mine)
    return ex


def _switch_info(base, model, k: int) -> dict:
    """heads.info of `model` (base with k KV heads), with its averaged weights' calculations."""
    out = heads_info(base, k)
    if out["pooled"]:
        out["weights"] = averaged_weights(base, model)
    return out


def write_worked_page(path, text: str | None = None):
    """The walkthrough's page ('I like cats too' unless text is given) as one file."""
    parts = worked_parts()
    return write_page(path, parts.pop("model"), parts.pop("tokenizer"), text or worked.SENTENCE, **parts)


# ----------------------------------------------------------------------------- trace files


def write_trace_page(trace, path, model=None, tokenizer=None, sentence: str | None = None):
    """The page of an existing trace (a Trace, its dict or a trace file's path), as one file.

    With `model`, every shown number's calculation is stored and the pre-norm/post-norm
    comparison is computed; without it, calculations come from the trace's own weights
    (`--with-weights`) where it has them, and the comparison shows this model's placement.
    """
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text(encoding="utf-8"))
    tr = as_trace(trace)  # parsed once: explain then reads tensors, not lists
    d = trace if isinstance(trace, dict) else tr.to_dict()
    cfg = ModelConfig.from_dict(d["config"])
    complete = set(tr.layers) == set(range(cfg.n_layers))
    if model is not None and complete:
        norm = norm_view(placement_twins(model), tr.ids, tr.tokens)
    elif complete:
        norm = norm_table({cfg.norm_placement: tr}, about=f"this model's placement ({cfg.norm_placement}-norm) only: "
                                                          "open the page from a model to compare with the other")
    else:
        norm = None
    if tokenizer is not None:
        pieces = functools.partial(_piece, tokenizer)
    else:
        known = dict(zip(tr.ids, tr.tokens))
        pieces = lambda i: known.get(i, f"#{i}")  # noqa: E731
    tiles = [p for n, p in d["probes"].items() if n.endswith(".tiles")]
    tile = tiles[0].get("tile_size") if tiles else flash_tile(len(tr.ids))
    extra = {}
    if model is not None and tokenizer is not None:  # the sampling grid needs the model, the tokenizer view its merges
        extra["sampling"] = sample_grid(Sampler(model.eval(), tokenizer), list(tr.ids), tr.query)
        if sentence is not None:
            extra["tokenizer"] = tokenizer_view(tokenizer, sentence)
    return write_html(
        path, d, sentence=sentence, model_name=cfg.to_dict().get("name") or "traced model", pieces=pieces,
        explain=lambda probe, index: named(explain(tr, probe, index, model=model), tokenizer), norm=norm,
        costs=costs_view(cfg, len(tr.ids)), focus_token=tr.query,
        tour=None if model is None else tour_part(model),  # the walk's weights, from the model
        flash_tile=tiles[0].get("tile_size") if tiles else None,
        flash=flash_walks(tr, tile, len(tr.ids) - 1 if tr.query is None else tr.query) if complete else None,
        **extra,
    )


# ----------------------------------------------------------------------------- a training run

LENS_TOP = 3  # next tokens per block and token in the run view's logit lens


def lens_view(model, tokenizer, ids: list[int]) -> dict:
    """The logit lens of `ids` (tracing.interventions.logit_lens_top): per block and token the top
    next tokens, their probabilities (4 digits) and their labels as the page draws tokens."""
    out = logit_lens_top(model, ids, LENS_TOP, tokenizer)
    out["probs"] = [[[round(p, 4) for p in row] for row in layer] for layer in out["probs"]]
    out["labels"] = [[[token_label(p) for p in row] for row in layer] for layer in out.pop("tokens")]
    return out


def run_explorer(run, open_model, default_text: str, *, checkpoint=None) -> Explorer:
    """The explorer of a training run (`glassformer view --run RUN`): the model of `checkpoint`
    (default: the run's latest), and each other checkpoint of the run opened by its name when a
    request names it (training.RunCheckpoints, checked against the run's list), every payload with
    its checkpoint's logit lens. open_model(folder) -> (model, tokenizer), ready to run."""
    from ..checkpoint.folders import complete_checkpoints, resolve

    run = Path(run)
    names = [p.name for p in complete_checkpoints(run)]
    if not names:
        raise UserError(f"{run} holds no complete training checkpoint: give --run the folder `glassformer train --out` wrote")
    folder = resolve(run if checkpoint is None else checkpoint)
    name = folder.name if folder.parent.resolve() == run.resolve() and folder.name in names else None

    def opened(model, tokenizer, model_name: str) -> Explorer:
        ex = explorer(model, tokenizer, default_text, model_name=model_name)
        ex.additions = lambda ids: {"lens": lens_view(model, tokenizer, ids)}
        return ex

    model, tokenizer = open_model(folder)
    title = run_name(run)
    main = opened(model, tokenizer, f"{title}/{name}" if name else str(checkpoint))

    def open_one(other: str, path: Path) -> Explorer:
        ex = opened(*open_model(path), f"{title}/{other}")
        # One probe recorder in the process: every checkpoint's computations take turns on one lock.
        ex._lock, ex.run, ex.checkpoint = main.lock, main.run, other
        return ex

    main.run = RunCheckpoints(run, open_one, params={k: list(v.shape) for k, v in model.state_dict().items()})
    main.checkpoint = name
    if name:
        main.run.pin(name, main)
    return main
