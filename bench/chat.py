"""Time to first token of a chat reply, turn 1 against turn 5 of one conversation (ChatSession,
ChatML), on the reference shape: with the session's prefix reuse (each turn prefills only what
is new) and, for contrast, with the cache dropped before every turn (the whole conversation
prefilled again). The first token is timed at the head's first call of the turn (its logits ready).

    python bench/chat.py [--rounds 5] [--threads 2] [--new-tokens 48] [--quick]
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


def one_conversation(model, tok, new_tokens: int, reuse: bool) -> tuple[list[float], list[int]]:
    """(seconds to the first token of each turn's reply, tokens prefilled in each turn)."""
    first: list[float] = []
    hook = model.lm_head.register_forward_hook(lambda *_: first.append(time.perf_counter()) if len(first) == 0 else None)
    convo = ChatSession(model, tok, system=SYSTEM, max_new_tokens=new_tokens, greedy=True)
    convo.eos = []  # every reply the same length: new_tokens (a random model's eos would end it anywhere)
    ttft, prefilled = [], []
    try:
        for text in TURNS:
            if not reuse:
                convo.session.reset()
            before, first[:] = convo.session.prefilled_tokens, []
            t0 = time.perf_counter()
            for _ in convo.say(text):
                pass
            ttft.append(first[0] - t0)
            prefilled.append(convo.session.prefilled_tokens - before)
    finally:
        hook.remove()
    return ttft, prefilled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 16 new tokens (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 2, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**REFERENCE_SHAPE, "vocab_size": tok.vocab_size})).eval()
    one_conversation(model, tok, 4, True)  # warm-up: allocator, held row copies
    res = {"threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
           "shape": {**REFERENCE_SHAPE, "vocab_size": tok.vocab_size}, "new_tokens": args.new_tokens,
           "rounds": args.rounds}
    for name, reuse in (("reuse", True), ("reprefill", False)):
        runs = []
        for _ in range(args.rounds):
            ttft, prefilled = one_conversation(model, tok, args.new_tokens, reuse)
            runs.append(ttft)
        med = [statistics.median(r[i] for r in runs) for i in range(len(TURNS))]
        res[name] = {"ttft_ms": [round(1e3 * t, 2) for t in med], "prefilled": prefilled,
                     "turn5_over_turn1": round(med[-1] / med[0], 3)}
        print(f"{name:9s}: time to first token by turn (ms) {res[name]['ttft_ms']}; tokens prefilled {prefilled}; "
              f"turn 5 / turn 1 = {res[name]['turn5_over_turn1']:.2f}x")
    write_json(RESULTS / "chat.json", res, indent=2)


if __name__ == "__main__":
    main()
