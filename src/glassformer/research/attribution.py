"""Direct logit attribution (docs/research.md#direct-logit-attribution): the logit difference
logit(answer) − logit(wrong) at one position split into what each part of the model wrote into the
residual stream, read straight through the final norm and the head.

In a pre-norm model the stream the final norm reads is a sum: the embedding, then each block's
attention output (one term per head: head h's z times its slice of W_O, plus W_O's bias) and its
feed-forward output. The final norm is not linear, so its scale s (√(mean x²) + ε for RMSNorm; the
standard deviation for LayerNorm, each part centred first) is frozen at the value the run had,
as TransformerLens's `apply_ln_to_stack` does; each part c then contributes
    (c / s) · (γ ⊙ (W_U[answer] − W_U[wrong]))
and a norm bias β contributes β · (W_U[answer] − W_U[wrong]). The parts sum to the model's own
logit difference (up to rounding). With a logit soft-cap the head is cap·tanh(logit / cap), which
is not linear either: the parts then sum to the difference of the logits before the cap, and the
answer says so and gives the capped difference beside it.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..probes import final_norm_reads
from .patching import record


def _norm_terms(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float, bool]:
    """The final norm as (γ (D,), β (D,) or None, the frozen scale s of stream x (D,), centred?)."""
    norm, cfg = model.final_norm, model.config
    w = norm.weight.detach().double()
    if getattr(cfg, "norm_offset", False):  # Gemma's (1 + w)
        w = 1.0 + w
    b = None if getattr(norm, "bias", None) is None else norm.bias.detach().double()
    if isinstance(norm, torch.nn.LayerNorm):
        return w, b, float(torch.sqrt(x.var(unbiased=False) + norm.eps)), True
    return w, b, float(torch.sqrt(x.pow(2).mean() + norm.eps)), False


def check_model(model) -> None:
    """Refuse models whose stream is not a plain sum of the parts: a norm on the stream itself (post),
    or on each sublayer's output before its addition (sandwich, post_branch: a head's share of that
    normalised output depends on every other head's)."""
    placement = model.config.norm_placement
    if placement == "pre":
        return
    why = ("normalises the stream itself after each addition" if placement == "post" else
           "normalises each sublayer's output before it is added, so no head's share of it is fixed")
    raise UserError(f"direct logit attribution needs a pre-norm model, whose stream is the sum of what each part "
                    f"writes; this one is norm_placement={placement!r}, which {why}")


def _position(cfg, T: int, position: int, answer: int, wrong: int) -> int:
    """The position as an index 0..T-1, the answer and wrong ids checked against the vocabulary."""
    p = position + T if position < 0 else position
    if not 0 <= p < T:
        raise UserError(f"position {position} is outside the text's {T} tokens")
    for flag, i in (("answer", answer), ("wrong", wrong)):
        if not 0 <= int(i) < cfg.vocab_size:
            raise UserError(f"{flag} id {i} is outside the model's vocabulary 0..{cfg.vocab_size - 1}")
    return p


def _read(model, ids: list[int], p: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One forward of ids[:p+1]: ({probe: its value at p, float64}, the logits there, the logits before
    any soft-cap). The probes: embed, the stream the final norm reads, each block's z and ffn.down."""
    cfg = model.config
    names = ["embed", final_norm_reads(cfg.n_layers, cfg.norm_placement, cfg.ffn)]
    names += [f"blocks.{i}.attn.z" for i in range(cfg.n_layers)]
    names += [f"blocks.{i}.ffn.down" for i in range(cfg.n_layers) if model.blocks[i].ffn is not None]
    heads = ["logits"] + (["head.uncapped"] if cfg.logit_softcap else [])  # (1, 1, V): logits_at reads only p
    seen, _ = record(model, ids[:p + 1], names + heads)  # the text cut after p, so p is its last position
    at = {n: seen[n][0, p].double().cpu() for n in names}
    own = seen["logits"][0, -1].double().cpu()
    return at, own, seen[heads[-1]][0, -1].double().cpu()


def _weight(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().cpu()


def _vectors(model, at: dict, p: int):
    """(name, vector written into the stream at p, what it is) for every part, embedding first."""
    cfg = model.config
    emb = at["embed"]
    if model.pos_embed is not None:
        pos = _weight(model.pos_embed.weight)[p]
        yield "embed", emb - pos, "the token's embedding"
        yield "pos_embed", pos, f"the learned position embedding of position {p}"
    else:
        yield "embed", emb, "the token's embedding (what the stream starts as)"
    H = cfg.head_dim
    for i, block in enumerate(model.blocks):
        W_O, z = _weight(block.attn.wo.weight), at[f"blocks.{i}.attn.z"]  # (D, N·H), (N, H)
        for h in range(cfg.n_heads):
            yield f"blocks.{i}.attn.head{h}", W_O[:, h * H:(h + 1) * H] @ z[h], f"head {h} of block {i}: its z through its slice of W_O"
        bo = _weight(getattr(block.attn.wo, "bias", None))
        if bo is not None:
            yield f"blocks.{i}.attn.bias", bo, f"W_O's bias in block {i}"
        if block.ffn is not None:
            fb = _weight(getattr(getattr(block.ffn, "w_down", None), "bias", None))
            f = at[f"blocks.{i}.ffn.down"]
            yield f"blocks.{i}.ffn", f if fb is None else f - fb, f"the feed-forward's output in block {i}"
            if fb is not None:
                yield f"blocks.{i}.ffn.bias", fb, f"the feed-forward's output bias in block {i}"


@torch.no_grad()
def direct_logit_attribution(model, ids, answer: int, wrong: int, position: int = -1) -> dict:
    """Each part's direct contribution to logit(answer) − logit(wrong) at `position` of ids.

    Returns {"parts": {name: contribution}, "logit_diff": the model's own difference (before any
    soft-cap), "sum": the parts' sum, "scale": the final norm's frozen scale, "details": per part
    the numbers of its calculation, ...}. Part names: embed, pos_embed (learned positions),
    blocks.{i}.attn.head{h}, blocks.{i}.attn.bias, blocks.{i}.ffn, blocks.{i}.ffn.bias, final_norm.bias."""
    check_model(model)
    cfg = model.config
    ids = [int(i) for i in ids]
    p = _position(cfg, len(ids), position, answer, wrong)
    at, own, uncapped = _read(model, ids, p)
    logit_diff = float(uncapped[answer] - uncapped[wrong])
    W_U = _weight(model.lm_head.weight)
    direction = W_U[answer] - W_U[wrong]  # (D,)
    x = at[final_norm_reads(cfg.n_layers, cfg.norm_placement, cfg.ffn)]
    gamma, beta, s, centred = _norm_terms(model, x)
    read = gamma.cpu() * direction  # (D,) what one unit of normalised stream adds to the difference
    parts: dict[str, float] = {}
    details: dict[str, dict] = {}
    total = torch.zeros_like(x)
    for name, c, what in _vectors(model, at, p):
        total = total + c
        cc = c - c.mean() if centred else c
        parts[name] = float(cc @ read) / s
        details[name] = {"what": what, "norm": float(c.norm()), "dot": float(cc @ read)}
    if beta is not None:
        parts["final_norm.bias"] = float(beta.cpu() @ direction)
        details["final_norm.bias"] = {"what": "the final norm's bias, read by the head as it is",
                                      "norm": float(beta.norm()), "dot": parts["final_norm.bias"]}
    out = {"position": p, "answer": int(answer), "wrong": int(wrong), "logit_diff": logit_diff,
           "sum": sum(parts.values()), "scale": s, "norm": "layer" if centred else "rms",
           "answer_logit": float(own[answer]), "wrong_logit": float(own[wrong]),
           "stream_error": float((total - x).abs().max()), "parts": parts, "details": details}
    if cfg.logit_softcap:
        out["logit_softcap"] = cfg.logit_softcap
        out["capped_logit_diff"] = float(own[answer] - own[wrong])
        out["note"] = (f"the head soft-caps its logits (cap·tanh(logit/cap), cap {cfg.logit_softcap}), which no sum of "
                       f"parts can follow: the parts split the difference before the cap ({logit_diff:.6g}); after the "
                       f"cap it is {out['capped_logit_diff']:.6g}")
    return out
