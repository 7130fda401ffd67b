"""The explorer's head switch: MHA / GQA / MQA of one model, in the page, without a restart.

Fewer key/value heads are made the way `glassformer convert --kv-heads` makes them
(convert/heads.py, Ainslie et al. 2023): the query heads are split into consecutive groups and each
group's new key head is the mean of its members' W_K columns (values alike). Nothing is retrained, so
the page says the heads were averaged, and every averaged weight it shows opens its mean.

A switch starts from a base model: the opened one, or for the walkthrough's toy models the four-head
one their GQA and MQA variants are averaged from. A page names its choice as its `checkpoint`,
"kv_heads=K" (server.Explorer.at), so every later request of the page is answered by that model.
"""

from __future__ import annotations

from ..errors import UserError

PREFIX = "kv_heads="  # a page's checkpoint name for the base model with K key/value heads
SHOWN_ROWS = 2  # averaged entries shown per matrix, layer and new head (the first input rows)


def kv_name(k: int) -> str:
    return f"{PREFIX}{k}"


def parse_kv(name: str) -> int | None:
    """K of a "kv_heads=K" name; None for any other name (a run's checkpoint)."""
    if not name.startswith(PREFIX):
        return None
    k = name[len(PREFIX):]
    if not k.isdigit():
        raise UserError(f"{name!r}: kv_heads takes a whole number of key/value heads, e.g. {PREFIX}2")
    return int(k)


def options(n_kv: int) -> list[int]:
    """The KV head counts a model of n_kv KV heads can be averaged to: its divisors, most first.

    >>> options(4), options(12)[:3], options(1)
    ([4, 2, 1], [12, 6, 4], [1])
    """
    return [k for k in range(n_kv, 0, -1) if n_kv % k == 0]


def kind(n_heads: int, k: int) -> str:
    """MHA (a KV head per query head), MQA (one for all) or GQA (groups between).

    >>> kind(4, 4), kind(4, 2), kind(4, 1), kind(1, 1)
    ('MHA', 'GQA', 'MQA', 'MHA')
    """
    return "MHA" if k == n_heads else "MQA" if k == 1 else "GQA"


def averaged_weights(base, pooled) -> list[dict]:
    """The calculation of a few averaged weights of every layer: W_K'[i, j] and W_V'[i, j] as the mean
    of the group's W_K[i, ·] entries (i an input feature, j the new head's first feature), each with
    its result recomputed here and the pooled model's own weight to compare (calcNum's shape)."""
    cfg, k = base.config, pooled.config.n_kv_heads
    H, group = cfg.head_dim, cfg.n_kv_heads // k
    out = []
    for i, (old, new) in enumerate(zip(base.blocks, pooled.blocks)):
        for mat in ("k", "v"):
            w_old = getattr(old.attn, f"w{mat}").weight.detach().double()  # (B·H, D): row = output feature
            w_new = getattr(new.attn, f"w{mat}").weight.detach().double()  # (K·H, D)
            for head in range(k):
                for row in range(min(SHOWN_ROWS, cfg.dim)):
                    cols = [(head * group + g) * H for g in range(group)]  # the group's heads, feature 0 each
                    vals = [float(w_old[c, row]) for c in cols]
                    mean = sum(vals) / group
                    W = f"W_{mat.upper()}"
                    text = (f"{W}'[{row}, {head * H}] = ({' + '.join(f'{W}[{row}, {c}]' for c in cols)}) / {group}\n"
                            f"= ({' + '.join(_g(v) for v in vals)}) / {group} = {_g(mean)}\n"
                            f"KV head {head} of {k} is the mean of the model's KV heads "
                            f"{', '.join(str(head * group + g) for g in range(group))} (feature 0 of each)")
                    out.append({"layer": i, "matrix": mat, "head": head, "row": row, "value": float(w_new[head * H, row]),
                                "calc": {"title": f"L{i} {W}'[{row}, {head * H}] = {_g(mean)}", "op": "mean",
                                         "text": text, "result": mean, "value": float(w_new[head * H, row]),
                                         "ref": "the averaged model's weight"}})
    return out


def _g(x: float) -> str:
    return f"{x:.4g}".replace("-", "−")


def info(base, k: int | None, opened_label: str | None = None) -> dict:
    """What the page's head switch shows: the base's query and KV heads, the choices, the current one
    (None: the model as opened, when it is not the base), and whether (and how) its heads were averaged."""
    cfg = base.config
    n, b = cfg.n_heads, cfg.n_kv_heads
    out = {"n_heads": n, "base_kv_heads": b, "kv_heads": k, "options": options(b), "opened": opened_label,
           "kinds": {str(o): kind(n, o) for o in options(b)}, "prefix": PREFIX, "pooled": k is not None and k < b}
    if out["pooled"]:
        out["about"] = (f"KV heads averaged: the {b} key/value heads were averaged in groups of {b // k} into {k} "
                        f"({kind(n, k)}; each new W_K and W_V column is the mean of its group's, as "
                        f"`glassformer convert --kv-heads {k}` does); the queries, W_O and the rest are unchanged "
                        "and nothing was retrained.")
    return out


def pooled_model(base, k: int):
    """The base with k KV heads (itself for its own count)."""
    if k not in options(base.config.n_kv_heads):
        raise UserError(f"kv_heads {k}: this model's {base.config.n_kv_heads} key/value heads can be averaged into "
                        f"{', '.join(map(str, options(base.config.n_kv_heads)))}")
    if k == base.config.n_kv_heads:
        return base
    import torch  # only when a page asks for fewer heads

    from ..convert.heads import convert_kv_heads

    if not all(type(getattr(b.attn, w)) is torch.nn.Linear for b in base.blocks for w in ("wk", "wv")):
        raise UserError("the head switch averages plain W_K and W_V weights; this model's are quantized or "
                        "wrapped (--quantize, an adapter): open it without to switch its heads")

    return convert_kv_heads(base, k).eval()
