"""The calculations behind the sampling view's bars, for the page to show on a click.

`probability_calc`: one final probability, stage by stage: each stage's number for that id
(from generation.sampling_stages.stage_outputs), and the probability recomputed from the numbers
shown (the page marks whether it equals the sampler's). `stage_calcs`: the number of every other
stage's bar, what that one stage did to it (the head's product for a raw logit, the penalty's
division or product, ÷ T, the top-k cut and its threshold, top-p's softmax, cumulative test and
renormalisation, min-p's threshold p_max · min_p and renormalisation), recomputed the same way."""

from __future__ import annotations

import math

import torch

from ..generation.sampling import F32_MAX, PENALTY_F32, PENALTY_F64, temperature_overflows


def _g(x) -> str:
    return f"{float(x):.6g}"


def _penalised(z: float, r: float) -> tuple[float, str]:
    """A seen logit z under penalty r as the sampler computes it (sampling.apply_repetition_penalty), and
    what the number ranges did to it, if anything."""
    lo, hi = PENALTY_F32
    if lo <= r <= hi:
        v = z / r if z > 0 else z * r
        return (math.copysign(F32_MAX, v), " (past float32's range: saturated)") if abs(v) > F32_MAX else (v, "")
    lo, hi = PENALTY_F64
    used = min(max(r, lo), hi)
    note = f" (in float64, the penalty taken as {_g(used)}: past it a logit would overflow)" if used != r else ""
    return (z / used if z > 0 else z * used), note


def _penalty_line(z: float, seen: bool, r: float) -> str:
    if r == 1.0:
        return "repetition penalty 1: unchanged"
    if not seen:
        return f"repetition penalty {_g(r)}: not seen yet, unchanged"
    v, note = _penalised(z, r)
    return f"repetition penalty {_g(r)}, seen: {_g(z)} {'/' if z > 0 else '·'} {_g(r)} = {_g(v)}{note}"


OVERFLOW = ("the row's largest logit over T overflows, so the stage takes the limit T → 0: greedy, "
            "the largest logit (the first of equal ones) 0, every other −∞")


def _sums(outs: dict, T: float) -> dict:
    """What every id's calculation shares: top-k's largest logit and softmax denominator, the mass
    top-p and min-p kept (before each renormalised), and whether the temperature overflowed ("over")."""
    cut, nuc, final = outs["top_k"][0], outs["top_p"][0], outs["min_p"][0]
    big = float(cut.max())
    return {"over": bool(temperature_overflows(outs["repetition_penalty"][0], T)),
            "big": big, "total": float(torch.exp(cut.double() - big).sum()), "top": float(nuc.max()),
            "keep_p": float((torch.softmax(cut, -1) * (nuc > 0)).double().sum()),
            "keep_m": float((nuc * (final > 0)).double().sum())}


def probability_calcs(outs: dict, settings: dict, ids: list[int], pieces: dict) -> dict:
    """{str(id): probability_calc} for `ids`; `outs`: stage_outputs; pieces: {str(id): the token's
    label as the page draws it (text.labels.token_label)}."""
    T = settings.get("temperature")
    sums = _sums(outs, T) if T else {}
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
    lines.append(f"÷ temperature {_g(T)}: {OVERFLOW}" if sums["over"] else
                 f"÷ temperature {_g(T)}: {_g(at['repetition_penalty'])} / {_g(T)} = {_g(at['temperature'])}")
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


# ----------------------------------------------------------------------------- every stage's numbers
#
# The bars of the earlier stages open their own calculations: each says what that one stage did
# to the id's number (and recomputes it from the numbers shown), as probability_calc does for the
# whole chain. `head`: (h (D,), W (V, D)), the final norm's output at the position and the output
# head's weight, so that a raw logit is shown as the product it is.

HEAD_TERMS = 4  # products h_d · W[id, d] written out in a logit's calculation


def _calc(title: str, lines: list[str], result: float, value: float) -> dict:
    return {"title": title, "text": "\n".join(lines), "result": float(result), "value": float(value)}


def _top_p_before(outs: dict, ids: list[int]) -> dict[int, float]:
    """{id: the mass of the ids strictly more likely than it}, top-p's test (generation.sampling.top_p_stage)."""
    probs = torch.softmax(outs["top_k"][0], -1)  # (V,)
    p_sorted, order = probs.sort(descending=True)  # (V,) each
    before = p_sorted.cumsum(-1) - p_sorted  # (V,)
    where = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))  # id -> its place in `order`
    return {i: float(before[where[i]]) for i in ids}


def logit_calc(at: dict, i: int, label: str, head, position: int) -> dict:
    z = at["logits"]
    title = f"logit(“{label}”) = {_g(z)}"
    if head is None:
        return _calc(title, [f"the output head's logit for id {i} at token {position}: the sampler starts here"], z, z)
    h, w = head[0].detach().double(), head[1][i].detach().double()  # (D,) each
    terms = " + ".join(f"{_g(a)}·{_g(b)}" for a, b in zip(h[:HEAD_TERMS].tolist(), w[:HEAD_TERMS].tolist()))
    more = f" + … ({h.numel() - HEAD_TERMS} more terms)" if h.numel() > HEAD_TERMS else ""
    z_again = float(h @ w)
    return _calc(title, [f"logit z = h · W[{i}]: the final norm's output at token {position} · the head's row, "
                         f"summed over its {h.numel()} features",
                         f"= {terms}{more}", f"= {_g(z_again)}"], z_again, z)


def penalty_calc(at: dict, seen: bool, label: str, r: float) -> dict:
    z, v = at["logits"], at["repetition_penalty"]
    again = z if (r == 1.0 or not seen) else _penalised(z, r)[0]
    how = ("a seen logit > 0 is divided by the penalty, one ≤ 0 multiplied (CTRL's rule)" if seen
           else "only the text's own tokens are penalised")
    return _calc(f"penalised logit(“{label}”) = {_g(v)}", [f"logit z = {_g(z)}", how, _penalty_line(z, seen, r)], again, v)


def temperature_calc(at: dict, label: str, T: float, over: bool = False) -> dict:
    z, v = at["repetition_penalty"], at["temperature"]
    if T == 0:
        return _calc(f"logit(“{label}”) = {_g(v)}", [f"penalised logit {_g(z)}",
                     "temperature 0: greedy, nothing is divided: the largest logit is taken"], z, v)
    if over:  # the stage's rule, not a quotient: the value is what the rule gives this id
        return _calc(f"logit(“{label}”) / T = {_g(v)}",
                     [f"penalised logit {_g(z)}", f"÷ temperature {_g(T)}: {OVERFLOW}"], v, v)
    return _calc(f"logit(“{label}”) / T = {_g(v)}", [f"penalised logit {_g(z)}",
                 f"÷ temperature {_g(T)}: {_g(z)} / {_g(T)} = {_g(z / T)}",
                 "(T < 1 spreads the logits apart, sharpening the softmax; T > 1 flattens it)"], z / T, v)


def top_k_calc(at: dict, label: str, k, rank: int, kth: float | None) -> dict:
    z, v = at["temperature"], at["top_k"]
    if kth is None:
        return _calc(f"logit(“{label}”) = {_g(v)}", [f"logit {_g(z)}", "top-k off: every id is kept, unchanged"], z, v)
    return _calc(f"logit(“{label}”) after top-k = {_g(v)}", [
        f"logit {_g(z)}, rank {rank} of the vocabulary",
        f"top-k {k}: the cut keeps the {k} largest logits; the {k}-th largest is {_g(kth)}",
        f"rank {rank} ≤ {k}: kept, unchanged (the others become −∞)"], z, v)


def top_p_calc(at: dict, label: str, p, sums: dict, before: float) -> dict:
    z, v = at["top_k"], at["top_p"]
    q = math.exp(z - sums["big"]) / sums["total"]
    lines = [f"logit {_g(z)} after the cuts",
             f"softmax over the ids kept: exp({_g(z)} − {_g(sums['big'])}) / {_g(sums['total'])} = {_g(q)}"]
    if p is None or p >= 1:
        return _calc(f"p(“{label}”) = {_g(v)}", lines + ["top-p off: unchanged"], q, v)
    return _calc(f"p(“{label}”) after top-p = {_g(v)}", lines + [
        f"top-p {_g(p)}: the ids more likely than this one sum to {_g(before)} < {_g(p)}: kept",
        f"renormalised over what top-p keeps (sum {_g(sums['keep_p'])}): {_g(q)} / {_g(sums['keep_p'])} = "
        f"{_g(q / sums['keep_p'])}"], q / sums["keep_p"], v)


def min_p_calc(at: dict, label: str, m, sums: dict) -> dict:
    x, v = at["top_p"], at["min_p"]
    if m is None or m <= 0:
        return _calc(f"p(“{label}”) = {_g(v)}", [f"probability {_g(x)}", "min-p off: unchanged"], x, v)
    threshold = m * sums["top"]
    return _calc(f"p(“{label}”) after min-p = {_g(v)}", [
        f"probability {_g(x)}",
        f"min-p threshold p_max · min_p = {_g(sums['top'])} · {_g(m)} = {_g(threshold)}",
        f"{_g(x)} ≥ {_g(threshold)}: kept",
        f"renormalised over what min-p keeps (sum {_g(sums['keep_m'])}): {_g(x)} / {_g(sums['keep_m'])} = "
        f"{_g(x / sums['keep_m'])}"], x / sums["keep_m"], v)


def _greedy_calc(at: dict, name: str, label: str) -> dict:
    v = at[name]
    return _calc(f"logit(“{label}”) = {_g(v)}", [f"penalised logit {_g(at['repetition_penalty'])}",
                 "temperature 0: greedy, so the cuts are skipped and this stage repeats the penalised logit"],
                 at["repetition_penalty"], v)


def stage_calcs(outs: dict, settings: dict, stages: list[dict], labels: dict, head=None, position: int = 0,
                shown: int = 10) -> dict:
    """{stage name: {str(id): calculation}} for the first `shown` ids of every stage but `probs`
    (probability_calcs has those). `stages`: sampling_stages' list; labels: {str(id): label}."""
    T, k = settings.get("temperature", 1.0), settings.get("top_k")
    sums = _sums(outs, T) if T else {}
    want = {st["name"]: st["ids"][:shown] for st in stages[:-1]}
    before = _top_p_before(outs, want["top_p"]) if T and settings.get("top_p") is not None else {}
    scaled = outs["temperature"][0]
    kth = float(scaled.topk(int(k)).values[-1]) if T and k is not None and k < scaled.numel() else None
    out: dict[str, dict] = {}
    for name, ids in want.items():
        row = {}
        for i in ids:
            at = {n: float(t[0, i]) for n, t in outs.items() if n != "seen"}
            label = labels[str(i)]
            if name == "logits":
                c = logit_calc(at, i, label, head, position)
            elif name == "repetition_penalty":
                c = penalty_calc(at, bool(outs["seen"][0, i]), label, settings.get("repetition_penalty", 1.0))
            elif name == "temperature":
                c = temperature_calc(at, label, T, bool(sums.get("over")))
            elif T == 0:
                c = _greedy_calc(at, name, label)
            elif name == "top_k":
                c = top_k_calc(at, label, k, int((scaled > scaled[i]).sum()) + 1, kth)
            elif name == "top_p":
                c = top_p_calc(at, label, settings.get("top_p"), sums, before.get(i, 0.0))
            else:
                c = min_p_calc(at, label, settings.get("min_p"), sums)
            row[str(i)] = c
        out[name] = row
    return out
