"""Traces: one text through the model with every named probe recorded (docs/explain.md).

`trace(model, ids)` installs a recorder (glassformer.probes), runs one forward pass and
returns a `Trace`: every probe of design.md for every traced layer, without the batch axis,
token first (docs/trace-format.md). The file format lives in format.py, the tile walk in
tiles.py; this module records.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Sequence

import torch

from ..probes import set_recorder, stream_probes
from ..attention.mask import allowed
from ..attention.tiled import tiled_attention
from ..errors import UserError
from .format import Probe, Trace, as_trace  # noqa: F401  (re-exported)
from .tiles import row_walk

# Axis names of each probe, by the last part of its name (docs/trace-format.md).
_AXES = {
    "q": ["token", "head", "feature"],
    "q_rot": ["token", "head", "feature"],
    "z": ["token", "head", "feature"],
    "k": ["token", "kv_head", "feature"],
    "k_rot": ["token", "kv_head", "feature"],
    "v": ["token", "kv_head", "feature"],
    "q_norm": ["token", "head", "feature"],
    "k_norm": ["token", "kv_head", "feature"],
    "ve": ["token", "kv_head", "feature"],
    "uncapped": ["token", "vocab"],
    "scores": ["token", "head", "key"],
    "weights": ["token", "head", "key"],
    "sink_weight": ["token", "head"],
    "router_logits": ["token", "expert"],
    "router_probs": ["token", "expert"],
    "expert_ids": ["token", "slot"],
    "expert_weights": ["token", "slot"],
    "expert_out": ["token", "slot", "feature"],
    "logits": ["token", "vocab"],
    "probs": ["token", "vocab"],
}


def probe_axes(name: str) -> list[str]:
    """Axis names of probe `name`, e.g. 'blocks.0.attn.k' -> ['token', 'kv_head', 'feature']."""
    return list(_AXES.get(name.rsplit(".", 1)[-1], ["token", "feature"]))


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a probe fired by one expert of a mixture ('blocks.1.ffn.experts.3.up' -> (1, 3)),
    else None. Those probes hold the expert's own tokens only (docs/trace-format.md#mixtures-of-experts)."""
    parts = name.split(".")
    if len(parts) >= 6 and parts[0] == "blocks" and parts[2:4] == ["ffn", "experts"] and parts[4].isdigit():
        return int(parts[1]), int(parts[4])
    return None


def routed_tokens(expert_ids: torch.Tensor, expert: int) -> list[int]:
    """The tokens (in order) that chose `expert` in one of their slots: expert_ids (T, k) as traced.
    The mixture calls each expert on exactly these rows, in this order (moe.MoE.forward)."""
    return [t for t in range(expert_ids.shape[0]) if bool((expert_ids[t] == expert).any())]


def score_inputs(cfg, layer: int) -> tuple[str, str]:
    """The probes whose product is layer `layer`'s scores: the rotated q and k where the layer turns
    them (RoPE), else the normalised ones (qk_norm), else the projections themselves."""
    n = f"blocks.{layer}.attn."
    if cfg.rope_kind(layer) is not None:
        return n + "q_rot", n + "k_rot"
    if cfg.qk_norm:
        return n + "q_norm", n + "k_norm"
    return n + "q", n + "k"


def probe_layer(name: str) -> int | None:
    """The block number in a probe or weight name ('blocks.3.attn.q' -> 3), None outside blocks."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() else None


# ----------------------------------------------------------------------------- recording


class TraceRecorder:
    """A probes.Recorder that keeps a copy of every probe of the selected layers.

    `replace` (name -> function(name, x) -> x) lets interventions change a probe on its way
    through the model; the recorded copy is the value after the change.
    """

    def __init__(self, layers: Iterable[int] | None = None, record: bool = True, replace: dict | None = None,
                 also: Iterable[str] = (), only: Iterable[str] | None = None):
        self.layers = None if layers is None else set(layers)
        self.also = set(also)  # probes kept even outside `layers`
        self.only = None if only is None else set(only)  # when given: record these and nothing else
        self.record = record
        self.replace = dict(replace or {})
        self.seen: dict[str, torch.Tensor] = {}

    def _keep(self, name: str) -> bool:
        if self.only is not None:
            return name in self.only
        layer = probe_layer(name)
        return layer is None or self.layers is None or layer in self.layers or name in self.also

    def wants(self, name: str) -> bool:
        return (self.record and self._keep(name)) or name in self.replace

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        fn = self.replace.get(name)
        if fn is not None:
            x = fn(name, x)
        if self.record and self._keep(name):
            self.seen[name] = x.detach().float().cpu().clone()
        return x


@contextlib.contextmanager
def recording(recorder):
    """Install `recorder` for the duration of the block; the previous one comes back after."""
    old = set_recorder(recorder)
    try:
        yield recorder
    finally:
        set_recorder(old)


@contextlib.contextmanager
def eval_mode(model):
    """Dropout off for the block (a trace must be the deterministic computation explain redoes)."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@contextlib.contextmanager
def attention_kernel(model, name: str | None, tile_logs: dict[int, list] | None = None, tile: int | None = None):
    """Run the block with kernel `name` (None: the model's own); tiled layers in tile_logs log their tiles."""
    cfg = model.config
    old_name, old_kernels = cfg.attention, [b.attn.kernel for b in model.blocks]
    try:
        if name is not None:
            model.set_attention(name)
        for i, log in (tile_logs or {}).items():
            model.blocks[i].attn.kernel = functools.partial(
                tiled_attention, tile=tile or cfg.attention_tile, tile_log=log)
        yield
    finally:
        cfg.attention = old_name
        for b, k in zip(model.blocks, old_kernels):
            b.attn.kernel = k


# ----------------------------------------------------------------------------- weights


def weight_matrix(model, name: str) -> torch.Tensor:
    """The weight called `name` (a state_dict key) in math layout: [in, out] for a Linear, as is otherwise
    (token tables: embed, pos_embed, a layer's value embedding attn.ve, (rows, width))."""
    w = model.state_dict()[name] if name != "lm_head.weight" else model.lm_head.weight
    w = w.detach().float().cpu()
    if w.dim() == 2 and not name.startswith(("embed.", "pos_embed.")) and not name.endswith(".ve.weight"):
        w = w.t()  # nn.Linear stores (out, in); x @ W wants (in, out)
    return w.contiguous()


def layer_weight_names(model, layer: int) -> list[str]:
    return [k for k in model.state_dict() if probe_layer(k) == layer]


# ----------------------------------------------------------------------------- the trace


def _as_list(xs, n: int, what: str) -> list[int]:
    if xs is None:
        return list(range(n))
    out = sorted({int(x) for x in xs})
    bad = [x for x in out if not 0 <= x < n]
    if bad or not out:
        raise UserError(f"{what} {bad or list(xs)} out of range: the model has {what} 0..{n - 1}")
    return out


@torch.no_grad()
def trace(
    model,
    ids: Sequence[int] | torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    pos: int = 0,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    top_k: int | None = None,
    with_weights: bool = False,
    attention: str | None = None,
    query: int | None = None,
    tile: int | None = None,
):
    """Run `ids` (one text) through `model` and record every probe. Returns a Trace.

    tokens: each token's text (default '#<id>'). pos: the first token's position. layers / heads,
    top_k, with_weights, attention, query, tile: as `glassformer trace`'s flags (docs/explain.md).
        >>> model = Transformer(ModelConfig.from_preset("tiny"))  # (from glassformer import ...)
        >>> t = trace(model, [0, 2, 3, 5], tokens=["I", "like", "cats", "too"])
        >>> t["blocks.0.attn.q"].shape            # (T, N, H)
        torch.Size([4, 4, 16])
    """
    cfg = model.config
    ids = [int(i) for i in (ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)]
    _check_text(cfg, ids, tokens, pos)
    T = len(ids)
    layers = _as_list(layers, cfg.n_layers, "layers")
    heads = _as_list(heads, cfg.n_heads, "heads")
    kernel = attention or cfg.attention
    tile, query = _check_options(cfg, T, top_k, tile, query)

    tile_logs = {i: [] for i in layers} if kernel == "tiled" else None
    rec = _record(model, ids, pos, layers, attention, tile_logs, tile)
    found = _probes_of(rec.seen, cfg, heads, pos, T)
    _cut_vocab(found, top_k, cfg.vocab_size)

    config = cfg.to_dict()
    config["attention"] = kernel
    if kernel == "tiled":
        config["attention_tile"] = tile
    tiles = {i: row_walk(log, query, heads, cfg.n_heads, pos + query, tile) for i, log in (tile_logs or {}).items()}
    weights = _weights(model, layers, ids, list(range(pos, pos + T)), found, top_k, heads) if with_weights else {}
    rope = model.rope_inv_freq.float().cpu().tolist() if cfg.pos == "rope" else None
    local = getattr(model, "rope_local_inv_freq", None)  # Gemma 3's sliding layers turn by their own table
    return Trace(
        tokens=list(tokens) if tokens is not None else [f"#{i}" for i in ids],
        ids=ids, positions=list(range(pos, pos + T)), config=config, layers=layers, heads=heads,
        top_k=top_k if (top_k is not None and top_k < cfg.vocab_size) else None,
        query=query if tile_logs is not None else None,
        probes=found, tiles=tiles, weights=weights, rope_inv_freq=rope,
        lora=model.lora_config.to_dict() if getattr(model, "lora_config", None) is not None else None,
        rope_local_inv_freq=None if local is None else local.float().cpu().tolist(),
    )


def _check_text(cfg, ids: list[int], tokens, pos: int) -> None:
    T = len(ids)
    if T == 0:
        raise UserError("nothing to trace: the text has no tokens")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"token ids {bad[:5]} are outside the vocabulary 0..{cfg.vocab_size - 1}")
    if pos < 0 or pos + T > cfg.max_seq_len:
        raise UserError(f"{T} tokens from position {pos} do not fit the model's context of {cfg.max_seq_len}: shorten the text")
    if tokens is not None and len(tokens) != T:
        raise UserError(f"{len(tokens)} token strings for {T} ids")


def _check_options(cfg, T: int, top_k, tile, query) -> tuple[int, int]:
    """(tile, query) with their defaults, checked."""
    if top_k is not None and not 1 <= top_k:
        raise UserError(f"--top-k must be a positive integer, got {top_k}")
    tile = int(tile or cfg.attention_tile)
    if tile < 1:
        raise UserError(f"tile must be a positive integer, got {tile}")
    query = T - 1 if query is None else int(query)
    if not 0 <= query < T:
        raise UserError(f"query row {query} is outside the text's {T} tokens")
    return tile, query


def _record(model, ids, pos, layers, attention, tile_logs, tile) -> TraceRecorder:
    """One forward pass with the recorder on: every probe of the traced layers."""
    cfg = model.config
    # The stream entering each traced block (and the final norm) is kept too, so that explain
    # can start a calculation from it when the block before was not traced.
    feeds = {i - 1 for i in layers if i > 0} | {cfg.n_layers - 1}
    rec = TraceRecorder(layers, also=[stream_probes(i, cfg.norm_placement, cfg.ffn)["out"] for i in feeds])
    idx = torch.tensor([ids], device=next(model.parameters()).device)  # (1, T)
    with eval_mode(model), attention_kernel(model, attention, tile_logs, tile), recording(rec):
        model(idx, pos=pos)
    return rec


def _probes_of(seen: dict[str, torch.Tensor], cfg, heads: list[int], pos: int, T: int) -> dict[str, Probe]:
    """The recorded tensors as Probes: batch axis dropped, masked weights NaN, kept heads only."""
    q_pos = torch.arange(pos, pos + T)[None]  # (1, T)
    kv_heads = sorted({h // cfg.n_rep for h in heads})
    found: dict[str, Probe] = {}
    for name, x in seen.items():
        x = x[0]  # drop the batch axis
        axes = probe_axes(name)
        p = Probe(x, axes)
        if name.rsplit(".", 1)[-1] == "weights":
            window = cfg.window_at(probe_layer(name))  # a sliding layer's window, or None (a full layer)
            ok = allowed(q_pos, torch.arange(x.shape[-1]), None, window)[0]  # (T, Tk)
            p.data = x.masked_fill(~ok[:, None, :], float("nan"))  # masked cells are null in the file
        if "head" in axes and len(heads) < cfg.n_heads:
            p.data, p.index["head"] = p.data[:, heads], list(heads)
        if "kv_head" in axes and len(kv_heads) < cfg.n_kv_heads:
            p.data, p.index["kv_head"] = p.data[:, kv_heads], list(kv_heads)
        at = expert_of(name)
        if at is not None:  # an expert ran on its own tokens: its rows are those tokens, named in index
            p.index["token"] = routed_tokens(seen[f"blocks.{at[0]}.ffn.expert_ids"][0], at[1])
        found[name] = p
    return found


def _cut_vocab(found: dict[str, Probe], top_k: int | None, vocab_size: int) -> None:
    """logsumexp of every row of logits; with top_k, only the k largest logits (and probs) stay."""
    if "logits" not in found:
        return
    lg = found["logits"].data  # (T, V)
    found["logits"].extra["logsumexp"] = torch.logsumexp(lg.double(), -1).tolist()
    if top_k is not None and top_k < vocab_size:
        top = lg.topk(top_k, dim=-1).indices  # (T, k)
        for n in ("logits", "probs", "head.uncapped"):  # the cap is monotonic: the same top k
            if n in found:
                found[n].data = found[n].data.gather(-1, top)
                found[n].index["vocab"] = top.tolist()


def _head_cols(heads: list[int], H: int) -> list[int]:
    """Columns h·H … h·H + H−1 of each head h: where a head's features sit in a projection."""
    return [h * H + j for h in heads for j in range(H)]


def _weights(model, layers, ids, positions, found, top_k, heads) -> dict[str, Probe]:
    out: dict[str, Probe] = {}
    cfg = model.config
    # With --heads, the attention matrices keep only the kept heads' columns (W_Q, W_K, W_V)
    # and rows (W_O), so the weights shrink with the probes.
    sub = {}
    if len(heads) < cfg.n_heads:
        q_cols = _head_cols(heads, cfg.head_dim)
        kv_cols = _head_cols(sorted({h // cfg.n_rep for h in heads}), cfg.head_dim)
        sub = {"wq.weight": (1, q_cols), "wq.bias": (0, q_cols), "wk.weight": (1, kv_cols), "wk.bias": (0, kv_cols),
               "wv.weight": (1, kv_cols), "wv.bias": (0, kv_cols), "wo.weight": (0, q_cols)}
        sub.update({f"{w}.weight_scale": sub[f"{w}.bias"] for w in ("wq", "wk", "wv")})  # int8: a scale per column
        sub["sinks"] = (0, list(heads))  # one logit per query head
        if cfg.qk_norm == "proj":  # a gain per feature of the whole projection
            sub.update({f"{w}_norm.{x}": (0, cols) for w, cols in (("q", q_cols), ("k", kv_cols)) for x in ("weight", "bias")})

    def axes_of(name, w):
        per_out = name.endswith((".bias", ".weight_scale")) and "norm" not in name
        return ["in", "out"] if w.dim() == 2 else (["out"] if per_out else ["feature"])

    def put(name, w, index=None):
        out[name] = Probe(w, axes_of(name, w), dict(index or {}))

    for i in layers:
        for name in layer_weight_names(model, i):
            w = weight_matrix(model, name)
            cut = sub.get(name.split(".attn.")[-1]) if ".attn." in name else None
            if cut is None:
                put(name, w)
            else:
                dim, keep = cut
                axis = axes_of(name, w)[dim]
                put(name, w.index_select(dim, torch.tensor(keep)), {axis: keep})
    for name in ("final_norm.weight", "final_norm.bias"):
        if name in model.state_dict():
            put(name, weight_matrix(model, name))
    rows = sorted(set(ids))
    put("embed.weight", weight_matrix(model, "embed.weight")[rows], {"in": rows})
    if model.pos_embed is not None:
        put("pos_embed.weight", weight_matrix(model, "pos_embed.weight")[positions], {"in": list(positions)})
    head = weight_matrix(model, "lm_head.weight")  # (D, V)
    scale = model.state_dict().get("lm_head.weight_scale")  # an int8 head's scales, (V,)
    if top_k is not None and "vocab" in found.get("logits", Probe(torch.zeros(0), [])).index:
        cols = sorted({v for row in found["logits"].index["vocab"] for v in row})
        put("lm_head.weight", head[:, cols], {"out": cols})
        if scale is not None:
            put("lm_head.weight_scale", scale.float().cpu()[cols], {"out": cols})
    else:
        put("lm_head.weight", head)
        if scale is not None:
            put("lm_head.weight_scale", scale.float().cpu())
    return out
