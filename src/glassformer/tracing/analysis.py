"""Small analyses of a trace, each returning plain JSON-ready data (the viewer draws them):
norm_rms (each token's stream RMS after every addition), norm_placement (the same pre-norm
and post-norm, side by side), head_summary (per head: weight on the previous token, the
first, itself), flash_walkthrough (one query row through the tiled kernel), decode_step
(the KV cache and the new row of scores for one generated token).
Each one's output: docs/explain.md#analyses-glassformertracinganalysis.
"""

from __future__ import annotations


import torch

from ..cost.memory import kv_cache_numbers_per_token
from ..errors import UserError
from ..kv_cache import KVCache
from ..probes import stream_points, stream_wiring
from .format import Trace, json_ready
from .interventions import logit_lens_top
from .stream import placement_twins, stream_rms
from .tiles import head_walk
from .trace import TraceRecorder, eval_mode, probe_layer, recording, trace


def _rms(x: torch.Tensor) -> list[float]:
    return stream_rms(x).tolist()  # (T,)


def norm_rms(tr: Trace) -> dict:
    """RMS √(mean x²) of each token's residual stream after every addition, in order.

    points: the probes that hold the stream (probes.stream_points): embed, then the stream
    after each addition. Pre-norm never normalises it, so its RMS grows; post-norm normalises
    it after each addition (≈ 1), and `before_norm` holds the sums resid_mid/resid_out
    that those norms read.
    """
    placement, L = tr.config["norm_placement"], int(tr.config["n_layers"])
    ffn = tr.config.get("ffn", "swiglu")
    points = [p for p in stream_points(L, placement, ffn) if p == "embed" or probe_layer(p) in tr.layers]
    before = [w[k] for w in stream_wiring(L, placement, ffn) if probe_layer(w["mid"]) in tr.layers
              for k in ("attn_norm_reads", "ffn_norm_reads") if k in w and w[k] not in points and w[k] != w["in"]
              and w[k].rsplit(".", 1)[-1].startswith("resid")]  # a sum the norm reads (not a branch's output)
    parts = ("attention",) if ffn == "none" else ("attention", "FFN")  # ffn='none': one addition a block
    labels = ["embed"] + [f"{i}: + {part}" for i in tr.layers for part in parts]
    out = {"placement": placement, "tokens": tr.tokens, "points": points, "labels": labels,
           "rms": [_rms(tr[p]) for p in points]}
    if before:
        out["before_norm"] = {"points": before, "rms": [_rms(tr[p]) for p in before]}
    return out


def norm_placement(model, ids, tokens=None) -> dict:
    """The model's weights run pre-norm and post-norm: the stream's RMS after every addition, side by side."""
    return {kind: norm_rms(trace(twin, ids, tokens=tokens)) for kind, twin in placement_twins(model).items()}


def head_summary(tr: Trace) -> dict:
    """Per traced layer and head, the mean attention weight on the previous token, the first token
    (the 'attention sink', Xiao et al., 2023) and the token itself, over queries 1..T-1 (query 0
    can only read itself)."""
    T = tr.T
    rows = list(range(1, T)) if T > 1 else [0]
    prev, first, self_ = [], [], []
    for i in tr.layers:
        w = torch.nan_to_num(tr[f"blocks.{i}.attn.weights"].double())  # (T, h, Tk), masked cells 0
        r = torch.tensor(rows)
        prev.append(w[r, :, r - 1].mean(0).tolist() if T > 1 else [0.0] * w.shape[1])
        first.append(w[r, :, 0].mean(0).tolist())
        self_.append(w[r, :, r].mean(0).tolist())
    return {"layers": tr.layers, "heads": tr.heads, "previous": prev, "first": first, "self": self_}


def flash_walkthrough(tr: Trace, layer: int, head: int) -> dict:
    """One query row of one head through the tiled kernel, tile by tile (trace with attention='tiled'):
    tiles.head_walk of the trace's own tile log, with `z`, the traced .z of that row, to compare."""
    if layer not in tr.tiles:
        raise UserError("this trace has no tile states: trace with attention='tiled' (--attention tiled)")
    t = tr.tiles[layer]
    if head not in t["heads"]:
        raise UserError(f"head {head} was not traced; traced heads: {t['heads']}")
    z = tr[f"blocks.{layer}.attn.z"][t["query"], tr.heads.index(head)].tolist() if head in tr.heads else None
    return json_ready({"layer": layer, **head_walk(t, head), "z": z})


@torch.no_grad()
def decode_step(model, ids, new_id: int | None = None, layers=None) -> dict:
    """Prefill `ids` into a KV cache, then decode one token: the cache after the step and its new row of scores.

    new_id: the token fed at position T (default: the greedy next token). Returns per layer the
    cached keys (after RoPE) and values of every position 0..T, shape (K, T+1, H), and the new
    row of scaled scores and weights, shape (N, T+1).
    """
    cfg = model.config
    ids = [int(i) for i in ids]
    T = len(ids)
    if T == 0 or any(not 0 <= i < cfg.vocab_size for i in ids + ([] if new_id is None else [int(new_id)])):
        raise UserError(f"decode step: give at least one token, every id in 0..{cfg.vocab_size - 1}")
    if T + 1 > cfg.max_seq_len:
        raise UserError(f"a decode step after {T} tokens needs {T + 1} positions; the model has {cfg.max_seq_len}")
    layers = list(range(cfg.n_layers)) if layers is None else list(layers)
    dev = next(model.parameters()).device
    cache = KVCache.for_model(model, 1, T + 1)
    names = [f"blocks.{i}.attn.{n}" for i in layers for n in ("scores", "weights")]
    rec = TraceRecorder(only=names + ["probs"])
    with eval_mode(model):
        logits, _ = model(torch.tensor([ids], device=dev), cache=cache, pos=0)  # prefill
        if new_id is None:
            new_id = int(logits[0, -1].argmax())
        with recording(rec):
            model(torch.tensor([[new_id]], device=dev), cache=cache, pos=T)  # the decode step
    out = {"ids": ids, "new_id": new_id, "position": T, "cache_len": T + 1, "layers": []}
    for i in layers:
        lk = cache.layer(i)
        out["layers"].append({
            "layer": i,
            "k": lk.k[0, :, : T + 1].float().cpu(),  # (K, T+1, H)
            "v": lk.v[0, :, : T + 1].float().cpu(),  # (K, T+1, H)
            "scores": rec.seen[f"blocks.{i}.attn.scores"][0, 0],  # (N, T+1)
            "weights": rec.seen[f"blocks.{i}.attn.weights"][0, 0],  # (N, T+1)
        })
    p = rec.seen["probs"][0, 0]
    out["next_probs_top"] = {"ids": p.topk(min(5, p.numel())).indices.tolist(), "probs": p.topk(min(5, p.numel())).values.tolist()}
    out["cache_numbers"] = kv_cache_numbers_per_token(cfg) * (T + 1)
    return json_ready(out)


def analysis_for(model, tr: Trace, lens_top: int = 5, tokenizer=None) -> dict:
    """Everything the viewer draws beside the probes, for the trace file's `analysis` key."""
    out = {"norm_rms": norm_rms(tr), "head_summary": head_summary(tr),
           "logit_lens": logit_lens_top(model, tr.ids, lens_top, tokenizer)}
    if tr.tiles:
        out["flash_walkthrough"] = [flash_walkthrough(tr, i, h) for i in tr.tiles for h in tr.heads]
    if tr.positions[0] == 0 and tr.T < model.config.max_seq_len:
        out["decode_step"] = decode_step(model, tr.ids, layers=tr.layers)
    return json_ready(out)


__all__ = ["norm_rms", "norm_placement", "head_summary", "flash_walkthrough", "decode_step", "analysis_for"]
