"""FLOPs and memory against context length T, as a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from ..config import ModelConfig
from .flops import crossover_seq, forward_flops
from .memory import kv_cache_bytes, train_memory
from .params import num_weights


def seq_grid(cfg: ModelConfig, lo: int = 16) -> list[int]:
    """Powers of two from lo up to the model's context (the context itself last)."""
    Ts, T = [], lo
    while T < cfg.max_seq_len:
        Ts.append(T)
        T *= 2
    return Ts + [cfg.max_seq_len]


def plot_costs(cfg: ModelConfig, path, batch: int = 1, dtype: str = "bf16", memory: int | None = None,
               optimizer: str = "adamw", title: str | None = None) -> str:
    """Left: forward FLOPs per token by part against T (scores per kernel); right: training
    memory against T for each kernel. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ts = seq_grid(cfg, lo=min(16, cfg.max_seq_len))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))

    per_tok = lambda T, part, k="naive": forward_flops(cfg, batch, T, k)[part] / (batch * T)  # noqa: E731
    dense = [sum(per_tok(T, p) for p in ("attn_qkv", "attn_o", "ffn", "lm_head")) for T in Ts]
    ffn = [per_tok(T, "ffn") for T in Ts]
    ax1.plot(Ts, dense, "k-", lw=2, label="products with weights (flat in T)")
    if cfg.has_ffn:  # ffn='none': no feed-forward line (zeros on a log scale)
        ax1.plot(Ts, ffn, "k:", label="of which feed-forward")
    for k, style in (("naive", "C3-"), ("tiled", "C1--"), ("causal", "C2-.")):
        sc = [2 * per_tok(T, "attn_scores", k) for T in Ts]
        ax1.plot(Ts, sc, style, label=f"attention scores, {k}" + (" (full T×T grid)" if k == "naive" else ""))
    cross = crossover_seq(cfg, "naive")
    if cross is not None and cross <= Ts[-1]:
        ax1.axvline(cross, color="C3", alpha=0.3)
        ax1.text(cross * 0.9, ffn[0] * 0.25, f"full-grid scores\npass the FFN\nat T={cross:,}", fontsize=8,
                 color="C3", ha="right", bbox=dict(fc="white", ec="none", alpha=0.8))
    ax1.set(xscale="log", yscale="log", xlabel="context length T (tokens)", ylabel="forward FLOPs per token",
            title="FLOPs per token")
    ax1.legend(fontsize=8)

    fixed = train_memory(cfg, batch, Ts[0], dtype, "sdpa", optimizer)
    fixed = fixed["total"] - fixed["activations"]
    gib = 2**30
    ax2.axhline(fixed / gib, color="k", lw=1, label=f"weights, grads, {optimizer} state ({dtype})")
    for k, style in (("naive", "C3-"), ("tiled", "C1--"), ("sdpa", "C0-")):
        tot = [train_memory(cfg, batch, T, dtype, k, optimizer)["total"] / gib for T in Ts]
        ax2.plot(Ts, tot, style, label=f"training memory, {k} kernel")
    kv = [kv_cache_bytes(cfg, T, batch, dtype) / gib for T in Ts]
    ax2.plot(Ts, kv, "C4:", label=f"KV cache ({dtype})")
    if memory:
        ax2.axhline(memory / gib, color="C7", ls="--", label=f"memory {memory / 1e9:.0f} GB")
    ax2.set(xscale="log", yscale="log", xlabel="context length T (tokens)", ylabel="GiB",
            title=f"memory, batch {batch}")
    ax2.legend(fontsize=8)
    fig.suptitle(title or f"{num_weights(cfg):,} weights: L={cfg.n_layers} D={cfg.dim} N={cfg.n_heads} "
                 f"K={cfg.n_kv_heads} F={cfg.ffn_dim} V={cfg.vocab_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
