"""The walkthrough as text: the figures of figures.figures(), section by section.

Numbers are shown to the digits the walkthrough prints; the figures dict keeps them finer.
"""

from __future__ import annotations

from . import model as W
from .figures import two_blocks_rms


def _f(x: float, d: int = 2) -> str:
    s = f"{x:.{d}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s


def _v(xs, d: int = 2) -> str:
    return "[" + ", ".join(_f(x, d) for x in xs) + "]"


def _w(xs) -> str:
    """Weights as a person writes them: [0, -0.5, 1]."""
    return "[" + ", ".join(f"{float(x):g}" for x in xs) + "]"


def _matrix(name: str, rows) -> list[str]:
    return [f"{name} (rows = inputs):"] + [f"  {_w(r)}" for r in rows]


def _section(n: int, title: str, lines: list[str]) -> str:
    head = f"{n}. {title}"
    return "\n".join([head, "-" * len(head), *lines, ""])


def walkthrough(fig: dict) -> str:
    """The walkthrough's text from `fig` (figures.figures()), section by section."""
    ffn = fig["ffn"]
    out = [f'The toy model, step by step: "{W.SENTENCE}" through a transformer of width {fig["d_model"]}, '
           f'one head of size {fig["d_head"]}, RMSNorm, RoPE and a ReLU feed-forward of width {ffn["W_up_shape"][1]}.\n']
    for part in (_words, _attention, _heads_and_norm, _ffn_and_blocks, _flash_and_decode):
        out += part(fig)
    return "\n".join(out)


def _words(fig: dict) -> list[str]:
    """Sections 1-2: words to ids, embeddings."""
    voc = fig["vocabulary"]
    emb = {w: W.EMBEDDING[voc[w]] for w in W.SENTENCE.split()}
    out: list[str] = []
    out.append(_section(1, "Words to ids", [
        "vocabulary: " + ", ".join(f"{w} = {i}" for i, w in enumerate(W.WordTokenizer.VOCAB)),
        f"sentence ids: {fig['sentence_ids']}   (ids {voc['unused_ids']} = {', '.join(voc['unused_words'])} unused)",
    ]))
    out.append(_section(2, "Embeddings", [
        *(f"{w:>5}: {_w(e)}" for w, e in emb.items()),
        fig["embedding_values"] + ".",
    ]))
    return out


def _attention(fig: dict) -> list[str]:
    """Sections 3-6: queries, keys and values; RoPE; scores; softmax and the weighted sum."""
    h, words = fig["head0"], W.SENTENCE.split()
    out: list[str] = []
    out.append(_section(3, "Queries, keys and values", [
        "W_Q columns (printed): " + "; ".join(f"{k}: {_w(c)}" for k, c in fig["W_Q_columns"].items()),
        *_matrix("W_K (chosen)", W.W_K), *_matrix("W_V (chosen)", W.W_V),
        "q = x · W_Q, k = x · W_K, v = x · W_V on the normalised embedding (RMS 1, so unchanged)",
        *(f"q[{w}] = {_v(q, 1)}" for w, q in h["query"].items()),
        *(f"k[{w}] = {_v(k, 1)}" for w, k in h["key"].items()),
        *(f"v[{w}] = {_v(v, 1)}" for w, v in h["value"].items()),
    ]))
    out.append(_section(4, "RoPE: turning queries and keys by position", [
        h["rope"] + ".",
        *(f"q[{w}] at position {words.index(w)} -> {_v(q, 3)}" for w, q in h["rotated_query"].items()),
        *(f"k[{w}] at position {words.index(w)} -> {_v(k, 3)}" for w, k in h["rotated_key"].items()),
        f"q[cats] · k[cats] = {_f(h['unrotated_dot_cats_cats'], 1)} before and after turning both by the same angle",
    ]))
    out.append(_section(5, "Scores: dot products, scale, causal mask", [
        f"row cats against {', '.join(words)}: q·k = {_v(h['scores_row_cats_unscaled'], 2)}",
        f"divided by sqrt({fig['d_head']}): {_v(h['scores_row_cats_scaled'], 3)}",
        "cats (position 2) may not read too (position 3): that cell becomes -inf",
    ]))
    out.append(_section(6, "Softmax and the weighted sum of values", [
        f"weights of cats: {_v(h['attention_weights_row_cats'], 3)}   weights of I: {_v(h['attention_weights_row_I'], 1)}",
        f"output of cats = Σ weight · v = {_v(h['attention_output_cats'])}",
    ]))
    return out


def _heads_and_norm(fig: dict) -> list[str]:
    """Sections 7-9: many heads, the output projection and the residual, RMSNorm."""
    h, mh = fig["head0"], fig["multi_head"]
    out: list[str] = []
    out.append(_section(7, "Many heads: MHA, GQA, MQA", [
        f"{mh['n_heads']} heads of size {fig['d_head']}; weights of cats over I, like, cats:",
        f"  MHA head 0: {_v(mh['mha_head0_weights_cats_over_I_like_cats'])}   head 1: "
        f"{_v(mh['mha_head1_weights_cats_over_I_like_cats'])}",
        mh["gqa"] + ".",
        f"  head 1's key of I {_v(mh['head1_key_I'], 1)} and head 0's {_v(h['key']['I'], 1)} average to "
        f"{_v(mh['gqa_shared_key_I'])}",
        f"  GQA head 0: {_v(mh['gqa_head0_weights_cats'])}   head 1: {_v(mh['gqa_head1_weights_cats'])}",
        f"  GQA head 0 output of cats: {_v(mh['gqa_head0_output_cats'])}",
        "numbers in the KV cache per token: " + ", ".join(f"{k} {n}" for k, n in mh["kv_cache_numbers_per_token"].items()),
    ]))
    out.append(_section(8, "Output projection and the residual", [
        *_matrix("W_O (chosen)", W.W_O),
        f"z · W_O = {_v(h['attention_result_after_W_O_cats'])}",
        f"x + attention = {_v(fig['residual_after_attention_cats'])}",
        f"RMS of cats: {_f(fig['rms_cats']['before'], 1)} before, {_f(fig['rms_cats']['after_attention_residual'])} after",
    ]))
    out.append(_section(9, "RMSNorm", [
        f"x / sqrt(mean(x²) + ε), ε = {fig['rmsnorm']['epsilon']:g}, γ {fig['rmsnorm']['gamma']}",
        f"normalised cats: {_v(fig['rmsnorm']['normalized_cats'])}",
    ]))
    return out


def _ffn_and_blocks(fig: dict) -> list[str]:
    """Sections 10-12: the feed-forward, two blocks pre-norm and post-norm."""
    ffn = fig["ffn"]
    rms_post = two_blocks_rms(fig["sentence_ids"], W.SENTENCE.split().index("cats"))["post"]
    out: list[str] = []
    out.append(_section(10, f"Feed-forward ({ffn['activation']})", [
        *_matrix("W_up (column 0 printed, the rest chosen)", W.W_UP),
        *_matrix("W_down (chosen)", W.W_DOWN),
        f"W_up is {ffn['W_up_shape'][0]}×{ffn['W_up_shape'][1]}; column 0 = {_w(ffn['W_up_column0'])}, "
        f"so up[0] of cats = {_f(ffn['up_0_cats'])}",
        f"ReLU sets {ffn['relu_zeroes']} of the {ffn['W_up_shape'][1]} to zero",
        f"W_down is {ffn['W_down_shape'][0]}×{ffn['W_down_shape'][1]}: {ffn['W_down_rows']}",
        f"down[1] of cats: {ffn['down_1_cats']}",
        f"block output of cats: {_v(ffn['block_output_cats'])}",
    ]))
    out.append(_section(11, "Two blocks, pre-norm", [
        "RMS of the cats stream at the embedding, then after each addition:",
        "  " + " -> ".join(_f(r) for r in fig["two_blocks_prenorm_rms_cats"]),
        "the stream grows: pre-norm normalises copies for the sublayers, never the stream itself",
    ]))
    out.append(_section(12, "Two blocks, post-norm", [
        "  " + " -> ".join(_f(r) for r in rms_post),
        f"post-norm normalises the stream itself: {fig['two_blocks_postnorm_rms_cats']}",
    ]))
    return out


def _flash_and_decode(fig: dict) -> list[str]:
    """Sections 13-14: FlashAttention's tiles, decoding with a KV cache."""
    fl, dec, ll = fig["flash_attention_tiles_of_2_row_cats"], fig["decode_step"], fig["llama3_8b_kv_cache"]
    out: list[str] = []
    t0, t1 = fl["tile0"], fl["tile1"]
    out.append(_section(13, "FlashAttention: tiles of 2", [
        f"row cats, key tile I like: scores {_v(t0['scaled_scores'], 3)}, m = {_f(t0['m'], 3)}, "
        f"l = {_f(t0['l'], 3)}, o = {_v(t0['o'], 3)}",
        f"key tile cats too ({t1['masked']} masked): score {_f(t1['score_cats'], 3)}, m = {_f(t1['m'], 3)}, "
        f"alpha = exp(m_old − m_new) = {_f(t1['alpha'], 3)}",
        f"o / l = {_v(fl['result'])}, the same output as the whole grid",
        fl["skipped_tiles"],
    ]))
    out.append(_section(14, "Decoding with a KV cache", [
        f"prefill I like cats, then decode {dec['token']} at position {dec['position']}: "
        f"its value {_v(dec['value'], 1)} joins the cache",
        f"cats' weight on itself stays {_f(dec['cats_weight_on_itself_unchanged'], 3)}: "
        "earlier rows never read later tokens",
        f"Llama 3 8B: 2 · {ll['layers']} layers · {ll['kv_heads']} KV heads · {ll['head_dim']} · "
        f"{ll['bytes_per_number']} bytes = {ll['bytes_per_token']:,} bytes per token; "
        f"{ll['tokens']:,} tokens: {ll['gqa_total_bytes'] / 2**30:g} GiB "
        f"(with {ll['query_heads']} KV heads, MHA: {ll['mha_total_bytes'] / 2**30:g} GiB)",
    ]))
    return out
