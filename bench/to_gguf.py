"""GGUF: export time and peak memory, and batch-1 decode of glassformer against llama.cpp on the
same GGUF weights, in one run (docs/benchmarks-log.md#gguf-export-and-decode-against-llamacpp-on-the-same-file).

1. Export: a checkpoint of the smollm-135m shape (random weights, fp32, tied head) is written
   with `glassformer convert --to-gguf` as f32 and as q8_0, each in a fresh child process that
   reports its wall time and its peak resident memory (VmHWM) above what it held before the
   export began (Python, torch, glassformer and the libraries the command uses imported), next to
   the largest tensor's bytes.
2. Decode: batch-1 greedy decoding of the same prompt for the same number of tokens, at the
   same thread count: llama.cpp (llama-cpp-python, its KV cache in f32) on the f32 and the q8_0
   file, and glassformer eager and with its decode step compiled on each file's weights read
   back with `--from-gguf` (q8_0 dequantized to fp32), and on the q8_0 weights quantized to
   int8 (`--quantize int8`, glassformer's own 8-bit path). Rounds alternate among them and the
   best round counts; tokens/s and ratios against llama.cpp on the same file.

    python bench/to_gguf.py [--new-tokens 128] [--rounds 3] [--threads 2] [--no-compile]
    python bench/to_gguf.py --quick                 # 32 tokens, 1 round
    python bench/to_gguf.py --shape reference       # the 15.7M reference shape instead of smollm-135m
    python bench/to_gguf.py --no-decode             # the export alone
    python bench/to_gguf.py --accuracy              # only: logits and greedy tokens against llama.cpp on the test fixtures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import add_decode_arguments, write_json  # noqa: E402  (bench/ is the script's folder)


from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.checkpoint.folders import save_model  # noqa: E402
from glassformer.checkpoint.loading import load  # noqa: E402
from glassformer.cli import main as glassformer  # noqa: E402
from glassformer.config import PRESETS, REFERENCE_SHAPE  # noqa: E402
from glassformer.generation.session import Session  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]

# The child that exports: its own peak memory, above what it held once everything was imported.
CHILD = """
import json, sys, time
sys.path.insert(0, {src!r})
from glassformer.cli import main
def kb(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1])
# imported before the baseline: what the command loads (libraries, the tokenizer's and the templates' code)
import glassformer.commands.convert, glassformer.convert.gguf, glassformer.convert.gguf_tokenizer, gguf, tqdm
import glassformer.convert.modelfile, glassformer.text.tokenizer, glassformer.text.chat_template, jinja2, tokenizers
before = kb('VmRSS:')
t = time.perf_counter()
code = main(['convert', '--to-gguf', {ckpt!r}, '--out', {out!r}, '--dtype', {dtype!r}])
print(json.dumps({{'code': code, 'seconds': time.perf_counter() - t, 'rss_before_kb': before, 'peak_kb': kb('VmHWM:')}}))
"""


def random_checkpoint(shape: str, folder: Path) -> Path:
    cfg = ModelConfig(**(PRESETS["smollm-135m"] if shape == "smollm-135m" else REFERENCE_SHAPE))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than the init, so argmax margins are not all near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    from glassformer.text.tokenizer import Tokenizer

    # llama.cpp needs a vocabulary: a small byte-level BPE, the ids past it written as unused tokens.
    tok = Tokenizer.train(["the king and queen walk to the castle"] * 20, vocab_size=300)
    return save_model(folder, model, tok)


def export(ckpt: Path, out: Path, dtype: str) -> dict:
    code = CHILD.format(src=str(ROOT / "src"), ckpt=str(ckpt), out=str(out), dtype=dtype)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["code"] == 0, proc.stderr
    res["export_peak_mb"] = (res["peak_kb"] - res["rss_before_kb"]) / 1024
    res["file_mb"] = out.stat().st_size / 2**20
    return res


def llama_cpp_decoder(path: Path, threads: int, n_ctx: int):
    import llama_cpp

    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          type_k=f32, type_v=f32, flash_attn=False, verbose=False)
    n_vocab = llm.n_vocab()

    def run(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        run.first_logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).astype(np.float64)
        out = []
        for _ in range(n):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))  # the last position's
            out.append(int(logits.argmax()))
            llm.eval([out[-1]])
        return out

    return run


def glassformer_decoder(model, compile_: bool, max_len: int):
    session = Session(model, max_len=max_len, compile=compile_)

    def run(prompt: list[int], n: int) -> list[int]:
        session.reset()
        return list(session.send(prompt, max_new_tokens=n, greedy=True))

    return run


def decode(args, ckpt: Path, files: dict[str, Path], work: Path) -> dict:
    from glassformer.convert.quantize import quantize

    runs, file_of = {}, {}
    max_len = args.prompt_tokens + args.new_tokens + 1
    for dtype, path in files.items():
        runs[f"llama.cpp_{dtype}"] = llama_cpp_decoder(path, args.threads, max_len + 8)
        file_of[f"llama.cpp_{dtype}"] = dtype
        back = work / f"back-{dtype}"
        assert glassformer(["convert", "--from-gguf", str(path), "--out", str(back)]) == 0
        model, _ = load(back)
        variants = {"": model, **({"_int8": quantize(load(back)[0], "int8")} if dtype == "q8_0" else {})}
        for suffix, m in variants.items():
            runs[f"glassformer{suffix}_{dtype}_eager"] = glassformer_decoder(m, False, max_len)
            file_of[f"glassformer{suffix}_{dtype}_eager"] = dtype
            if args.compile:
                runs[f"glassformer{suffix}_{dtype}_compiled"] = glassformer_decoder(m, True, max_len)
                file_of[f"glassformer{suffix}_{dtype}_compiled"] = dtype
    cfg = load(ckpt)[0].config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist()
    for fn in runs.values():  # warm up every contender (and compile)
        fn(prompt, 4)
    times, tokens = {k: [] for k in runs}, {}
    for _ in range(args.rounds):  # alternate, so a change in machine speed hits every contender
        for k, fn in runs.items():
            t = time.perf_counter()
            tokens[k] = fn(prompt, args.new_tokens)
            times[k].append(time.perf_counter() - t)
    tok_s = {k: args.new_tokens / min(v) for k, v in times.items()}
    ours = [k for k in runs if k.startswith("glassformer")]
    ratios = {k: tok_s[k] / tok_s[f"llama.cpp_{file_of[k]}"] for k in ours}
    agree = {k: sum(a == b for a, b in zip(tokens[k], tokens[f"llama.cpp_{file_of[k]}"])) for k in ours}
    return {"tokens_per_s": tok_s, "ratio_to_llama_cpp_same_file": ratios,
            "greedy_tokens_equal_to_llama_cpp": agree, "times_s": times}


def accuracy(out: Path) -> None:
    """Last-position logits (max |difference| / max |logit|) and 20 greedy tokens, glassformer against
    llama.cpp, on the models of tests/convert/test_llamacpp.py, in f32, f16 and q8_0."""
    sys.path.insert(0, str(ROOT))
    from tests.convert.gguf_fixtures import PROMPT, hf_fixture, trained_checkpoint
    from tests.support import greedy_cached

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpts = {"trained": trained_checkpoint(root), **{f: hf_fixture(root, f) for f in ("llama", "qwen2", "gpt2")}}
        for name, ckpt in ckpts.items():
            model, tok = load(ckpt)
            ids = tok.encode(PROMPT)
            with torch.no_grad():
                want = model(torch.tensor([ids]))[0][0, -1].double().numpy()
                greedy = greedy_cached(model, torch.tensor([ids]), 20)
            for dtype in ("f32", "f16", "q8_0"):
                path = root / f"{name}-{dtype}.gguf"
                assert glassformer(["convert", "--to-gguf", str(ckpt), "--out", str(path), "--dtype", dtype]) == 0
                run = llama_cpp_decoder(path, 2, 64)
                tokens = run(ids, 20)
                got = run.first_logits
                err = float(np.abs(got - want).max() / np.abs(want).max())
                res.setdefault(name, {})[dtype] = {"logits_error": err, "greedy_equal": sum(a == b for a, b in zip(tokens, greedy))}
                print(f"  {name:8} {dtype:5} logits {err:.1e}, greedy {res[name][dtype]['greedy_equal']}/20")
    write_json(out, res, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_arguments(ap, "also glassformer with its decode step compiled (torch.compile), in the same rounds")
    ap.add_argument("--shape", choices=["smollm-135m", "reference"], default="smollm-135m")
    ap.add_argument("--no-decode", action="store_true", help="only the export's time and memory")
    ap.add_argument("--accuracy", action="store_true", help="only: logits and greedy tokens against llama.cpp "
                    "on the test fixtures (bench/results/gguf_accuracy.json)")
    ap.add_argument("--out", default=str(RESULTS / "gguf.json"))
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    torch.set_num_threads(args.threads)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:  # the export still measures; say what is left out rather than fail
        if args.accuracy:
            raise SystemExit("bench/to_gguf.py --accuracy needs llama-cpp-python (make test-llamacpp installs it)")
        print("llama-cpp-python is not installed (make test-llamacpp installs it): the decode comparison is skipped")
        args.no_decode = True
    if args.accuracy:
        return accuracy(Path(args.out if args.out != str(RESULTS / "gguf.json") else RESULTS / "gguf_accuracy.json"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = random_checkpoint(args.shape, work / "ckpt")
        cfg = load(ckpt)[0].config
        largest = max(cfg.vocab_size * cfg.dim, cfg.ffn_dim * cfg.dim) * 4
        files, exports = {}, {}
        for dtype in ("f32", "q8_0"):
            files[dtype] = work / f"model-{dtype}.gguf"
            exports[dtype] = export(ckpt, files[dtype], dtype)
            exports[dtype]["peak_over_largest_tensor"] = exports[dtype]["export_peak_mb"] * 2**20 / largest
            print(f"export {dtype}: {exports[dtype]['seconds']:.1f} s, peak +{exports[dtype]['export_peak_mb']:.0f} MB "
                  f"({exports[dtype]['peak_over_largest_tensor']:.2f}x the largest tensor), file {exports[dtype]['file_mb']:.0f} MB")
        result = {"shape": args.shape, "config": cfg.to_dict(), "weights": sum(p.numel() for p in load(ckpt)[0].parameters()),
                  "largest_tensor_mb": largest / 2**20, "export": exports,
                  "decode": None if args.no_decode else decode(args, ckpt, files, work),
                  "settings": {"threads": args.threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                               "rounds": args.rounds, "compile": args.compile, "quick": args.quick},
                  "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "torch": torch.__version__, "note": "shared machine: other jobs ran alongside"}}
    for k, v in (result["decode"] or {"tokens_per_s": {}})["tokens_per_s"].items():
        r = result["decode"]["ratio_to_llama_cpp_same_file"].get(k)
        print(f"  {k:36} {v:7.1f} tok/s" + (f"  ({r:.2f}x llama.cpp)" if r else ""))
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
