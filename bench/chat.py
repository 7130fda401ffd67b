"""Chat: time to first token of a reply by turn, and fine-tuning's tokens/s against plain training.

Time to first token: turn 1 against turn 5 of one conversation (ChatSession, ChatML) on the
reference shape, with the session's prefix reuse (each turn prefills only what is new) and, for
contrast, with the cache dropped before every turn (the whole conversation prefilled again); timed
at the head's first call of the turn (its logits ready). Training: train_step on the chat preset's
shape (the demo's fine-tune), batch 8 x 256, masked (3 of 4 targets -1, about the demo data's share)
against plain, rounds alternating, the best round of each, freed memory kept as `train` runs.

    flock /tmp/glassformer-bench.lock python bench/chat.py [--part ttft|training|both] [--rounds 5]
        [--threads 2] [--new-tokens 48] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.generation.chat import ChatSession  # noqa: E402
from glassformer.text.chat_template import CHAT_TOKENS, CHATML_TEMPLATE  # noqa: E402
from glassformer.text.tokenizer import EOT, Tokenizer  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SYSTEM = "You are a courtier of Elsinore; answer as one would at the court of the Danish king."
TURNS = [
    "Good morrow, my lord. What news from the court this morning, and who rides to Norway?",
    "Is it true the king drinks deep tonight, and that the cannon speak at every health he takes?",
    "They say a ghost walks the platform at midnight, armed from head to foot. Have you seen it?",
    "What would you have me tell the prince, if he asks me where his father's friends have gone?",
    "Then farewell, and may the night be kinder to you than the day has been to all of us here.",
]


def tokenizer() -> Tokenizer:
    text = " ".join([SYSTEM, *TURNS]) * 50
    tok = Tokenizer.train([text], vocab_size=1024, special_tokens=(EOT, *CHAT_TOKENS))
    tok.chat_template = CHATML_TEMPLATE
    return tok


REPLY = ("My lord, the king doth wake tonight and takes his rouse, keeps wassail, and the swaggering "
         "up-spring reels; and as he drains his draughts of Rhenish down, the kettle-drum and trumpet thus bray out "
         "the triumph of his pledge. ") * 4


class Head:
    """A hook on the head: notes the time of its first call in a turn and, given a script, makes
    the model say those ids (a trained model's replies are mostly the ids their text encodes to;
    a random model's are not, and each such reply is prefilled again on the next turn)."""

    def __init__(self, model):
        self.first: list[float] = []
        self.script: list[int] = []
        self.handle = model.lm_head.register_forward_hook(self)

    def __call__(self, module, args, out):
        if not self.first:
            self.first.append(time.perf_counter())
        if self.script:
            bump = torch.zeros(out.shape[-1], dtype=out.dtype)
            bump[self.script.pop(0)] = 1e4
            return out + bump
        return out


def one_conversation(model, tok, new_tokens: int, reuse: bool, scripted: bool) -> tuple[list[float], list[int]]:
    """(seconds to the first token of each turn's reply, tokens prefilled in each turn)."""
    head = Head(model)
    convo = ChatSession(model, tok, system=SYSTEM, max_new_tokens=new_tokens, greedy=True)
    convo.eos = []  # every reply the same length: new_tokens (a random model's eos would end it anywhere)
    ttft, prefilled = [], []
    try:
        for i, text in enumerate(TURNS):
            if not reuse:
                convo.session.reset()
            before, head.first[:] = convo.session.prefilled_tokens, []
            head.script = tok.encode(REPLY[i * 7:])[1:new_tokens + 1] if scripted else []
            t0 = time.perf_counter()
            for _ in convo.say(text):
                pass
            ttft.append(head.first[0] - t0)
            prefilled.append(convo.session.prefilled_tokens - before)
    finally:
        head.handle.remove()
    return ttft, prefilled


def training(rounds: int, steps: int = 3) -> dict:
    """Tokens/s of masked and plain train_step on the same shape, batch and weights."""
    from glassformer.train.cpu_memory import keep_freed_memory
    from glassformer.train.optim import make_optimizer
    from glassformer.train.step import train_step

    B, T, V = 8, 256, 2050
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("chat", vocab_size=V, max_seq_len=T)).train()
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), torch.device("cpu"))
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    y_masked = torch.where(torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < 0.75, -1, y)
    runs = {"plain": lambda: train_step(model, opt, x, y, grad_clip=1.0),
            "masked": lambda: train_step(model, opt, x, y_masked, grad_clip=1.0, masked=True)}
    best = {k: float("inf") for k in runs}
    with keep_freed_memory(True):
        for fn in runs.values():
            fn()  # warm-up
        for r in range(rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                for _ in range(steps):
                    t = time.perf_counter()
                    runs[name]()
                    best[name] = min(best[name], time.perf_counter() - t)
    tps = {k: round(B * T / v) for k, v in best.items()}
    res = {"shape": "chat preset", "batch": [B, T], "vocab_size": V, "masked_share": 0.75,
           "tokens_per_s": tps, "masked_over_plain": round(tps["masked"] / tps["plain"], 4)}
    print(f"training : tokens/s plain {tps['plain']:,}, masked {tps['masked']:,} "
          f"(masked / plain = {res['masked_over_plain']:.3f})")
    return res


def ttft(rounds: int, new_tokens: int) -> dict:
    tok = tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**REFERENCE_SHAPE, "vocab_size": tok.vocab_size})).eval()
    one_conversation(model, tok, 4, True, True)  # warm-up: allocator, held row copies
    res = {"shape": {**REFERENCE_SHAPE, "vocab_size": tok.vocab_size}, "new_tokens": new_tokens}
    kinds = {"reuse": (True, True), "reuse, the random model's own replies": (True, False),
             "reprefill": (False, True)}
    runs = {name: [] for name in kinds}
    for r in range(rounds):  # rounds alternate among the kinds: a change in load hits all alike
        for name, (reuse, scripted) in kinds.items():
            times, prefilled = one_conversation(model, tok, new_tokens, reuse, scripted)
            runs[name].append((times, prefilled))
    for name in kinds:
        prefilled = runs[name][-1][1]
        med = [statistics.median(t[i] for t, _ in runs[name]) for i in range(len(TURNS))]
        res[name] = {"ttft_ms": [round(1e3 * t, 2) for t in med], "prefilled": prefilled,
                     "turn5_over_turn1": round(med[-1] / med[0], 3)}
        print(f"{name}: time to first token by turn (ms) {res[name]['ttft_ms']}; tokens prefilled {prefilled}; "
              f"turn 5 / turn 1 = {res[name]['turn5_over_turn1']:.2f}x")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--part", choices=["ttft", "training", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 16 new tokens (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 2, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    res = {"threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
           "rounds": args.rounds}
    if args.part in ("ttft", "both"):
        res["ttft"] = ttft(args.rounds, args.new_tokens)
    if args.part in ("training", "both"):
        res["training"] = training(args.rounds, steps=1 if args.quick else 3)
    write_json(RESULTS / "chat.json", res, indent=2)


if __name__ == "__main__":
    main()
