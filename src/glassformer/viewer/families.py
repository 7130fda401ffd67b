"""What the explorer draws of the families' own parts (issue 45), from a trace's dict: each token's
route through the experts of every mixture layer, the weight each head's sink took, the norms a
family adds around its sublayers, and which layers slide, turn by a local RoPE table or none.

static/families.js draws it; a click on a drawn number asks for its calculation by its probe and
index, as every number of the page does (explaining/rules.py explains them).
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..probes import stream_wiring


def _layers(trace: dict) -> list[int]:
    return list(trace.get("layers") or range(int(trace["config"]["n_layers"])))


def _moe(trace: dict, cfg: ModelConfig) -> dict | None:
    """Per traced mixture layer: each token's route [{slot, expert, weight}] (best first), the router's
    probabilities of every expert, and the load (routed slots per expert)."""
    probes, layers = trace["probes"], []
    for i in _layers(trace):
        ids, weights = probes.get(f"blocks.{i}.ffn.expert_ids"), probes.get(f"blocks.{i}.ffn.expert_weights")
        if ids is None or weights is None:
            continue
        routes = [[{"slot": j, "expert": int(e), "weight": w} for j, (e, w) in enumerate(zip(row_ids, row_w))]
                  for row_ids, row_w in zip(ids["data"], weights["data"])]
        load = [0] * cfg.n_experts
        for row in routes:
            for r in row:
                load[r["expert"]] += 1
        probs = probes.get(f"blocks.{i}.ffn.router_probs")
        layers.append({"layer": i, "routes": routes, "load": load, "probs": probs["data"] if probs else None,
                       "shared": f"blocks.{i}.ffn.shared" in probes})
    if not layers:
        return None
    return {"experts": cfg.n_experts, "k": cfg.n_active_experts, "shared_experts": cfg.n_shared_experts,
            "router": cfg.router, "renorm": cfg.router_renorm, "layers": layers}


def _sinks(trace: dict, cfg: ModelConfig) -> list[dict] | None:
    """Per traced layer with attention sinks: the weight the sink took, [token][head], its heads and window."""
    out = []
    for i in _layers(trace):
        p = trace["probes"].get(f"blocks.{i}.attn.sink_weight")
        if p is not None:
            heads = (p.get("index") or {}).get("head") or list(range(cfg.n_heads))
            out.append({"layer": i, "weight": p["data"], "heads": heads, "window": cfg.window_at(i)})
    return out or None


def _norms(cfg: ModelConfig) -> dict | None:
    """The norms a family adds: where they sit (sandwich, post_branch), Gemma's (1 + w), QK norms with
    gains; `adds` names, per block, what each addition adds to the stream (probes.STREAM_WIRING)."""
    if cfg.norm_placement in ("pre", "post") and not cfg.norm_offset and cfg.qk_norm in (False, True):
        return None
    wiring = stream_wiring(cfg.n_layers, cfg.norm_placement, cfg.ffn)
    return {"placement": cfg.norm_placement, "offset": cfg.norm_offset, "qk_norm": cfg.qk_norm,
            "adds": [{"attn": w["attn_adds"], **({"ffn": w["ffn_adds"]} if "ffn_adds" in w else {})} for w in wiring]}


def _layer_kinds(cfg: ModelConfig) -> list[dict] | None:
    """Per layer: its window (None: full), its RoPE table ('global', 'local', None: no RoPE), whether
    its feed-forward is a mixture; None when every layer is alike."""
    kinds = [{"layer": i, "window": cfg.window_at(i), "rope": cfg.rope_kind(i), "moe": cfg.is_moe(i)}
             for i in range(cfg.n_layers)]
    same = all({k: v for k, v in x.items() if k != "layer"} == {k: v for k, v in kinds[0].items() if k != "layer"}
               for x in kinds)
    return None if same else kinds


def families_part(trace: dict) -> dict[str, Any] | None:
    """The page's `families` entry (None for a model with none of the families' parts)."""
    cfg = ModelConfig.from_dict(trace["config"])
    part = {"moe": _moe(trace, cfg), "sinks": _sinks(trace, cfg), "norms": _norms(cfg), "layers": _layer_kinds(cfg),
            "scores": ({"query_pre_attn_scalar": cfg.query_pre_attn_scalar, "softcap": cfg.attn_softcap}
                       if cfg.query_pre_attn_scalar is not None or cfg.attn_softcap is not None else None),
            "embed_scale": cfg.embed_scale}
    return part if any(v for v in part.values()) else None
