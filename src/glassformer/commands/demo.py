"""`glassformer demo`: the main job (what `make demo` runs)."""

from __future__ import annotations

HELP = "the main job: build the small model, run it and show what it costs"


def add_arguments(p) -> None:
    p.add_argument("--out", default="demo-out", help="folder for everything the demo writes")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import torch

    from ..config import ModelConfig
    from ..kv_cache import KVCache
    from ..model import Transformer

    torch.manual_seed(args.seed)
    cfg = ModelConfig.from_preset("small")
    model = Transformer(cfg).eval()
    print(f"small preset: {model.num_params():,} weights, {cfg.n_layers} layers, width {cfg.dim}, "
          f"{cfg.n_heads} query heads / {cfg.n_kv_heads} KV heads")
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        logits, _ = model(ids)
        print(f"forward: ids {tuple(ids.shape)} -> logits {tuple(logits.shape)}")
        cache = KVCache.for_model(model, 1, 64)
        logits, _ = model(ids, cache=cache, pos=0)
        out, pos = [], ids.shape[1]
        for _ in range(16):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            out.append(int(nxt))
            logits, _ = model(nxt, cache=cache, pos=pos)
            pos += 1
    print(f"greedy ids from random weights: {out}")
    return 0
