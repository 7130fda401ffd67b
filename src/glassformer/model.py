"""The Transformer: embedding, L blocks of attention and feed-forward, final norm, LM head.

Readable top to bottom; the math lives in small pure functions (`rope_angles`,
`apply_rope`), the modules only hold weights. Imports torch alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import get_kernel
from .attention.show import show_scores
from .config import ModelConfig
from .moe import MoE
from .norms import OffsetRMSNorm
from .probes import tap, wants
from .rope_scaling import attention_factor, scale_inv_freq

# ----------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · γ (Zhang & Sennrich, 2019): LayerNorm without the mean."""

    def __init__(self, dim: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # in fp32 whatever the input dtype: the mean of squares overflows fp16
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., D)
        y = self.weight * y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = cfg.dim if dim is None else dim
    if cfg.norm == "rms":
        return (OffsetRMSNorm if cfg.norm_offset else RMSNorm)(dim, cfg.norm_eps, bias=cfg.bias)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / √(mean(x²) + ε) over each head's H features, with no weight: QK norm (nanochat's
    `norm(q), norm(k)`), in fp32 whatever the input dtype. x: (B, T, heads, H)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (B, T, heads, H)
    return y.to(x.dtype)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(logits / cap): logits squashed smoothly into (−cap, cap), about unchanged where
    |logit| ≪ cap (Gemma 2, Team et al., 2024; modded-nanogpt's head)."""
    return cap * torch.tanh(logits / cap)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Radians per position for each of the H/2 pairs: theta^(-2i/H), pair 0 turning 1 rad; rescaled
    for long contexts by cfg.rope_scaling (rope_scaling.py). local: the sliding layers' table, with
    base rope_local_theta and no scaling (Gemma 3)."""
    H, theta = cfg.head_dim, cfg.rope_local_theta if local else cfg.rope_theta
    # fp32 throughout, as Meta and Hugging Face compute it, so the angles agree bit for bit.
    inv = 1.0 / (theta ** (torch.arange(0, H, 2, dtype=torch.int64).float() / H))  # (H/2,)
    sc = None if local else cfg.rope_scaling
    return inv if sc is None else scale_inv_freq(inv, sc, theta, H)


def rope_angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position · frequency, each (B, T, H/2), computed in fp32."""
    angles = pos.float()[..., None] * inv_freq  # (B, T, H/2)
    return angles.cos(), angles.sin()


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, pairs: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (B, T, 1, H), laid out so that rotating x is x·cos + swap(x)·sin, where
    swap exchanges the two features of each pair. Built once per forward, shared by every layer."""
    if pairs == "half":  # pair (i, i + H/2): swap(x) = (b, a)
        c, s = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # (B, T, H) each
    else:  # pairs (2i, 2i+1)
        c, s = torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)  # (B, T, H)
    return c[:, :, None], s[:, :, None]  # (B, T, 1, H)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str = "half") -> torch.Tensor:
    """x (B, T, heads, H) turned by the tables of rope_tables: (a cos − b sin, a sin + b cos) for each
    feature pair (a, b), in fp32. The same numbers as the pair-by-pair formula (tests/model): a fused
    multiply-add (addcmul) would round once instead of twice, and checkpoints would change their logits."""
    xf = x.float()  # (B, T, heads, H) in fp32
    H = x.shape[-1]
    if pairs == "half":
        swapped = xf.roll(H // 2, dims=-1)  # (b, a) for each pair (a, b)
    else:
        swapped = xf.unflatten(-1, (H // 2, 2)).flip(-1).flatten(-2)  # (B, T, h, H)
    out = xf * cos + swapped * sin
    return out.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str = "half") -> torch.Tensor:
    """Turn each feature pair (a, b) of x (B, T, heads, H) by its angle: (a cos − b sin, a sin + b cos).

    pairs='half' pairs feature i with i + H/2 (Hugging Face layout); 'interleaved' pairs
    2i with 2i+1 (Meta's layout). Same rotation, different feature order. cos, sin: (B, T, H/2).
    """
    return rotate(x, *rope_tables(cos, sin, pairs), pairs)


# ----------------------------------------------------------------------------- layers


class Attention(nn.Module):
    name = "attn"  # its path in the model (probe prefix), set by Transformer from the module tree

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg, self.window = cfg, cfg.window_at(layer)  # this layer's sliding window, or None
        qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attn_bias
        self.wq = nn.Linear(cfg.dim, cfg.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.dim, bias=cfg.bias or cfg.attn_bias)
        self.kernel = get_kernel(cfg.attention, cfg.attention_tile)
        self.ve: nn.Embedding | None = None  # value embeddings (V, K·H): set by Transformer on value_embed_layers
        # qk_norm with weights: 'head' H of them (Qwen3, Gemma 3), 'proj' N·H and K·H (OLMo 2)
        widths = {"head": (cfg.head_dim, cfg.head_dim), "proj": (cfg.q_dim, cfg.kv_dim)}.get(cfg.qk_norm)
        self.q_norm, self.k_norm = (make_norm(cfg, widths[0]), make_norm(cfg, widths[1])) if widths else (None, None)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None  # (N,): a logit per head
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5  # Gemma's

    def set_kernel(self, name: str) -> None:
        self.kernel = get_kernel(name, self.cfg.attention_tile)

    def forward(self, x, rope, q_pos, cache=None, key_mask=None, start=None, idx=None):
        cfg, n = self.cfg, self.name
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, N·H), (B, T, K·H), (B, T, K·H)
        q = tap(n + ".q", q.view(B, T, cfg.n_heads, cfg.head_dim))  # (B, T, N, H)
        k = tap(n + ".k", k.view(B, T, cfg.n_kv_heads, cfg.head_dim))  # (B, T, K, H)
        if self.ve is not None:  # v = x·W_V + the token's row of this layer's value embedding
            v = v + tap(n + ".ve", self.ve(idx).view(B, T, cfg.n_kv_heads, cfg.head_dim)).view(B, T, -1)  # (B, T, K·H)
        v = tap(n + ".v", v.view(B, T, cfg.n_kv_heads, cfg.head_dim))  # (B, T, K, H)
        if cfg.qk_norm:  # before RoPE (Qwen3's order; a weightless norm commutes with the rotation anyway)
            q = tap(n + ".q_norm", self.qk_normed(self.q_norm, q))
            k = tap(n + ".k_norm", self.qk_normed(self.k_norm, k))
        if rope is not None:  # rope: rope_tables' cos and signed sin, (B, T, 1, H) each
            q = tap(n + ".q_rot", rotate(q, *rope, cfg.rope_pairs))
            k = tap(n + ".k_rot", rotate(k, *rope, cfg.rope_pairs))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, H)
        if cache is not None:
            k, v = cache.update(q_pos, k, v)  # (B, K, Tk, H): every position so far
        extras = dict(window=self.window, scale=self.scale, softcap=cfg.attn_softcap, sinks=self.sinks)
        if wants(n + ".scores") or wants(n + ".weights"):  # the grid for a recorder (kernels may never form it)
            show_scores(n, q, k, q_pos, key_mask, **extras)
        z = self.kernel(q, k, v, q_pos=q_pos, key_mask=key_mask, start=start, **extras)  # (B, N, T, H)
        z = tap(n + ".z", z.transpose(1, 2))  # (B, T, N, H)
        return tap(n + ".out", self.wo(z.reshape(B, T, cfg.q_dim)))  # (B, T, D)

    def qk_normed(self, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, heads, H) normalised: per head without a weight (True), per head with one ('head'),
        or over every head's features together ('proj', OLMo 2's norm of the whole projection)."""
        if norm is None:
            return head_rms_norm(x, self.cfg.norm_eps)
        return norm(x.flatten(-2)).view_as(x) if self.cfg.qk_norm == "proj" else norm(x)


def ffn_activation(kind: str, up: torch.Tensor, gate: torch.Tensor | None = None, limit: float = 7.0) -> torch.Tensor:
    """The feed-forward's nonlinearity: silu(gate)·up for SwiGLU, gelu(gate)·up for GeGLU, else relu/relu²/gelu of up."""
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":  # GELU's tanh form as the gate (Shazeer, 2020; Gemma)
        return F.gelu(gate, approximate="tanh") * up
    if kind == "swiglu_clamp":  # gpt-oss: both clamped, gate·σ(1.702·gate), and the up projection shifted by 1
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(1.702 * gate))
    if kind == "relu":
        return F.relu(up)
    if kind == "relu2":  # squared ReLU (So et al., 2021, Primer; nanochat's MLP)
        return F.relu(up).square()
    if kind == "gelu":
        return F.gelu(up)
    return F.gelu(up, approximate="tanh")


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)) (Shazeer, 2020); or down(act(up(x))). width: F (an expert's)."""

    name = "ffn"  # its path in the model (probe prefix), set by Transformer from the module tree

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        self.cfg, F_, bias = cfg, cfg.ffn_dim if width is None else width, cfg.bias or cfg.ffn_bias
        self.w_up = nn.Linear(cfg.dim, F_, bias=bias)
        self.w_gate = nn.Linear(cfg.dim, F_, bias=bias) if cfg.gated else None
        self.w_down = nn.Linear(F_, cfg.dim, bias=bias)

    def forward(self, x):
        n, kind = self.name, self.cfg.ffn
        up = tap(n + ".up", self.w_up(x))  # (B, T, F)
        gate = tap(n + ".gate", self.w_gate(x)) if self.w_gate is not None else None  # (B, T, F)
        act = tap(n + ".act", ffn_activation(kind, up, gate, self.cfg.swiglu_limit))
        return tap(n + ".down", self.w_down(act))  # (B, T, D)


class Block(nn.Module):
    name = "block"  # its path in the model (probe prefix), set by Transformer from the module tree

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer)
        # ffn='none': an attention-only block (Elhage et al., 2021, "A Mathematical Framework for
        # Transformer Circuits"): no feed-forward norm or weights; the stream leaves after attention.
        self.ffn_norm = make_norm(cfg) if cfg.has_ffn else None
        self.ffn = (MoE(cfg, FeedForward) if cfg.is_moe(layer) else FeedForward(cfg)) if cfg.has_ffn else None
        sandwich = cfg.norm_placement == "sandwich"  # Gemma 2/3: a second norm on each sublayer's output
        self.attn_post_norm = make_norm(cfg) if sandwich else None
        self.ffn_post_norm = make_norm(cfg) if sandwich and cfg.has_ffn else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope, q_pos, cache=None, key_mask=None, start=None, idx=None):
        n = self.name
        if self.cfg.norm_placement != "post":
            # Pre-norm, sandwich, post-branch: the stream is never normalised; each branch (below) is added to it.
            a = self.branch("attn", x, lambda h: self.attn(h, rope, q_pos, cache, key_mask, start, idx))
            h = tap(n + ".resid_mid", x + self.drop(a))
            if self.ffn is None:
                return h
            f = self.branch("ffn", h, self.ffn)
            return tap(n + ".resid_out", h + self.drop(f))
        # Post-norm (Vaswani et al., 2017): normalise the stream after each addition.
        h = tap(n + ".resid_mid", x + self.drop(self.attn(x, rope, q_pos, cache, key_mask, start, idx)))
        h = tap(n + ".attn_norm", self.attn_norm(h))
        if self.ffn is None:
            return h
        y = tap(n + ".resid_out", h + self.drop(self.ffn(h)))
        return tap(n + ".ffn_norm", self.ffn_norm(y))

    def branch(self, part: str, x, sublayer):
        """One sublayer's branch: pre-norm sublayer(norm(x)); sandwich post_norm(sublayer(norm(x)))
        (Gemma 2); post_branch norm(sublayer(x)) (OLMo 2: the norm moved onto the branch's output)."""
        n, norm, post = self.name, getattr(self, part + "_norm"), getattr(self, part + "_post_norm")
        if self.cfg.norm_placement == "post_branch":
            return tap(f"{n}.{part}_norm", norm(sublayer(x)))
        y = sublayer(tap(f"{n}.{part}_norm", norm(x)))
        return y if post is None else tap(f"{n}.{part}_post_norm", post(y))


# ----------------------------------------------------------------------------- model


def _fill_tied_head(module, state_dict, prefix, *args) -> None:
    if prefix + "lm_head.weight" not in state_dict and prefix + "embed.weight" in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict[prefix + "embed.weight"]


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for i in cfg.value_embed_layers:  # state_dict key blocks.{i}.attn.ve.weight
            self.blocks[i].attn.ve = nn.Embedding(cfg.vocab_size, cfg.kv_dim)
        for path, m in self.named_modules():  # probe prefixes are module paths, as TransformerLens names its hooks
            if isinstance(m, (Block, Attention, FeedForward, MoE)):
                m.name = path
        if cfg.pos == "rope":
            self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.pos == "rope" and cfg.rope_local_theta is not None:
            self.register_buffer("rope_local_inv_freq", rope_inv_freq(cfg, local=True), persistent=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
            # A tied matrix is stored once (as embed.weight); loading re-ties it.
            self.register_load_state_dict_pre_hook(_fill_tied_head)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std); projections that write into the residual stream get std/√(2L)
        so the stream's variance does not grow with depth (GPT-2, Radford et al., 2019)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights (w of (1 + w) under norm_offset) and attention sinks
                p.fill_(0.0 if self.config.norm_offset or name.endswith("sinks") else 1.0)
            elif name.endswith(("wo.weight", "w_down.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.config.n_layers))
            else:
                p.normal_(0.0, std)
        for local in (False, True):
            f = getattr(self, "rope_local_inv_freq" if local else "rope_inv_freq", None)
            if f is not None and f.device.type != "meta":
                f.copy_(rope_inv_freq(self.config, local))

    def _apply(self, fn, recurse=True):
        # RoPE's frequencies never drop below fp32 whatever .to() makes of the weights (Hugging Face
        # does the same): in bf16 they keep 3 digits, and late positions would turn by wrong angles.
        super()._apply(fn, recurse)
        for local, name in ((False, "rope_inv_freq"), (True, "rope_local_inv_freq")):
            f = getattr(self, name, None)
            if f is not None and f.element_size() < 4 and f.device.type != "meta":
                setattr(self, name, rope_inv_freq(self.config, local).to(f.device))
        return self

    def num_params(self, non_embedding: bool = False) -> int:
        """Weights counted once (tied matrices once). non_embedding drops token and position tables.
        A module that holds its weight quantized keeps it as a buffer named weight: counted too."""
        n = sum(p.numel() for p in self.parameters())
        n += sum(b.numel() for name, b in self.named_buffers() if name.rsplit(".", 1)[-1] == "weight")
        if non_embedding:
            n -= self.embed.weight.numel()
            if self.pos_embed is not None:
                n -= self.pos_embed.weight.numel()
        return n

    def set_attention(self, name: str) -> None:
        """Switch every layer to another kernel ('naive', 'tiled', 'sdpa'); weights unchanged."""
        get_kernel(name)  # validates the name
        self.config.attention = name
        for b in self.blocks:
            b.attn.set_kernel(name)

    def forward(self, idx, targets=None, cache=None, pos=0, padding_mask=None, logits_at=None):
        """Logits (B, T, V) for every position, and the mean cross-entropy if targets are given.

        idx, targets: (B, T) ids (targets -1: no loss there); pos: an int or a (B,) tensor, where each
        row starts; cache: a KVCache; padding_mask: (B, Tk) bool, False on keys never to be read;
        logits_at: (B,), one position per row, logits (B, 1, V). docs/model.md#positions-the-kv-cache-and-batches
        """
        cfg = self.config
        B, T = idx.shape
        q_pos = self._positions(pos, B, T, idx.device)  # (B, T)
        start = None if isinstance(pos, torch.Tensor) and pos.dim() > 0 else int(pos)
        if cache is not None:
            cache.prepare(pos, T)
        x = self.embed(idx)  # (B, T, D)
        if cfg.embed_scale:  # Gemma: times √D, rounded to the weights' dtype as Gemma rounds it
            x = x * torch.tensor(cfg.dim**0.5, dtype=x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed(q_pos)  # (B, T, D)
        x = tap("embed", self.drop(x))
        kinds = [cfg.rope_kind(i) for i in range(cfg.n_layers)]  # 'global', 'local' or None, per layer
        ropes = {kind: self.rope(q_pos, kind) for kind in set(kinds) - {None}}  # built once, shared by layers
        for i, block in enumerate(self.blocks):
            x = block(x, ropes.get(kinds[i]), q_pos, None if cache is None else cache.layer(i), padding_mask, start, idx)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at.to(x.device)][:, None]  # (B, 1, D)
        x = tap("final_norm", self.final_norm(x))
        logits = tap("logits", self.unembed(x))  # (B, T, V)
        if wants("probs"):
            tap("probs", torch.softmax(logits.float(), dim=-1))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def rope(self, q_pos: torch.Tensor, kind: str = "global") -> tuple[torch.Tensor, torch.Tensor]:
        """rope_tables for positions q_pos (B, T): the global table, or the sliding layers' ('local');
        YaRN's attention factor multiplies cos and sin (rope_scaling.py)."""
        local = kind == "local"
        cos, sin = rope_angles(q_pos, self.rope_local_inv_freq if local else self.rope_inv_freq)  # (B, T, H/2) each
        f = attention_factor(None if local else self.config.rope_scaling)  # 1 unless YaRN (times 1 is exact)
        return rope_tables(cos * f, sin * f, self.config.rope_pairs)

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """The head: final-norm output (..., D) -> logits (..., V), soft-capped when logit_softcap is set
        (the logit lens reads the same function)."""
        cap = self.config.logit_softcap
        if cap is None:
            return self.lm_head(x)
        return softcap(tap("head.uncapped", self.lm_head(x)), cap)  # (..., V)

    def _positions(self, pos, B: int, T: int, device) -> torch.Tensor:
        steps = torch.arange(T, device=device)  # (T,)
        if isinstance(pos, torch.Tensor) and pos.dim() > 0:
            if pos.shape != (B,):
                raise ValueError(f"pos must be an int or a ({B},) tensor, got shape {tuple(pos.shape)}")
            q_pos = pos.to(device)[:, None] + steps  # (B, T)
        else:
            q_pos = (int(pos) + steps).expand(B, T)  # (B, T)
            if int(pos) + T > self.config.max_seq_len:
                raise ValueError(f"positions {int(pos)}..{int(pos) + T - 1} exceed the model's context of {self.config.max_seq_len} "
                                 "tokens: shorten the input or use a model with a longer max_seq_len")
        return q_pos
