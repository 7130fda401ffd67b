"""The calculation of one probability of the sampling view, stage by stage, for the page to show
on a click: each stage's number for that id (from generation.sampling_stages.stage_outputs),
and the final probability recomputed from the numbers shown (the page marks whether it equals
the sampler's)."""

from __future__ import annotations

import math

import torch


def _g(x) -> str:
    return f"{float(x):.6g}"


def _penalty_line(z: float, seen: bool, r: float) -> str:
    if r == 1.0:
        return "repetition penalty 1: unchanged"
    if not seen:
        return f"repetition penalty {_g(r)}: not seen yet, unchanged"
    return f"repetition penalty {_g(r)}, seen: {_g(z)} {'/' if z > 0 else '·'} {_g(r)} = {_g(z / r if z > 0 else z * r)}"


def _sums(outs: dict) -> dict:
    """What every id's calculation shares: top-k's largest logit and softmax denominator, and
    the mass top-p and min-p kept (before each renormalised)."""
    cut, nuc, final = outs["top_k"][0], outs["top_p"][0], outs["min_p"][0]
    big = float(cut.max())
    return {"big": big, "total": float(torch.exp(cut.double() - big).sum()), "top": float(nuc.max()),
            "keep_p": float((torch.softmax(cut, -1) * (nuc > 0)).double().sum()),
            "keep_m": float((nuc * (final > 0)).double().sum())}


def probability_calcs(outs: dict, settings: dict, ids: list[int], pieces: dict) -> dict:
    """{str(id): probability_calc} for `ids`; `outs`: stage_outputs; pieces: {str(id): the token's
    label as the page draws it (text.labels.token_label)}."""
    sums = _sums(outs) if settings.get("temperature") else {}
    return {str(i): probability_calc(outs, settings, i, pieces[str(i)], sums) for i in ids}


def probability_calc(outs: dict, settings: dict, i: int, piece: str, sums: dict) -> dict:
    """{"title", "text", "result", "value"} of the final probability of id `i`; `outs`: stage_outputs."""
    at = {name: float(t[0, i]) for name, t in outs.items() if name != "seen"}
    T, k, p, m = (settings.get(n) for n in ("temperature", "top_k", "top_p", "min_p"))
    lines = [f"logit z = {_g(at['logits'])}",
             _penalty_line(at["logits"], bool(outs["seen"][0, i]), settings.get("repetition_penalty", 1.0))]
    if T == 0:
        lines.append("temperature 0: greedy, the largest penalised logit is taken with probability 1")
        return {"title": f"p(“{piece}”) = {_g(at['probs'])}", "text": "\n".join(lines), "result": 1.0, "value": 1.0}
    lines.append(f"÷ temperature {_g(T)}: {_g(at['repetition_penalty'])} / {_g(T)} = {_g(at['temperature'])}")
    rank = int((outs["top_k"][0] > at["top_k"]).sum()) + 1
    lines.append(f"top-k {k}: rank {rank}, kept" if k is not None else "top-k off: kept")
    big, total = sums["big"], sums["total"]
    q = math.exp(at["top_k"] - big) / total
    lines.append(f"softmax over the ids kept: exp({_g(at['top_k'])} − {_g(big)}) / {_g(total)} = {_g(q)}")
    keep_p, keep_m = sums["keep_p"], sums["keep_m"]
    if p is not None and p < 1:
        lines.append(f"top-p {_g(p)}: kept; the ids kept sum to {_g(keep_p)}: {_g(q)} / {_g(keep_p)} = {_g(q / keep_p)}")
    else:
        keep_p = 1.0
        lines.append("top-p off: unchanged")
    if m is not None and m > 0:
        lines.append(f"min-p {_g(m)}: {_g(at['top_p'])} ≥ {_g(m)} · {_g(sums['top'])}, kept; "
                     f"the ids kept sum to {_g(keep_m)}: {_g(at['top_p'])} / {_g(keep_m)} = {_g(at['top_p'] / keep_m)}")
    else:
        keep_m = 1.0
        lines.append("min-p off: unchanged")
    return {"title": f"p(“{piece}”) = {_g(at['probs'])}", "text": "\n".join(lines), "result": q / keep_p / keep_m,
            "value": at["probs"]}
