"""The walkthrough's figures, recomputed from the toy models of model.py, and their printout.

`figures()` returns a dict with the keys and nesting of the walkthrough's list of figures
(tests/data/worked_example.json): every number is read from a probe of the real model (or
counted from its config); prose entries stay prose, and the ones that state a computed fact
(which key is masked, which tile is skipped, the sum behind down[1]) are written from it.
"""

from __future__ import annotations

import math

import torch

from . import model as W
from ..config import ModelConfig
from ..kv_cache import KVCache
from ..tracing.stream import placement_twins
from ..tracing.tiles import head_walk

ABOUT = (
    "Every figure that the hand-calculation walkthrough states for its toy model (sentence 'I like cats too', "
    "6-word vocabulary, d_model 4, head size 2). Figures are as printed there (rounded to the shown digits). "
    "Matrices that the walkthrough shows only as pictures are absent: a model that reproduces these figures must "
    "choose them consistently. Positions and rows count from 0."
)
ROPE = ("position p turns each (query, key) pair by p radians; values are not turned; the first pair turns 1 radian "
        "per position, later pairs more slowly")
GQA = ("heads 0 and 1 share one KV head built by averaging their W_K and W_V (2 KV heads for 4 query heads); "
       "MQA averages all four")
TILE = 2  # the walkthrough's FlashAttention section uses tiles of 2 queries × 2 keys
BYTES_BF16 = 2


def _num(x) -> float | list:
    """Plain JSON numbers from a tensor (6 decimals: far finer than any printed digit)."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, list):
        return [_num(v) for v in x]
    return round(float(x), 6) + 0.0  # + 0.0 turns -0.0 into 0.0


def _words_of(ids: list[int]) -> list[str]:
    return [W.TOKENIZER.id_to_piece(i) for i in ids]


@torch.no_grad()
def figures() -> dict:
    """Every figure of the walkthrough, recomputed: one named part per section."""
    ids = W.encode(W.SENTENCE)
    words = _words_of(ids)
    at = {w: i for i, w in enumerate(words)}  # word -> position in the sentence
    cats, too = at["cats"], at["too"]
    one = W.build_one_head()
    cfg = one.config
    p = W.run(one, ids)
    _check_invariants(one)
    E, wq = one.embed.weight, one.blocks[0].attn.wq.weight.T  # (V, D), (D, H) math layout
    unused = [i for i in range(W.TOKENIZER.vocab_size) if i not in ids]
    return {
        "about": ABOUT,
        "vocabulary": {**{w: i for w, i in zip(words, ids)}, "unused_ids": unused, "unused_words": _words_of(unused)},
        "sentence_ids": ids,
        "d_model": cfg.dim,
        "d_head": cfg.head_dim,
        "embedding_values": "every embedding entry is 1 or -1, so every embedding has RMS exactly 1",
        "embedding": {"cats": _num(E[ids[cats]])},
        "W_Q_columns": {str(j): _num(wq[:, j]) for j in range(cfg.head_dim)},
        "head0": _head0(p, at, cfg.head_dim),
        "multi_head": _multi_head(ids, at),
        "residual_after_attention_cats": _num(p["blocks.0.resid_mid"][cats]),
        "rms_cats": {"before": _num(W.rms(p["embed"][cats])),
                     "after_attention_residual": _num(W.rms(p["blocks.0.resid_mid"][cats]))},
        "rmsnorm": {"epsilon": cfg.norm_eps, "gamma": "all 1", "normalized_cats": _num(p["blocks.0.ffn_norm"][cats])},
        "ffn": _ffn(one, p, cats),
        "two_blocks_prenorm_rms_cats": _num(two_blocks_rms(ids, cats)["pre"]),
        "two_blocks_postnorm_rms_cats": "1 after every addition",
        "flash_attention_tiles_of_2_row_cats": _flash(p, words, cats),
        "decode_step": _decode(one, ids, words, too, cats, p),
        "llama3_8b_kv_cache": llama3_8b_kv_cache(),
    }


def _check_invariants(one) -> None:
    """Invariants that the prose entries state."""
    blk = one.blocks[0]
    w_down = blk.ffn.w_down.weight.T  # (F, D)
    assert torch.all(one.embed.weight.abs() == 1), "every embedding entry is ±1"
    assert float(one.rope_inv_freq[0]) == 1.0, "RoPE's first pair turns 1 radian per position"
    assert all(torch.all(n.weight == 1) for n in (blk.attn_norm, blk.ffn_norm)), "γ is all 1"
    assert torch.all((w_down != 0).sum(1) == 1) and torch.all(w_down.abs().sum(1) == 0.5), "one ±0.5 per row of W_down"


def _head0(p: dict, at: dict[str, int], H: int) -> dict:
    """The single head of block 0: queries, keys, values, RoPE, scores and weights."""
    def q(name):  # probe of block 0's attention
        return p["blocks.0.attn." + name]

    I, cats, too = at["I"], at["cats"], at["too"]
    scores = q("scores")[cats, 0]  # (Tk,) scaled, before the mask
    return {
        "query": {"cats": _num(q("q")[cats, 0]), "too": _num(q("q")[too, 0])},
        "key": {w: _num(q("k")[at[w], 0]) for w in ("I", "cats", "too")},
        "value": {w: _num(q("v")[at[w], 0]) for w in ("I", "like", "cats", "too")},
        "rope": ROPE,
        "rotated_query": {w: _num(q("q_rot")[at[w], 0]) for w in ("cats", "too")},
        "rotated_key": {w: _num(q("k_rot")[at[w], 0]) for w in ("cats", "too")},
        "unrotated_dot_cats_cats": _num(q("q")[cats, 0] @ q("k")[cats, 0]),
        "scores_row_cats_unscaled": _num(scores * math.sqrt(H)),
        "scores_row_cats_scaled": _num(scores),
        "attention_weights_row_cats": _num(q("weights")[cats, 0]),
        "attention_weights_row_I": _num(q("weights")[I, 0]),
        "attention_output_cats": _num(q("z")[cats, 0]),
        "attention_result_after_W_O_cats": _num(q("out")[cats]),
    }


def _multi_head(ids: list[int], at: dict[str, int]) -> dict:
    """Four heads: MHA, then GQA (2 KV heads) and MQA (1) by averaging W_K and W_V."""
    mha, gqa, mqa = W.build_four_heads(), W.build_gqa(), W.build_mqa()
    pm, pg = W.run(mha, ids), W.run(gqa, ids)
    I, cats = at["I"], at["cats"]
    upto = slice(0, cats + 1)  # I, like, cats
    return {
        "n_heads": mha.config.n_heads,
        "mha_head1_weights_cats_over_I_like_cats": _num(pm["blocks.0.attn.weights"][cats, 1, upto]),
        "mha_head0_weights_cats_over_I_like_cats": _num(pm["blocks.0.attn.weights"][cats, 0, upto]),
        "gqa": GQA,
        "gqa_shared_key_I": _num(pg["blocks.0.attn.k"][I, 0]),
        "head1_key_I": _num(pm["blocks.0.attn.k"][I, 1]),
        "gqa_head1_weights_cats": _num(pg["blocks.0.attn.weights"][cats, 1, upto]),
        "gqa_head0_weights_cats": _num(pg["blocks.0.attn.weights"][cats, 0, upto]),
        "gqa_head0_output_cats": _num(pg["blocks.0.attn.z"][cats, 0]),
        "kv_cache_numbers_per_token": {name: W.kv_numbers_per_token(m.config)
                                       for name, m in (("MHA", mha), ("GQA", gqa), ("MQA", mqa))},
    }


def _ffn(one, p: dict, cats: int) -> dict:
    """The feed-forward of cats, with the sum behind down[1] written from the weights."""
    blk = one.blocks[0]
    w_up, w_down = blk.ffn.w_up.weight.T, blk.ffn.w_down.weight.T  # (D, F), (F, D)
    up, act = p["blocks.0.ffn.up"][cats], p["blocks.0.ffn.act"][cats]
    feeds_1 = [j for j in range(w_down.shape[0]) if w_down[j, 1] != 0]  # hidden units that write feature 1
    down_1 = " + ".join(f"{_plain(w_down[j, 1])} * act[{j}]" for j in feeds_1)
    down_1 += f" = {float(p['blocks.0.ffn.down'][cats, 1]):.2f}, with " + " and ".join(
        f"act[{j}] = {_plain(act[j], 2)}" for j in feeds_1)
    return {
        "activation": {"relu": "ReLU"}[one.config.ffn],
        "W_up_shape": list(w_up.shape),
        "W_up_column0": _num(w_up[:, 0]),
        "up_0_cats": _num(up[0]),
        "relu_zeroes": int((act == 0).sum()),
        "W_down_shape": list(w_down.shape),
        "W_down_rows": "each row has a single entry, 0.5 or -0.5",
        "down_1_cats": down_1,
        "block_output_cats": _num(p["blocks.0.resid_out"][cats]),
    }


@torch.no_grad()
def two_blocks_rms(ids: list[int], token: int) -> dict[str, list[float]]:
    """The RMS of one token's stream after every addition in the two-block model, pre-norm and
    post-norm (the same weights: tracing.stream.placement_twins)."""
    twins = placement_twins(W.build_two_blocks("pre"))
    out = {kind: W.stream_rms(W.run(m, ids), m.config, token) for kind, m in twins.items()}
    assert all(abs(r - 1) < 1e-3 for r in out["post"]), "post-norm keeps the stream at RMS 1"
    return out


def _plain(x, digits: int = 6) -> str:
    """A number as a person writes it: 0.5, 1.09, 0 (no trailing zeros)."""
    s = f"{float(x):.{digits}f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _flash(p: dict, words: list[str], row: int) -> dict:
    """The online-softmax state of one query row after each key tile (tiles of TILE): the
    kernel's walk (tracing.tiles), head 0."""
    mine = [s for s in head_walk(W.tile_walk(p, TILE, row), 0)["steps"] if not s["skipped"]]
    t0, t1 = mine[0], mine[1]
    k0, k1 = t1["k"]
    masked = [words[j] for j in range(k0, k1) if t1["scores"][j - k0] is None]  # None: -inf, masked
    # A fully masked tile lies on an earlier row's walk: the first row that skips one.
    skipped = next(s for r in range(len(words)) for s in W.tile_walk(p, TILE, r)["steps"] if s["skipped"])
    (a0, a1), (b0, b1) = skipped["q"], skipped["k"]
    return {
        "tile0": {"scaled_scores": _num(t0["scores"]), "m": _num(t0["m"]), "l": _num(t0["l"]), "o": _num(t0["o"])},
        "tile1": {"masked": " and ".join(masked), f"score_{words[row]}": _num(t1["scores"][row - k0]),
                  "m": _num(t1["m"]), "alpha": _num(t1["alpha"])},
        "result": _num([o / t1["l"] for o in t1["o"]]),
        "skipped_tiles": (f"the tile where {' and '.join(words[a0:a1])} would read {' and '.join(words[b0:b1])} "
                          "is fully masked and never computed"),
    }


def _decode(model, ids: list[int], words: list[str], new: int, row: int, full: dict) -> dict:
    """Prefill all but the last word into a KV cache, then decode the last word as one step."""
    cache = KVCache.for_model(model, 1, len(ids))
    pre = W.run(model, ids[:new], cache=cache, pos=0)
    step = W.run(model, ids[new:new + 1], cache=cache, pos=new)
    before = pre["blocks.0.attn.weights"][row, 0, row]
    # Causal attention: the new token cannot change an earlier row, so the prefill's weight is final.
    assert torch.allclose(before, full["blocks.0.attn.weights"][row, 0, row])
    assert torch.allclose(cache.layer(0).v[0, 0, new], step["blocks.0.attn.v"][0, 0])
    return {"token": words[new], "position": new, "value": _num(cache.layer(0).v[0, 0, new]),
            f"{words[row]}_weight_on_itself_unchanged": _num(before)}


def llama3_8b_kv_cache() -> dict:
    """KV cache of Llama 3 8B in bf16 over its full 8192-token context, GQA as shipped and as MHA."""
    cfg = ModelConfig.from_preset("llama3-8b")
    per_token = W.kv_numbers_per_token(cfg) * BYTES_BF16
    mha = cfg.replace(n_kv_heads=cfg.n_heads)
    return {"layers": cfg.n_layers, "query_heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "bytes_per_number": BYTES_BF16, "bytes_per_token": per_token, "tokens": cfg.max_seq_len,
            "gqa_total_bytes": per_token * cfg.max_seq_len,
            "mha_total_bytes": W.kv_numbers_per_token(mha) * BYTES_BF16 * cfg.max_seq_len}
