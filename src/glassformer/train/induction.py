"""The induction-heads demo's data and measures (`glassformer demo --induction`,
docs/training.md#the-induction-heads-demo).

The data: blocks of T+1 tokens, an end-of-text token and then a segment of distinct random tokens
written again and again (r r r ...). Its length is drawn from [lo, hi] for each block, so the
distance between copies changes from block to block: a head that looks a fixed number of positions
back cannot do what an induction head does. The loss mask scores the tokens that copying from an
earlier copy can predict: every one after the first copy but the second copy's first.

The measure (Olsson et al., 2022, "In-context Learning and Induction Heads"): on sequences
[eot, r, r] with |r| = L, an induction head at query position i of the second copy attends to
the token after the earlier occurrence of the query's token, at key i − L + 1. A head's induction
score is its mean attention weight on that key over the second copy: 1 for a perfect induction
head, about 0 for a previous-token head (which attends to i − 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..probes import set_recorder

ALPHABET = "".join(chr(c) for c in range(33, 127))  # the 94 printable ASCII characters other than space

# The demo's recipe (`glassformer demo --induction`; the model is the `induction` preset). T: the
# block's context; lo, hi: segment lengths; eval_L: |r| of the held-out rows the score is taken on.
RECIPE = {
    "T": 64, "lo": 8, "hi": 24, "train_blocks": 4096, "val_blocks": 64, "data_seed": 0,
    "steps": 800, "every": 25, "batch_size": 16, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20,
    "eval_tokens": 16 * 65, "eval_rows": 16, "eval_L": 16, "eval_seed": 1,
    "view_text": "q7XkR2mfPzA9cLw4q7XkR2mfPzA9cLw4",
}


# ----------------------------------------------------------------------------- data


def byte_tokenizer():
    """Byte-level BPE with no merges: the 256 bytes and the end-of-text token (257 ids), so each
    character of ALPHABET is one token and any text of them round-trips id for id."""
    from ..text.tokenizer import Tokenizer

    return Tokenizer.train([ALPHABET], vocab_size=257)


def alphabet_ids(tok) -> np.ndarray:
    """The token id of each character of ALPHABET."""
    return np.array([tok.encode(c)[0] for c in ALPHABET], dtype=np.int64)  # (94,)


def repeat_block(rng: np.random.Generator, ids: np.ndarray, T: int, lo: int, hi: int, eot: int):
    """One block of T+1 tokens and its loss mask: eot, then a segment r of |r| distinct tokens drawn
    from ids, |r| from [lo, hi], written again and again to the block's end (cut there). The mask
    scores every token after the first copy but the second copy's first (its predecessor in the
    first copy is eot, so nothing copied predicts it).

    >>> tok, m = repeat_block(np.random.default_rng(0), np.arange(10, 60), 8, 3, 3, 0)
    >>> tok[1:4].tolist() == tok[4:7].tolist() == tok[7:].tolist() + [tok[3]], m.tolist()
    (True, [0, 0, 0, 0, 0, 1, 1, 1, 1])
    """
    L = int(rng.integers(lo, hi + 1))
    r = rng.choice(ids, L, replace=False)  # (L,) distinct: the earlier occurrence of a token is one position
    copies = np.tile(r, T // L + 1)[:T]  # (T,)
    mask = np.ones(T + 1, dtype=np.uint8)
    mask[:L + 2] = 0  # eot, the first copy, the second copy's first token
    return np.concatenate([[eot], copies]), mask


def repeat_blocks(n: int, T: int, lo: int, hi: int, ids: np.ndarray, eot: int, seed: int):
    """n blocks laid end to end: (tokens (n·(T+1),), mask (n·(T+1),))."""
    if not 2 <= lo <= hi <= min(len(ids), T // 2):
        raise ValueError(f"segment lengths need 2 <= lo <= hi <= min({len(ids)} tokens, T/2 = {T // 2}); got {lo}, {hi}")
    rng = np.random.default_rng(seed)
    pairs = [repeat_block(rng, ids, T, lo, hi, eot) for _ in range(n)]
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def write_repeat_data(out: str | Path, T: int, lo: int, hi: int, n_train: int, n_val: int, seed: int) -> dict:
    """A prepared data folder of repeat blocks (atomically): tokenizer.json, train/val .bin and
    .mask.bin, meta.json with "block": T+1 (windows drawn at block starts, text/data.py chat_block).
    Returns meta.json."""
    from ..files import atomic_folder

    tok = byte_tokenizer()
    ids = alphabet_ids(tok)
    splits = {"train": repeat_blocks(n_train, T, lo, hi, ids, tok.eot_id, seed),
              "val": repeat_blocks(n_val, T, lo, hi, ids, tok.eot_id, seed + 1)}
    meta = {"dtype": "uint16", "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "train_tokens": len(splits["train"][0]), "val_tokens": len(splits["val"][0]),
            # bits per byte over the scored tokens: one character, one byte each
            "train_bytes": int(splits["train"][1].sum()), "val_bytes": int(splits["val"][1].sum()),
            "corpus": f"repeated random segments of {lo}-{hi} of {len(ids)} characters (seed {seed})",
            "context": T, "block": T + 1, "tokenizer": "bytes", "repeats": {"lo": lo, "hi": hi, "seed": seed}}

    def write(tmp: Path) -> None:
        tok.save(tmp / "tokenizer.json")
        for split, (tokens, mask) in splits.items():
            tokens.astype("<u2").tofile(tmp / f"{split}.bin")
            mask.tofile(tmp / f"{split}.mask.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    atomic_folder(Path(out), write)
    return meta


def eval_batch(n: int, L: int, ids: np.ndarray, eot: int, seed: int) -> torch.Tensor:
    """The fixed held-out batch the score is measured on: n rows [eot, r, r], |r| = L: (n, 2L+1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        r = rng.choice(ids, L, replace=False).tolist()
        rows.append([eot] + r + r)
    return torch.tensor(rows)  # (n, 2L+1)


def eval_batch_for(recipe: dict) -> torch.Tensor:
    """The recipe's fixed held-out batch, with the byte tokenizer's ids."""
    tok = byte_tokenizer()
    return eval_batch(recipe["eval_rows"], recipe["eval_L"], alphabet_ids(tok), tok.eot_id, recipe["eval_seed"])


# ----------------------------------------------------------------------------- the score


def induction_scores(weights: torch.Tensor, L: int, start: int) -> list[float]:
    """Each head's mean attention weight from query i to key i − L + 1, over the queries
    i = start … T−1 (the second copy). weights: one layer's (B, T, N, Tk), as its probe holds them.

    >>> w = torch.zeros(1, 5, 1, 5); w[0, 3, 0, 2] = w[0, 4, 0, 3] = 1.0  # [eot, a, b, a, b], L = 2
    >>> induction_scores(w, 2, 3)
    [1.0]
    """
    B, T, N, _ = weights.shape
    q = torch.arange(start, T)  # (Q,)
    k = q - L + 1  # (Q,)
    on = weights[:, q, :, k]  # (B, Q, N): advanced indices q and k pair up
    return on.double().mean((0, 1)).tolist()  # (N,)


class _Weights:
    """A probes.Recorder that keeps the attention weights of every layer and nothing else."""

    def __init__(self, n_layers: int):
        self.names = {f"blocks.{i}.attn.weights" for i in range(n_layers)}
        self.seen: dict[str, torch.Tensor] = {}

    def wants(self, name: str) -> bool:
        return name in self.names

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self.names:
            self.seen[name] = x.detach().float().cpu()
        return x


@torch.no_grad()
def attention_weights(model, batch: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention weights on batch (B, T) in eval mode, as the probes show them: (B, T, N, T)."""
    rec = _Weights(model.config.n_layers)
    was = model.training
    model.eval()
    old = set_recorder(rec)
    try:
        model(batch.to(next(model.parameters()).device))
    finally:
        set_recorder(old)
        model.train(was)
    return [rec.seen[f"blocks.{i}.attn.weights"] for i in range(model.config.n_layers)]


def model_scores(model, batch: torch.Tensor) -> dict:
    """On an eval_batch (rows [eot, r, r]): 'induction_score', the largest head's score in the last
    layer; 'induction_heads' and 'previous_token_heads', {'blocks.i.attn': [score per head]}."""
    L = (batch.shape[1] - 1) // 2
    weights = attention_weights(model, batch)
    heads = {f"blocks.{i}.attn": induction_scores(w, L, L + 1) for i, w in enumerate(weights)}
    prev = {f"blocks.{i}.attn": previous_token_scores(w) for i, w in enumerate(weights)}
    return {"induction_score": max(heads[f"blocks.{len(weights) - 1}.attn"]), "induction_heads": heads,
            "previous_token_heads": prev}


# ----------------------------------------------------------------------------- the phase change


def phase_change(steps: list[int], values: list[float], rise: bool = True) -> int | None:
    """The step of the largest change between consecutive measurements (rise: the largest
    increase; else the largest decrease), named by the later one; None with fewer than two.

    >>> phase_change([0, 10, 20, 30], [0.0, 0.1, 0.8, 0.9]), phase_change([0, 10, 20], [5.0, 4.9, 1.0], rise=False)
    (20, 20)
    """
    if len(steps) < 2:
        return None
    d = np.diff(np.asarray(values, dtype=np.float64)) * (1 if rise else -1)
    return int(steps[int(np.argmax(d)) + 1])


# ----------------------------------------------------------------------------- a run's scores


def previous_token_scores(weights: torch.Tensor) -> list[float]:
    """Each head's mean attention weight from query i to key i − 1 (i ≥ 1): a previous-token head
    scores about 1. weights: one layer's (B, T, N, Tk)."""
    q = torch.arange(1, weights.shape[1])  # (T-1,)
    return weights[:, q, :, q - 1].double().mean((0, 1)).tolist()  # (N,)


def step_of(name: str) -> int:
    """The step of a checkpoint folder name: 'step-000120' -> 120."""
    return int(name.rsplit("-", 1)[1])


def score_run(run: str | Path, batch: torch.Tensor) -> list[dict]:
    """model_scores of every snapshot of a run (train --snapshot-every), oldest first, with its 'step'."""
    from ..checkpoint.folders import read_snapshots
    from ..checkpoint.loading import load

    rows = []
    for name in sorted(read_snapshots(run), key=step_of):
        model, _ = load(Path(run) / name)
        rows.append({"step": step_of(name), **model_scores(model, batch)})
    return rows


def score_records(rows: list[dict], records: list[dict]) -> list[dict]:
    """metrics.jsonl lines for the scores: 'induction_score', 'induction_heads', 'previous_token_heads',
    and the same under "stats" (the explorer's Training view draws each kind of it), merged with
    the statistics the run logged at that step (a step's last line is the one the view reads)."""
    logged: dict[int, dict] = {}
    for r in records:
        if isinstance(r.get("stats"), dict):
            logged[r["step"]] = r["stats"]
    out = []
    for row in rows:
        last = f"blocks.{len(row['induction_heads']) - 1}.attn"
        stats = {**logged.get(row["step"], {}),
                 "induction_score": {f"{last} max": row["induction_score"], **row["induction_heads"]},
                 "previous_token_score": row["previous_token_heads"]}
        out.append({**row, "stats": stats})
    return out


def summary(rows: list[dict], records: list[dict]) -> dict:
    """Where the phase change is: the step of the induction score's largest rise and of the held-out
    loss's largest drop between evaluations, with the values on either side."""
    steps, scores = [r["step"] for r in rows], [r["induction_score"] for r in rows]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    vsteps = sorted(val)
    jump, drop = phase_change(steps, scores), phase_change(vsteps, [val[s] for s in vsteps], rise=False)

    def around(xs: list[int], ys: list[float], at: int | None) -> list[float] | None:
        if at is None:
            return None
        i = xs.index(at)
        return [ys[i - 1], ys[i]]

    return {"jump_step": jump, "score_around_jump": around(steps, scores, jump),
            "drop_step": drop, "val_loss_around_drop": around(vsteps, [val[s] for s in vsteps], drop),
            "final_score": scores[-1] if scores else None, "final_val_loss": val[vsteps[-1]] if vsteps else None}


def plot_induction(records: list[dict], rows: list[dict], png: str | Path, found: dict) -> bool:
    """Loss (train and held-out) and the induction score against step in one picture, the phase
    change marked; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), color="C0", lw=0.8, alpha=0.5, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", color="C0", ms=3, lw=1.5, label="held-out loss")
    ax.set(xlabel="step", ylabel="loss (nats per scored token)")
    right = ax.twinx()
    steps = [r["step"] for r in rows]
    right.plot(steps, [r["induction_score"] for r in rows], "s-", color="C3", ms=3, label="induction score (layer 1)")
    right.plot(steps, [max(r["previous_token_heads"]["blocks.0.attn"]) for r in rows], "--", color="C2", lw=1,
               label="previous-token score (layer 0)")
    right.set(ylabel="attention score (best head)", ylim=(0, 1))
    for key, style in (("jump_step", "--"), ("drop_step", ":")):
        if found.get(key) is not None:
            ax.axvline(found[key], color="gray", ls=style, lw=1)
    lines = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="center left", fontsize=8)
    ax.set_title(f"induction score jumps at step {found.get('jump_step')}, held-out loss drops at {found.get('drop_step')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, format="png")
    plt.close(fig)
    return True
