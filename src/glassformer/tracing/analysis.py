"""Small analyses of a trace, each returning plain JSON-ready data (the viewer draws them).

    norm_rms(trace)                  RMS of each token's stream after every addition
    norm_placement(model, ids)       the same for pre-norm and post-norm, side by side
    head_summary(trace)              per layer and head: weight on the previous token, the first, itself
    flash_walkthrough(trace, l, h)   one query row through the tiled kernel: m, l, o, alpha per tile
    decode_step(model, ids)          the KV cache and the new row of scores for one generated token
"""

from __future__ import annotations


import torch

from ..errors import UserError
from .trace import TraceRecorder, eval_mode, recording, trace
from .format import Trace, json_ready


def _rms(x: torch.Tensor) -> list[float]:
    return x.double().pow(2).mean(-1).sqrt().tolist()  # (T,)


def norm_rms(tr: Trace) -> dict:
    """RMS √(mean x²) of each token's residual stream after every addition, in order.

    points: the probes measured. Pre-norm: embed, then resid_mid and resid_out of each block
    (the stream itself is never normalised, so its RMS grows). Post-norm: embed, then
    attn_norm and ffn_norm (the stream right after each addition and its norm: ≈ 1);
    `before_norm` holds the sums resid_mid/resid_out before the norm.
    """
    pre = tr.config["norm_placement"] == "pre"
    points, labels, before = ["embed"], ["embed"], []
    for i in tr.layers:
        if pre:
            points += [f"blocks.{i}.resid_mid", f"blocks.{i}.resid_out"]
        else:
            points += [f"blocks.{i}.attn_norm", f"blocks.{i}.ffn_norm"]
            before += [f"blocks.{i}.resid_mid", f"blocks.{i}.resid_out"]
        labels += [f"{i}: + attention", f"{i}: + FFN"]
    out = {"placement": tr.config["norm_placement"], "tokens": tr.tokens, "points": points, "labels": labels,
           "rms": [_rms(tr[p]) for p in points]}
    if before:
        out["before_norm"] = {"points": before, "rms": [_rms(tr[p]) for p in before]}
    return out


def norm_placement(model, ids, tokens=None) -> dict:
    """The model's weights run pre-norm and post-norm: the stream's RMS after every addition, side by side."""
    from ..model import Transformer

    out = {}
    for placement in ("pre", "post"):
        cfg = model.config.replace(norm_placement=placement)
        twin = Transformer(cfg).to(next(model.parameters()).device)
        twin.load_state_dict(model.state_dict())
        out[placement] = norm_rms(trace(twin.eval(), ids, tokens=tokens))
    return out


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
    """One query row of one head through the tiled kernel, tile by tile (trace with attention='tiled').

    Each step: key range, skipped or not, this row's scores in the tile, and the running max m,
    sum l, output o and rescale alpha after it. `output` = o / l after the last tile, which is
    the kernel's output for this row; `z` is the traced .z of that row for comparison.
    """
    if layer not in tr.tiles:
        raise UserError("this trace has no tile states: trace with attention='tiled' (--attention tiled)")
    t = tr.tiles[layer]
    if head not in t["heads"]:
        raise UserError(f"head {head} was not traced; traced heads: {t['heads']}")
    h = t["heads"].index(head)
    steps, m, l, o = [], None, None, None
    for s in t["steps"]:
        step = {"q": s["q"], "k": s["k"], "skipped": s["skipped"]}
        if not s["skipped"]:
            m, l, o = float(s["m"][h]), float(s["l"][h]), [float(v) for v in s["o"][h]]
            step.update(scores=s["scores"][h].tolist(), m=m, l=l, alpha=float(s["alpha"][h]), o=o)
        steps.append(step)
    output = [v / l for v in o] if l else None
    z = tr[f"blocks.{layer}.attn.z"][t["query"], tr.heads.index(head)].tolist() if head in tr.heads else None
    return json_ready({"layer": layer, "head": head, "query": t["query"], "position": t["position"],
                   "tile_size": t["tile_size"], "steps": steps, "output": output, "z": z})


@torch.no_grad()
def decode_step(model, ids, new_id: int | None = None, layers=None) -> dict:
    """Prefill `ids` into a KV cache, then decode one token: the cache after the step and its new row of scores.

    new_id: the token fed at position T (default: the greedy next token). Returns per layer the
    cached keys (after RoPE) and values of every position 0..T, shape (K, T+1, H), and the new
    row of scaled scores and weights, shape (N, T+1).
    """
    from ..kv_cache import KVCache

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
    out["cache_numbers"] = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (T + 1)
    return json_ready(out)


def analysis_for(model, tr: Trace, lens_top: int = 5, tokenizer=None) -> dict:
    """Everything the viewer draws beside the probes, for the trace file's `analysis` key."""
    from .interventions import logit_lens_top

    out = {"norm_rms": norm_rms(tr), "head_summary": head_summary(tr),
           "logit_lens": logit_lens_top(model, tr.ids, lens_top, tokenizer)}
    if tr.tiles:
        out["flash_walkthrough"] = [flash_walkthrough(tr, i, h) for i in tr.tiles for h in tr.heads]
    if tr.positions[0] == 0 and tr.T < model.config.max_seq_len:
        out["decode_step"] = decode_step(model, tr.ids, layers=tr.layers)
    return json_ready(out)


__all__ = ["norm_rms", "norm_placement", "head_summary", "flash_walkthrough", "decode_step", "analysis_for"]
