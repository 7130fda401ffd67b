"""What each step of the sampler does to one position's logits, for the explorer's sampling view.

`sampling_stages` runs the sampler's own stage functions (generation/sampling.py) one after
another and lists what each keeps; the token it reports is `sample`'s, with a generator
seeded as `generate` seeds it. docs/generation.md#sampling-exactly, docs/viewer.md.
"""

from __future__ import annotations

import torch

from .sampling import (apply_repetition_penalty, check_sampling, min_p_stage, sample, temperature_stage,
                       top_k_stage, top_p_stage)

LISTED = 200  # ids listed per stage: the most likely ones; the rest is one mass
STAGES = ("logits", "repetition_penalty", "temperature", "top_k", "top_p", "min_p", "probs")


def _listed(name: str, values: torch.Tensor, kind: str) -> dict:
    """A stage's output (V,) as the ids it keeps, largest first (at most LISTED), their values,
    the distribution they stand for ('probs': softmax of a logit stage, a probability stage's own
    values), how many ids it keeps and the mass of those not listed ('rest')."""
    probs = torch.softmax(values, -1) if kind == "logits" else values  # (V,)
    kept = torch.isfinite(values) if kind == "logits" else values > 0  # (V,) bool
    n = int(kept.sum())
    order = torch.where(kept, values, float("-inf")).topk(min(LISTED, n)).indices  # (n_listed,)
    rest = torch.where(kept, probs, 0.0).index_fill(0, order, 0.0).sum()  # summed, not 1 - listed: no cancellation
    return {"name": name, "kind": kind, "ids": order.tolist(), "values": values[order].tolist(),
            "probs": probs[order].tolist(), "kept": n, "rest": float(rest)}


def _at_least_f32(t: torch.Tensor) -> torch.Tensor:
    """float32 for a low-precision row, float64 kept (a wide penalty's numbers may pass float32's range)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def stage_outputs(logits: torch.Tensor, seen, temperature=1.0, top_k=None, top_p=None, min_p=None,
                  repetition_penalty=1.0) -> dict:
    """{stage name: its output (1, V)} for one position's logits (V,), and "seen": the penalty's
    mask (1, V). Greedy (temperature 0): the stages after the penalty repeat it."""
    V = logits.shape[-1]
    row = logits.reshape(1, V)  # (1, V): the shapes generate's step samples from
    mask = torch.zeros(1, V, dtype=torch.bool, device=row.device)  # (1, V)
    ids = torch.as_tensor(list(seen), dtype=torch.long, device=row.device)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < V):
        raise ValueError(f"seen ids must be within the vocabulary 0..{V - 1}")
    mask[0, ids] = True
    penalised = apply_repetition_penalty(row, mask, repetition_penalty) if repetition_penalty != 1.0 else row
    out = {"seen": mask, "logits": row, "repetition_penalty": penalised}
    if temperature == 0:
        return {**out, **dict.fromkeys(STAGES[2:], penalised)}
    scaled = temperature_stage(penalised, temperature)  # (1, V)
    cut = top_k_stage(scaled, top_k)  # (1, V)
    nucleus = top_p_stage(torch.softmax(cut, dim=-1), top_p)  # (1, V)
    final = min_p_stage(nucleus, min_p)  # (1, V)
    return {**out, "temperature": scaled, "top_k": cut, "top_p": nucleus, "min_p": final, "probs": final}


def sampling_stages(logits: torch.Tensor, seen, temperature=1.0, top_k=None, top_p=None, min_p=None,
                    repetition_penalty=1.0, seed=0, outputs: dict | None = None) -> dict:
    """{"stages": [{"name", "ids", "values", ...}, ...], "chosen": id} for one position's logits (V,).

    Always the stages of STAGES in order; a disabled one repeats its input. `seen`: the ids the
    repetition penalty applies to. temperature 0 is greedy: the later stages repeat the penalised
    logits and `probs` is the argmax alone. `chosen` is the token `sample` draws from the
    penalised logits with a generator seeded with `seed` (what generate's first step draws).
    `outputs`: stage_outputs' answer for the same arguments, when the caller has it.

    >>> out = sampling_stages(torch.tensor([2.0, 1.0, 0.0]), [0], repetition_penalty=4.0, top_k=2)
    >>> [s["ids"] for s in out["stages"]][:4]
    [[0, 1, 2], [1, 0, 2], [1, 0, 2], [1, 0]]
    >>> [round(p, 4) for p in out["stages"][-1]["values"]]
    [0.6225, 0.3775]
    """
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    outs = outputs or stage_outputs(logits, seen, temperature, top_k, top_p, min_p, repetition_penalty)
    generator = torch.Generator(logits.device).manual_seed(int(seed))
    chosen = int(sample(outs["repetition_penalty"], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        generator=generator)[0])
    kinds = dict.fromkeys(STAGES[:4], "logits") if temperature else dict.fromkeys(STAGES[:6], "logits")
    stages = [_listed(name, _at_least_f32(outs[name][0]), kinds.get(name, "probs")) for name in STAGES[:6]]
    stages[1]["seen"] = torch.nonzero(outs["seen"][0]).flatten().tolist()
    if temperature == 0:  # greedy: nothing divides or filters; the argmax is certain
        stages.append({"name": "probs", "kind": "probs", "ids": [chosen], "values": [1.0], "probs": [1.0],
                       "kept": 1, "rest": 0.0})
    else:
        stages.append(_listed("probs", outs["probs"][0], "probs"))
    return {"stages": stages, "chosen": chosen}
