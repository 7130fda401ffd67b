"""What the chat template limits cost per render (docs/chat.md#rendering-safely).

Side by side in one process, on Llama 3 and ChatML (Qwen-style) templates and a conversation of
--messages messages (a system prompt, then user and assistant turns of about 200 characters):
  plain    jinja2's ImmutableSandboxedEnvironment configured as transformers configures it
           (trim_blocks, lstrip_blocks, loopcontrols), no limits: about what rendering cost before
           the limits (the signal timer they replace added a setitimer pair besides)
  limited  glassformer.text.chat_template.render: the same sandbox with every limit
           (text/template_limits.py), and the plain-JSON copy of the messages it always made
Each is the median over --rounds rounds of the mean of --renders renders, the two interleaved.
The goal: limited - plain <= 2 ms a render.

    python bench/chat_template.py [--messages 10] [--renders 500] [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from _common import write_json
from glassformer.text.chat_template import render

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML}
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
LINE = "The king and queen walk to the castle; what news from the court, my lord? "


def conversation(n: int) -> list[dict]:
    turns = [{"role": "system", "content": "You are a helpful assistant. " * 4}]
    for i in range(n - 1):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: " + LINE * 3})
    return turns


def mean_us(fn, renders: int) -> float:
    t0 = time.perf_counter()
    for _ in range(renders):
        fn()
    return 1e6 * (time.perf_counter() - t0) / renders


def measure(template: str, messages: list[dict], renders: int, rounds: int) -> dict:
    plain_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    compiled = plain_env.from_string(template)
    ways = {
        "plain": lambda: compiled.render(messages=messages, add_generation_prompt=True, **SPECIAL),
        "limited": lambda: render(template, messages, add_generation_prompt=True, special=SPECIAL),
    }
    assert ways["plain"]() == ways["limited"](), "the two renders differ"
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            times[name].append(mean_us(fn, renders))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"plain_us": round(med["plain"], 1), "limited_us": round(med["limited"], 1),
            "added_us": round(med["limited"] - med["plain"], 1), "chars": len(ways["plain"]())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10)
    ap.add_argument("--renders", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer renders and rounds (a smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_template.json"))
    args = ap.parse_args()
    renders, rounds = (50, 3) if args.quick else (args.renders, args.rounds)
    results = {}
    print(f"{'template':>8} {'messages':>8} {'chars':>6} {'plain us':>9} {'limited us':>11} {'added us':>9}")
    for n in sorted({args.messages, 100}):
        for name, template in TEMPLATES.items():
            r = measure(template, conversation(n), renders if n <= args.messages else max(renders // 10, 5), rounds)
            results[f"{name}_{n}"] = {"template": name, "messages": n, **r}
            print(f"{name:>8} {n:>8} {r['chars']:>6} {r['plain_us']:>9.1f} {r['limited_us']:>11.1f} {r['added_us']:>9.1f}")
    write_json(args.out, {"python": platform.python_version(), "machine": platform.machine(),
                          "renders": renders, "rounds": rounds, "results": results})


if __name__ == "__main__":
    main()
