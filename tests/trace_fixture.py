"""A minimal recorder that writes design.md's trace-file format, for the viewer tests.

It exists so the viewer can be tested against a trace of a real model independently of
`glassformer.tracing.trace`: it taps every probe of one forward pass with `glassformer.probes` and
writes {tokens, ids, positions, config, probes: name -> {shape, axes, data}}.
"""

from __future__ import annotations

import torch

from glassformer import probes

_AXES = {
    "q": ["token", "head", "feature"], "k": ["token", "head", "feature"], "v": ["token", "head", "feature"],
    "q_rot": ["token", "head", "feature"], "k_rot": ["token", "head", "feature"], "z": ["token", "head", "feature"],
    "scores": ["token", "head", "key"], "weights": ["token", "head", "key"],
    "logits": ["token", "vocab"], "probs": ["token", "vocab"],
}


class _Record:
    def __init__(self):
        self.seen: dict[str, torch.Tensor] = {}

    def __call__(self, name, x):
        self.seen[name] = x.detach().float()[0].clone()  # drop the batch axis
        return x

    def wants(self, name):
        return True


@torch.no_grad()
def fixture_trace(model, ids: list[int], tokens: list[str]) -> dict:
    rec = _Record()
    old = probes.set_recorder(rec)
    try:
        model(torch.tensor([ids]))
    finally:
        probes.set_recorder(old)
    out = {}
    T = len(ids)
    causal = torch.ones(T, T).tril().bool()  # (T, Tk)
    for name, x in rec.seen.items():
        leaf = name.rsplit(".", 1)[-1]
        axes = _AXES.get(leaf, ["token", "feature"])
        if leaf == "weights":
            data = [[[float(x[i, h, j]) if causal[i, j] else None for j in range(T)]
                     for h in range(x.shape[1])] for i in range(T)]
        else:
            data = x.tolist()
        out[name] = {"shape": list(x.shape), "axes": axes, "data": data}
    return {"tokens": tokens, "ids": list(ids), "positions": list(range(T)),
            "config": model.config.to_dict(), "probes": out}
