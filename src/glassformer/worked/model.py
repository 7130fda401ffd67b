"""The walkthrough's toy model: every number of the hand calculation, computed by the real model.
"I like cats too" through `Transformer`s small enough to check on paper (six words, D = 4, one
head of H = 2, a ReLU FFN of F = 8): build_one_head, build_two_blocks, build_four_heads,
build_gqa, build_mqa (docs/worked.md#the-family-of-models-glassformerworkedmodel).
>>> encode("I like cats too")
[0, 2, 3, 5]
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..convert.heads import convert_kv_heads
from ..cost.memory import kv_cache_numbers_per_token
from ..errors import UserError
from ..model import Transformer
from ..probes import set_recorder, stream_points
from ..tracing.stream import stream_rms as rms  # noqa: F401  (the one stream RMS, re-exported)
from ..tracing.tiles import kernel_walk

SENTENCE = "I like cats too"

# ----------------------------------------------------------------------------- words


class WordTokenizer:
    """One id per word over a fixed vocabulary; the toy stand-in for the BPE tokenizer, with
    Tokenizer's interface (encode, decode, vocab_size, eot_id, id_to_piece). Words are split on
    whitespace and matched ignoring case.
    >>> WordTokenizer().decode([0, 2, 4])
    'I like dogs'
    """

    VOCAB = ("I", "you", "like", "cats", "dogs", "too")

    def __init__(self) -> None:
        self._ids = {w.lower(): i for i, w in enumerate(self.VOCAB)}

    @property
    def vocab_size(self) -> int:
        return len(self.VOCAB)

    @property
    def eot_id(self) -> None:
        return None  # the toy vocabulary has no end-of-text word

    def id_to_piece(self, i: int) -> str:
        return self.VOCAB[i]

    def encode(self, text: str | list[str]) -> list[int]:
        words = text.split() if isinstance(text, str) else list(text)
        if not words:
            raise UserError(f"no words given; the toy model reads words from its vocabulary: {', '.join(self.VOCAB)}")
        unknown = [w for w in words if w.lower() not in self._ids]
        if unknown:
            raise UserError(
                f"unknown word {unknown[0]!r}: the toy model knows only the six words "
                f"{', '.join(self.VOCAB)} (separate them by spaces, no punctuation)"
            )
        return [self._ids[w.lower()] for w in words]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.VOCAB[i] for i in ids)

    def save(self, path: str) -> None:
        """Write a `tokenizers` WordLevel tokenizer.json (so a toy checkpoint folder is complete).

        The file matches words exactly (case-sensitive) and has no unknown-word token, so the
        `tokenizers` library refuses other words, as this class does.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(self.VOCAB)}, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
        tk.save(str(path))


TOKENIZER = WordTokenizer()


def encode(text: str | list[str]) -> list[int]:
    """Word ids of a text (or a list of words) over I/you/like/cats/dogs/too."""
    return TOKENIZER.encode(text)


# ----------------------------------------------------------------------------- weights
# All matrices in math layout [in, out] (x @ W), as the walkthrough writes them; nn.Linear
# stores the transpose. Rows of the embedding are word ids 0..5.

EMBEDDING = [
    [-1, -1, -1, -1],  # 0 I     chosen
    [1, 1, 1, 1],      # 1 you   unused by the figures: chosen as the opposite of I
    [-1, 1, -1, 1],    # 2 like  chosen
    [1, 1, -1, -1],    # 3 cats  printed
    [1, 1, -1, 1],     # 4 dogs  unused by the figures: one sign away from cats
    [-1, -1, 1, 1],    # 5 too   chosen as the opposite of cats (its printed query forces 3 of 4 signs)
]
W_Q = [[0, -0.5], [0, 0], [0, 0.5], [-1, 0]]       # printed (its two columns)
W_K = [[0, 0], [-0.5, -1], [0, 0], [-0.5, 0.5]]    # chosen: gives the printed keys of I, cats, too
W_V = [[0, -1], [1, 0], [0, 0], [-0.5, 0.5]]       # chosen: gives the printed values
# W_O copies the head's 2 numbers into features 0 and 1 and adds half of each to features 3 and 2.
W_O = [[1, 0, 0, 0.5], [0, 1, 0.5, 0]]
W_UP = [  # column j is what hidden unit j looks for; column 0 is printed
    # 0   1   2   3   4   5   6   7
    [0, -1, 0, 0, 0, 0, 0, 1],
    [1, 0, 0, 0, 0, -1, 0, -1],
    [0, 0, 0, -1, 1, 0, 0, 0],
    [-1, 0, 1, 0, 0, 1, -1, 0],
]
# Each hidden unit writes ±0.5 into one feature. Units 0 and 5 (a ± pair) write |x1 − x3|/2 into
# feature 1; units 3 and 4 (a ± pair, opposite signs) pass x2/2 through.
W_DOWN = [
    [0, 0.5, 0, 0],
    [0.5, 0, 0, 0],
    [0.5, 0, 0, 0],
    [0, 0, -0.5, 0],
    [0, 0, 0.5, 0],
    [0, 0.5, 0, 0],
    [0, 0, 0, -0.5],
    [0, 0, 0, -0.5],
]
# The four-head model: head 0 is the single head above. Head 1 is pinned down by the MHA and
# GQA figures (its key of I is printed). Heads 2 and 3 enter no figure: they read features
# (0, 1) and (2, 3) plainly. W_O: head 0 as above, heads 1-3 add half their output to a pair.
HEADS_QKV = [
    (W_Q, W_K, W_V),
    ([[0, 0], [1, 0], [-0.5, -1], [0, 0]], [[0, 0], [0.5, 0], [0, 0], [0, 1]], [[0, 0], [0, 0], [0, 0], [-0.5, -0.5]]),
    ([[1, 0], [0, 1], [0, 0], [0, 0]],) * 3,
    ([[0, 0], [0, 0], [1, 0], [0, 1]],) * 3,
]
W_O_HEADS = [W_O, [[0, 0, 0.5, 0], [0, 0, 0, 0.5]], [[0.5, 0, 0, 0], [0, 0.5, 0, 0]], [[0, 0, 0.5, 0], [0, 0, 0, 0.5]]]


def config(n_layers: int = 1, n_heads: int = 1, norm_placement: str = "pre") -> ModelConfig:
    """The toy shape. With H = 2 RoPE has one pair, which turns theta^0 = 1 radian per position
    whatever rope_theta is; the LM head is the embedding (tied), so logits are similarities."""
    return ModelConfig(
        vocab_size=TOKENIZER.vocab_size, dim=4, n_layers=n_layers, n_heads=n_heads, head_dim=2, ffn_dim=8,
        max_seq_len=16, norm_eps=1e-6, norm="rms", norm_placement=norm_placement, ffn="relu", pos="rope",
        rope_theta=10000.0, tie_embeddings=True, attention="naive",
    )


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@torch.no_grad()
def _build(cfg: ModelConfig, heads) -> Transformer:
    model = Transformer(cfg).eval()
    model.embed.weight.copy_(_t(EMBEDDING))
    wq = torch.cat([_t(q) for q, _, _ in heads], dim=1)  # (D, N·H)
    wk = torch.cat([_t(k) for _, k, _ in heads], dim=1)  # (D, K·H)
    wv = torch.cat([_t(v) for _, _, v in heads], dim=1)  # (D, K·H)
    wo = torch.cat([_t(o) for o in (W_O_HEADS[: len(heads)] if len(heads) > 1 else [W_O])], dim=0)  # (N·H, D)
    for b in model.blocks:  # every block gets the same weights: the walkthrough stacks one block twice
        b.attn.wq.weight.copy_(wq.T)
        b.attn.wk.weight.copy_(wk.T)
        b.attn.wv.weight.copy_(wv.T)
        b.attn.wo.weight.copy_(wo.T)
        b.ffn.w_up.weight.copy_(_t(W_UP).T)
        b.ffn.w_down.weight.copy_(_t(W_DOWN).T)
    return model  # norms keep γ = 1 from reset_parameters


def build_one_head() -> Transformer:
    """One block with one head of size 2: the model of the single-layer sections."""
    return _build(config(), HEADS_QKV[:1])


def build_two_blocks(norm_placement: str = "pre") -> Transformer:
    """The same block stacked twice, with the norms before ('pre') or after ('post') each addition."""
    return _build(config(n_layers=2, norm_placement=norm_placement), HEADS_QKV[:1])


def build_four_heads() -> Transformer:
    """Four query heads, each with its own key and value head (MHA)."""
    return _build(config(n_heads=4), HEADS_QKV)


def build_gqa() -> Transformer:
    """Four query heads, 2 key/value heads: heads 0-1 and 2-3 share the mean of their W_K and W_V."""
    return convert_kv_heads(build_four_heads(), 2)


def build_mqa() -> Transformer:
    """Four query heads sharing one key/value head, the mean of all four."""
    return convert_kv_heads(build_four_heads(), 1)


def load_worked(variant: str = "one_head") -> tuple[Transformer, WordTokenizer]:
    """(model, tokenizer) of one toy model, like checkpoint.load: for `trace --worked`, `view --worked`."""
    if variant not in MODELS:
        raise UserError(f"unknown toy model {variant!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[variant](), TOKENIZER


MODELS = {"one_head": build_one_head, "two_blocks_pre": build_two_blocks,
          "two_blocks_post": lambda: build_two_blocks("post"), "mha": build_four_heads,
          "gqa": build_gqa, "mqa": build_mqa}


# ----------------------------------------------------------------------------- running


class _Record:
    """A probe recorder that keeps row 0 of every probe (see probes.py)."""

    def __init__(self) -> None:
        self.t: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        self.t[name] = x.detach()[0].clone()
        return x

    def wants(self, name: str) -> bool:
        return True


@torch.no_grad()
def run(model: Transformer, ids: list[int], **forward_args) -> dict[str, torch.Tensor]:
    """Every probe of one forward pass over `ids` (batch of one, batch axis dropped)."""
    rec = _Record()
    old = set_recorder(rec)
    try:
        model(torch.tensor([ids]), **forward_args)
    finally:
        set_recorder(old)
    return rec.t


def stream_rms(probes: dict[str, torch.Tensor], cfg: ModelConfig, token: int) -> list[float]:
    """RMS of one token's residual stream: at the embedding, then after every addition (the
    probes that hold the stream: probes.stream_points; the measure: tracing.stream.stream_rms)."""
    return [float(rms(probes[n][token])) for n in stream_points(cfg.n_layers, cfg.norm_placement)]


def kv_numbers_per_token(cfg: ModelConfig) -> int:
    """Numbers a KV cache keeps per token: a key and a value per layer per KV head, H each
    (the formula lives in cost.memory.kv_cache_numbers_per_token)."""
    return kv_cache_numbers_per_token(cfg)


def tile_walk(probes: dict[str, torch.Tensor], tile: int, row: int, layer: int = 0) -> dict:
    """The tiled (FlashAttention) kernel's walk of query row `row` (tracing.tiles.kernel_walk) on
    the model's own q, k, v: running m, l, o, alpha per key tile, every head."""
    n = f"blocks.{layer}.attn"
    walk = kernel_walk(probes[n + ".q_rot"], probes[n + ".k_rot"], probes[n + ".v"], row=row, tile=tile)
    assert torch.allclose(walk["output"], probes[n + ".z"], atol=1e-6), "tiled kernel disagrees with the model"
    return walk


__all__ = [
    "SENTENCE", "WordTokenizer", "TOKENIZER", "encode", "config", "build_one_head", "build_two_blocks",
    "build_four_heads", "build_gqa", "build_mqa", "MODELS", "load_worked", "run", "rms", "stream_rms", "kv_numbers_per_token",
    "tile_walk",
]
