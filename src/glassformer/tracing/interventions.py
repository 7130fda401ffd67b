"""Interventions, as TransformerLens users expect: change one probe and see the next token move
(ablate, patch, remove_head, logit_lens; examples: docs/explain.md#interventions-glassformertracinginterventions).

Every intervention goes through the probes (glassformer.probes): the recorder returns a
changed tensor in place of the one tapped, so the model code knows nothing about it.
`.scores`, `.weights`, `.sink_weight` and `probs` are shown, never used: ablate `.z` or remove a head
instead. An expert's own probes (`ffn.experts.{e}.*`) hold the tokens routed to it only, so `tokens=`
does not apply to them: intervene on the mixture's `ffn.expert_out` or `ffn.down` for chosen tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import UserError
from ..probes import stream_wiring
from .trace import TraceRecorder, eval_mode, expert_of, probe_axes, recording

_SHOWN_ONLY = ("scores", "weights", "sink_weight", "probs", "tiles")


def _check_probe(model, name: str) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _SHOWN_ONLY:
        raise UserError(f"{name} is only shown by the model, not used by it: intervene on .z (or remove a head) instead")
    cfg = model.config
    parts = name.split(".")
    if parts[0] == "blocks" and not (len(parts) > 2 and parts[1].isdigit() and int(parts[1]) < cfg.n_layers):
        raise UserError(f"no probe {name!r}: layers run 0..{cfg.n_layers - 1}")


def _ids(ids) -> torch.Tensor:
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids))
    return t.reshape(1, -1) if t.dim() == 1 else t  # (1, T)


@torch.no_grad()
def run_with(model, ids, replace: dict[str, Callable], record: Sequence[str] = ()) -> tuple[torch.Tensor, dict]:
    """Logits (1, T, V) of `ids` with each probe in `replace` changed by fn(name, x) -> x.

    Also returns the recorded values of the probes named in `record` (after any change).
    """
    for name in replace:
        _check_probe(model, name)
    rec = TraceRecorder(record=bool(record), replace=replace, only=record)
    idx = _ids(ids).to(next(model.parameters()).device)
    with eval_mode(model), recording(rec):
        logits, _ = model(idx)
    return logits.float(), rec.seen


@dataclass
class Intervention:
    """Next-token distributions at `position` before and after a change."""

    description: str
    position: int
    logits_before: torch.Tensor  # (T, V)
    logits_after: torch.Tensor  # (T, V)

    def probs(self, after: bool) -> torch.Tensor:
        lg = self.logits_after if after else self.logits_before
        return torch.softmax(lg[self.position].double(), -1)  # (V,)

    @property
    def kl(self) -> float:
        """KL(before ‖ after) of the next-token distribution, in nats."""
        p, q = self.probs(False), self.probs(True)
        return float((p * (p.clamp_min(1e-300).log() - q.clamp_min(1e-300).log())).sum())

    def to_dict(self, top: int = 5, tokenizer=None) -> dict:
        p, q = self.probs(False), self.probs(True)

        def rows(dist):
            v, i = dist.topk(min(top, dist.numel()))
            return [{"id": int(t), "token": _piece(tokenizer, int(t)), "before": float(p[t]), "after": float(q[t])}
                    for t in i.tolist()]

        return {"description": self.description, "position": self.position, "kl": self.kl,
                "before": rows(p), "after": rows(q)}


def _piece(tokenizer, i: int) -> str:
    if tokenizer is None:
        return f"#{i}"
    try:
        return tokenizer.decode([i])
    except Exception:  # a tokenizer that cannot decode one id alone
        return f"#{i}"


def _head_dim(model, name: str) -> int | None:
    """The tensor dimension (batch first) that holds heads for probe `name`, if any."""
    axes = probe_axes(name)
    for a in ("head", "kv_head"):
        if a in axes:
            return axes.index(a) + 1
    return None


def _select(model, name: str, x: torch.Tensor, head, tokens) -> torch.Tensor:
    """A boolean mask shaped like x: True where the intervention applies."""
    m = torch.ones_like(x, dtype=torch.bool)
    if tokens is not None and expert_of(name) is not None:  # its rows are the tokens routed to it, not the text's
        layer = name.split(".")[1]
        raise UserError(f"{name} holds only the tokens routed to that expert: for chosen tokens intervene on "
                        f"blocks.{layer}.ffn.expert_out or blocks.{layer}.ffn.down")
    if tokens is not None:
        keep = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
        keep[list(tokens)] = True
        m &= keep.view(1, -1, *([1] * (x.dim() - 2)))
    if head is not None:
        d = _head_dim(model, name)
        if d is None:
            raise UserError(f"{name} has no head axis; head= applies to .q .k .v .q_rot .k_rot .z")
        heads = [head] if isinstance(head, int) else list(head)
        if any(not 0 <= h < x.shape[d] for h in heads):
            raise UserError(f"head {head} out of range: {name} has {x.shape[d]} heads")
        keep = torch.zeros(x.shape[d], dtype=torch.bool, device=x.device)
        keep[heads] = True
        shape = [1] * x.dim()
        shape[d] = -1
        m &= keep.view(shape)
    return m


def ablate(model, ids, probe: str, *, mode: str = "zero", head=None, tokens=None, position: int = -1) -> Intervention:
    """Run with `probe` zeroed (mode='zero') or replaced by its mean over the text's tokens ('mean').

    head: only these heads (for per-head probes); tokens: only these token positions.
    """
    if mode not in ("zero", "mean"):
        raise UserError(f"ablation mode must be 'zero' or 'mean', got {mode!r}")

    def fn(name, x):
        fill = torch.zeros_like(x) if mode == "zero" else x.mean(dim=1, keepdim=True).expand_as(x)
        return torch.where(_select(model, name, x, head, tokens), fill, x)

    before, _ = run_with(model, ids, {})
    after, _ = run_with(model, ids, {probe: fn})
    what = f"{mode}-ablate {probe}" + (f" head {head}" if head is not None else "") + (f" tokens {tokens}" if tokens else "")
    return Intervention(what, _pos(position, before), before[0], after[0])


def patch(model, ids, probe: str, source_ids, *, head=None, tokens=None, position: int = -1) -> Intervention:
    """Run `ids` with `probe` taken from a run of `source_ids` (another text), at `tokens` (default:
    every position both texts have)."""
    _check_probe(model, probe)
    _, seen = run_with(model, source_ids, {}, record=[probe])
    src = seen[probe].to(next(model.parameters()).device)
    T = _ids(ids).shape[1]
    common = min(T, src.shape[1])
    tokens = list(range(common)) if tokens is None else list(tokens)
    if any(not 0 <= t < common for t in tokens):
        raise UserError(f"patched tokens {tokens} must lie within both texts (0..{common - 1})")

    def fn(name, x):
        padded = x.clone()
        padded[:, :common] = src[:, :common].to(x.dtype)
        return torch.where(_select(model, name, x, head, tokens), padded, x)

    before, _ = run_with(model, ids, {})
    after, _ = run_with(model, ids, {probe: fn})
    return Intervention(f"patch {probe} from another text at tokens {tokens}", _pos(position, before), before[0], after[0])


def remove_head(model, ids, layer: int, head: int, position: int = -1) -> Intervention:
    """Run with one attention head removed: its output z is zero, so W_O never sees it."""
    r = ablate(model, ids, f"blocks.{layer}.attn.z", mode="zero", head=head, position=position)
    r.description = f"remove head {head} of layer {layer}"
    return r


def _pos(position: int, logits: torch.Tensor) -> int:
    T = logits.shape[1]
    p = position + T if position < 0 else position
    if not 0 <= p < T:
        raise UserError(f"position {position} is outside the text's {T} tokens")
    return p


@torch.no_grad()
def logit_lens(model, ids) -> torch.Tensor:
    """(L, T, V) logits from the stream after each block, through the final norm and the LM head
    (nostalgebraist, 2020). The last one equals the model's own logits."""
    cfg = model.config
    names = [w["out"] for w in stream_wiring(cfg.n_layers, cfg.norm_placement, cfg.ffn)]  # the stream leaving each block
    _, seen = run_with(model, ids, {}, record=names)
    dev = next(model.parameters()).device
    stream = torch.stack([seen[n][0] for n in names]).to(dev)  # (L, T, D)
    w = model.lm_head.weight
    return model.unembed(model.final_norm(stream.to(w.dtype))).float().cpu()  # (L, T, V), soft-capped as the model's


def logit_lens_top(model, ids, top: int = 5, tokenizer=None) -> dict:
    """JSON form of the logit lens: per block and token, the top next tokens and their probabilities."""
    lens = torch.softmax(logit_lens(model, ids).double(), -1)  # (L, T, V)
    p, i = lens.topk(min(top, lens.shape[-1]), dim=-1)  # (L, T, top)
    return {"layers": list(range(lens.shape[0])), "ids": i.tolist(), "probs": p.tolist(),
            "tokens": [[[_piece(tokenizer, v) for v in row] for row in layer] for layer in i.tolist()]}
