"""glassformer's harness model against the harness's own `hf` model, same weights, same requests
(docs/benchmarks-log.md#harness).

A random Hugging Face Llama (saved by transformers, with a byte-level BPE tokenizer trained here)
is loaded by both; the harness builds the requests of two tasks written here as YAML + JSONL: a
multiple-choice task shaped like HellaSwag (a long context, four continuations of several words)
and a rolling-perplexity task (texts of several context windows). Each model's loglikelihood /
loglikelihood_rolling runs on the same requests at the same batch size, rounds alternating and
the best round counting: requests per second, the ratio, the largest log-likelihood difference,
and the memory each side's call takes at that batch size, measured in a fresh process for each
side and task (a process keeps what it freed, so a second call would show no growth): on a GPU
the allocator's peak above what the model holds, on a CPU the peak growth of the resident set
over the call, sampled every 2 ms.

    python bench/harness.py [--docs 64] [--batch-size 16] [--rounds 3] [--device cpu|cuda]
    python bench/harness.py --quick        # 24 documents, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

RESULTS = Path(__file__).parent / "results"
WORDS = ("the king and queen walk to the castle where a knight waits with his sword while the old man "
         "sings of the sea and the stars above the hill in a green field by the river at night").split()


def sentence(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(k))


def make_model(folder: Path, args) -> Path:
    """A random Llama of the bench's shape and a tokenizer, written by transformers."""
    import transformers

    from glassformer.text.tokenizer import EOT, Tokenizer

    rng = random.Random(0)
    tok = Tokenizer.train([sentence(rng, 40) + "." for _ in range(3000)], vocab_size=args.vocab)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, max_position_embeddings=args.context,
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eot_id)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tk, eos_token=EOT).save_pretrained(folder)
    return folder


def make_tasks(folder: Path, n_docs: int) -> Path:
    """bench_mc (context of ~60 words, 4 endings of 4-8 words) and bench_ppl (texts of ~300 words)."""
    rng = random.Random(1)
    folder.mkdir(parents=True, exist_ok=True)
    mc = [{"ctx": sentence(rng, rng.randint(40, 80)), "endings": [" " + sentence(rng, rng.randint(4, 8)) for _ in range(4)],
           "label": rng.randrange(4)} for _ in range(n_docs)]
    ppl = [{"text": ". ".join(sentence(rng, rng.randint(6, 14)) for _ in range(25))} for _ in range(max(2, n_docs // 8))]
    specs = {
        "bench_mc": (mc, "output_type: multiple_choice\ndoc_to_text: \"{{ctx}}\"\ndoc_to_choice: endings\n"
                         "doc_to_target: label\nmetric_list:\n  - metric: acc\n"),
        "bench_ppl": (ppl, "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                           "metric_list:\n  - metric: word_perplexity\n"),
    }
    for name, (rows, body) in specs.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
            f"  cache_dir: {folder / 'cache'}\ntest_split: test\n{body}")
    return folder


def requests_of(task_folder: Path) -> dict[str, list]:
    """The harness's own request instances of each task, built by its task objects."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_folder), include_defaults=False)
    tasks = manager.load(["bench_mc", "bench_ppl"])["tasks"]
    out = {}
    for name, task in tasks.items():
        task.build_all_requests()
        out[name] = list(task.instances)
    return out


class PeakMemory:
    """Peak memory a call adds: CUDA allocator peak, or the resident set sampled every 2 ms."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = self.rss()
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.added = torch.cuda.max_memory_allocated() - self.base
        else:
            self.running = False
            self.thread.join()
            self.added = self.peak - self.base


def run_side(lm, kind: str, reqs, device) -> tuple[float, list, int]:
    """(seconds, results, bytes added at peak) of one model's call on the requests."""
    call = lm.loglikelihood if kind == "bench_mc" else lm.loglikelihood_rolling
    with PeakMemory(device) as mem:
        t = time.perf_counter()
        out = call(reqs, disable_tqdm=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return dt, out, mem.added


def make_lm(name: str, hf_dir: Path, args):
    from lm_eval.models.huggingface import HFLM

    from glassformer.harness.lm import GlassformerLM

    if name == "glassformer":
        return GlassformerLM(checkpoint=str(hf_dir), device=args.device, batch_size=args.batch_size)
    return HFLM(pretrained=str(hf_dir), device=args.device, batch_size=args.batch_size, dtype="float32")


def memory_in_fresh_process(name: str, kind: str, work: Path, args) -> int:
    """Bytes one call adds at its peak, in a new process that loads the model and runs it once."""
    import subprocess

    cmd = [sys.executable, __file__, "--memory-of", name, kind, str(work), "--device", args.device,
           "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


def memory_of(name: str, kind: str, work: Path, args) -> None:
    """(--memory-of) Print the bytes one call of `name` on task `kind` adds at its peak."""
    lm = make_lm(name, work / "hf", args)
    reqs = requests_of(work / "tasks")[kind]
    print(run_side(lm, kind, reqs, torch.device(args.device))[2])


def tokens_fed(lm, reqs) -> dict:
    """Input tokens each side's model reads for the multiple-choice requests, padding aside:
    every request's context and continuation (hf), each distinct context once (glassformer)."""
    from glassformer.harness.scoring import group_requests

    pairs = [lm._encode_pair(*r.args) for r in reqs]
    groups = group_requests(pairs, lm.max_length)
    tails = sum(len(t) - 1 for g in groups for t in g.tails)
    return {"hf_tokens_fed": sum(len(c) + len(k) - 1 for c, k in pairs),
            "glassformer_tokens_fed": sum(len(g.context) for g in groups) + tails,
            "mean_context_tokens": round(sum(len(g.context) for g in groups) / len(groups), 1),
            "mean_continuation_tokens": round(sum(len(k) for _, k in pairs) / len(pairs), 1)}


def compare(lms: dict, requests: dict, rounds: int, device, work: Path, args) -> dict:
    result = {}
    for kind, reqs in requests.items():
        best = {name: float("inf") for name in lms}
        outs = {}
        for _ in range(rounds):
            for name, lm in lms.items():
                dt, outs[name], _ = run_side(lm, kind, reqs, device)
                best[name] = min(best[name], dt)
        mem = {name: memory_in_fresh_process(name, kind, work, args) for name in lms}
        lls = {n: [o[0] if isinstance(o, tuple) else o for o in out] for n, out in outs.items()}
        diff = max(abs(a - b) for a, b in zip(lls["glassformer"], lls["hf"]))
        result[kind] = {"requests": len(reqs),
                        **{f"{n}_requests_per_s": round(len(reqs) / best[n], 2) for n in lms},
                        "speedup": round(best["hf"] / best["glassformer"], 2),
                        **{f"{n}_peak_mb": round(mem[n] / 2**20, 1) for n in lms},
                        "max_abs_loglikelihood_diff": float(f"{diff:.3g}"),
                        **(tokens_fed(lms["glassformer"], reqs) if kind == "bench_mc" else {})}
        print(kind, json.dumps(result[kind]))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="24 documents, 2 rounds")
    ap.add_argument("--out", default=None, help="results JSON (default: bench/results/harness[_quick][_cuda].json)")
    ap.add_argument("--memory-of", nargs=3, metavar=("MODEL", "TASK", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.docs, args.rounds = 24, 2
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.memory_of:
        name, kind, work = args.memory_of
        return memory_of(name, kind, Path(work), args)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf_dir = make_model(work / "hf", args)
        requests = requests_of(make_tasks(work / "tasks", args.docs))
        lms = {name: make_lm(name, hf_dir, args) for name in ("glassformer", "hf")}
        result = {"machine": {"platform": platform.platform(), "torch": torch.__version__, "device": args.device,
                              "threads": torch.get_num_threads(),
                              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                              "note": "a shared machine: other work ran beside this benchmark"},
                  "model": {k: getattr(args, k) for k in ("dim", "ffn", "layers", "heads", "kv_heads", "vocab", "context")},
                  "batch_size": args.batch_size, "rounds": args.rounds, "docs": args.docs,
                  "tasks": compare(lms, requests, args.rounds, device, work, args)}
    name = "harness" + ("_quick" if args.quick else "") + ("_cuda" if device.type == "cuda" else "")
    write_json(args.out or RESULTS / f"{name}.json", result)


if __name__ == "__main__":
    main()
