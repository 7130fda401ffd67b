"""Prepare throughput: `glassformer prepare` against raw `tokenizers` batch encoding, side by side.

1. The embedded Shakespeare corpus (~9.5 MB): one tokenizer (trained here on the training
   split) encodes the same documents three ways, interleaved over several rounds:
     raw encode_batch       tokenizers' Tokenizer.encode_batch(docs), ids collected
     raw encode_batch_fast  the same without offsets (the fastest path tokenizers offers)
     prepare                glassformer.text.data.prepare(): read, decode, cut, encode, write
                            train.bin/val.bin/meta.json, fsync, rename
   Overhead = median over rounds of prepare's time / encode_batch_fast's time, minus 1
   (target: at most 10%), in wall time and in CPU time (the machine may be shared).
   Machine limits from the same run: how many of the cores each path keeps busy (CPU
   seconds / wall seconds), one thread's encode speed, sequential write+fsync bandwidth.
2. Bounded memory: synthetic corpora of growing size (Shakespeare's lines reshuffled into
   one file), each prepared in a fresh process reusing the tokenizer; peak RSS should stay
   flat as the corpus grows. One more run trains the tokenizer on the largest corpus
   (not with --only-memory). Peaks: the main process's own (VmHWM), the largest of its
   encoding workers' (ru_maxrss of its ended children), and their bound, main + workers x
   largest worker.

3. One process against all cores (`--workers-mb`, default 32): on a synthetic corpus, tokenizers'
   batch encoder with one thread and with all of its threads (the text in memory, prepare's own
   pieces), against `glassformer prepare --workers 1` and `--workers <cores>` (shards, a given
   tokenizer). Goal: prepare on all cores >= 0.9 x cores x tokenizers with one thread.

    python bench/prepare_throughput.py [--rounds 6] [--synthetic-mb 8,32] [--workers-mb 32]
    python bench/prepare_throughput.py --only-workers --workers-mb 32 --out bench/results/prepare_workers.json
    python bench/prepare_throughput.py --synthetic-mb 1024   # the full 1 GB run (slow on 2 cores)
    python bench/prepare_throughput.py --only-memory --synthetic-mb 256,2048 --out bench/results/prepare_memory_2gb.json

Prints a table and writes bench/results/prepare_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from glassformer.text.corpus import default_corpus, read_text  # noqa: E402
from glassformer.text.data import prepare  # noqa: E402
from glassformer.text.tokenizer import Tokenizer  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process, all threads (tokenizers' worker threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def timed_cpu(fn):
    t, c = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - t, cpu_seconds() - c, out


def write_bandwidth(folder: Path, mb: int = 64) -> float:
    """Sequential write + fsync, MB/s."""
    data = os.urandom(1 << 20)
    path = folder / "bw.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return mb / dt


def synthetic_corpus(path: Path, mb: int, lines: list[str], seed: int = 0) -> int:
    """Shakespeare's lines in random order (with random line numbers mixed in) until mb MB."""
    rng = random.Random(seed)
    target, n = mb * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while n < target:
            block = "".join(f"{rng.choice(lines)} {rng.randrange(10**6)}\n" for _ in range(20000))
            f.write(block)
            n += len(block.encode("utf-8"))
    return n


CHILD = """
import os, resource, sys, threading, time
from glassformer.cli import main

def child_hwm(seen):
    # Each direct child's own VmHWM, polled: a fresh mm after exec, so unlike ru_maxrss it does not count
    # the parent's memory that a spawned worker carries until its exec (kept in ru_maxrss by the kernel).
    me = str(os.getpid())
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] != me:
                    continue
                kb = int([ln for ln in open(f"/proc/{pid}/status") if ln.startswith("VmHWM")][0].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            seen[pid] = max(seen.get(pid, 0), kb)
        time.sleep(0.5)

seen = {}
threading.Thread(target=child_hwm, args=(seen,), daemon=True).start()
rc = main(sys.argv[1:])
# VmHWM: this process's own peak resident memory (ru_maxrss would include the parent's, inherited at fork)
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")][0].split()[1]
print("VmHWM_kB", hwm, file=sys.stderr)
# The encoding workers (`--workers`), ended and joined by now: ru_maxrss of RUSAGE_CHILDREN is the largest
# peak among them (kB on Linux), an upper bound, as it also counts what a worker inherited before its exec.
print("CHILDREN_MAXRSS_kB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
print("CHILDREN_VmHWM_kB", len(seen), max(seen.values(), default=0), file=sys.stderr)
sys.exit(rc)
"""


def run_child(argv: list[str]) -> tuple[float, dict]:
    """(seconds, peak memory in MB) of `glassformer ...` in a fresh process: "main" (its own VmHWM),
    "worker" (the largest ru_maxrss of its ended children), "worker_vmhwm" and "children" (the largest
    polled VmHWM of its children, and how many it saw)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"child failed: {r.stderr[-500:]}")
    field = lambda key: [ln for ln in r.stderr.splitlines() if ln.startswith(key)][-1].split()[1:]
    children, worker_hwm = map(int, field("CHILDREN_VmHWM_kB"))
    return dt, {"main": int(field("VmHWM_kB")[0]) / 1024, "worker": int(field("CHILDREN_MAXRSS_kB")[0]) / 1024,
                "worker_vmhwm": worker_hwm / 1024, "children": children}


TOKENIZERS_CHILD = """
import sys, time
from tokenizers import Tokenizer
from glassformer.text.corpus import iter_text, user_corpus
tk = Tokenizer.from_file(sys.argv[1])
corpus = user_corpus(sys.argv[2], 0.1)
chunks = [c for d in corpus.train + corpus.val for c in iter_text(d)]  # the pieces prepare encodes
nbytes = sum(len(c.encode()) for c in chunks)
t, c = time.perf_counter(), time.process_time()
n = sum(len(e.ids) for i in range(0, len(chunks), 8) for e in tk.encode_batch_fast(chunks[i:i + 8], add_special_tokens=False))
print(nbytes, n, time.perf_counter() - t, time.process_time() - c)
"""

PREPARE_CHILD = """
import resource, sys, time
from glassformer.cli import main
def cpu():  # this process's threads and its ended workers
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
t, c = time.perf_counter(), cpu()
rc = main(sys.argv[1:])
print("SECONDS", time.perf_counter() - t, cpu() - c, file=sys.stderr)
sys.exit(rc)
"""


def workers_bench(work: Path, tok_path: Path, lines: list[str], mb: int, cores: int) -> dict:
    """MB/s of text on one synthetic corpus of `mb` MB: tokenizers' batch encoder (encode_batch_fast on
    prepare's own pieces, 8 a batch, the text already in memory) in one process with one thread and
    with all its threads, against `glassformer prepare` (shards, a given tokenizer; the time of main()
    in a fresh process, so imports are not counted) with --workers 1 and --workers <cores>."""
    path = work / f"workers-{mb}mb.txt"
    nbytes = synthetic_corpus(path, mb, lines)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = {"mb": nbytes / 1e6, "cores": cores}
    for name, extra in (("tokenizers one thread", {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}),
                        ("tokenizers all threads", {})):
        r = subprocess.run([sys.executable, "-c", TOKENIZERS_CHILD, str(tok_path), str(path)], env={**env, **extra},
                           capture_output=True, text=True, check=True)
        text_bytes, tokens, seconds, cpu = r.stdout.split()
        out[name] = {"seconds": float(seconds), "mb_per_s": int(text_bytes) / 1e6 / float(seconds), "tokens": int(tokens),
                     "cpu_seconds": float(cpu), "mb_per_cpu_s": int(text_bytes) / 1e6 / float(cpu)}
    for k in (1, cores):
        argv = ["prepare", "--corpus", str(path), "--tokenizer", str(tok_path), "--out", str(work / "w"),
                "--workers", str(k)]
        r = subprocess.run([sys.executable, "-c", PREPARE_CHILD, *argv], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"prepare failed: {r.stderr[-500:]}")
        seconds, cpu = map(float, [ln for ln in r.stderr.splitlines() if ln.startswith("SECONDS")][-1].split()[1:])
        meta = json.loads((work / "w" / "meta.json").read_text())
        out[f"prepare --workers {k}"] = {"seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds, "cpu_seconds": cpu,
                                         "mb_per_cpu_s": nbytes / 1e6 / cpu,
                                         "shards": len(meta["shards"]["train"]) + len(meta["shards"]["val"])}
        shutil.rmtree(work / "w")
    path.unlink()
    one = out["tokenizers one thread"]["mb_per_s"]
    out["goal_mb_per_s"] = 0.9 * cores * one
    out["ratio_to_cores_x_one_thread"] = out[f"prepare --workers {cores}"]["mb_per_s"] / (cores * one)
    # CPU work per MB does not depend on what else the machine runs: prepare's MB per CPU second over
    # tokenizers' one-thread figure is the ratio an idle machine would give if the workers kept every core busy.
    out["cpu_efficiency_vs_one_thread"] = (out[f"prepare --workers {cores}"]["mb_per_cpu_s"]
                                           / out["tokenizers one thread"]["mb_per_cpu_s"])
    print(f"\nworkers, synthetic {nbytes / 1e6:.0f} MB, {cores} cores:")
    for name in ("tokenizers one thread", "tokenizers all threads", "prepare --workers 1", f"prepare --workers {cores}"):
        print(f"  {name:<28} {out[name]['mb_per_s']:>7.2f} MB/s  {out[name]['mb_per_cpu_s']:>6.2f} MB per CPU s")
    print(f"  prepare --workers {cores} / ({cores} x tokenizers one thread) = {out['ratio_to_cores_x_one_thread']:.2f} "
          f"(goal >= 0.9); MB per CPU second, against one tokenizers thread: {out['cpu_efficiency_vs_one_thread']:.2f}")
    return out


def memory_bench(work: Path, tok_path: Path, lines: list[str], sizes: list[int], vocab_size: int,
                 train_largest: bool) -> list[dict]:
    """Peak memory of `glassformer prepare` (defaults: shards, --workers the cores from 16 MB) on synthetic
    corpora of each size, each in a fresh process with a given tokenizer; with train_largest, once more
    training the tokenizer on the largest. The bound is the main process's peak plus the workers times the
    largest worker's peak (ru_maxrss, which also counts what a worker carried from the main process until
    its exec, so it errs high; the polled VmHWM beside it is the worker's own)."""
    from glassformer.text.encoding import auto_workers

    synth = []
    for size in sizes:
        path = work / f"synthetic-{size}mb.txt"
        nbytes = synthetic_corpus(path, size, lines)
        runs = [("reuse tokenizer", ["--tokenizer", str(tok_path)])]
        if train_largest and size == max(sizes):
            runs.append(("train tokenizer", ["--vocab-size", str(vocab_size)]))
        for mode, extra in runs:
            dt, rss = run_child(["prepare", "--corpus", str(path), *extra, "--out", str(work / "s")])
            workers = auto_workers(nbytes)
            synth.append({"mb": nbytes / 1e6, "mode": mode, "seconds": dt, "mb_per_s": nbytes / 1e6 / dt,
                          "peak_rss_mb": rss["main"], "workers": workers if workers > 1 else 0,
                          "peak_rss_worker_mb": rss["worker"], "peak_rss_worker_vmhwm_mb": rss["worker_vmhwm"],
                          "children_seen": rss["children"],
                          "peak_rss_bound_mb": rss["main"] + (workers if workers > 1 else 0) * rss["worker"]})
            shutil.rmtree(work / "s")
        path.unlink()
    if synth:
        print(f"\n{'synthetic corpus':>16} {'mode':<16} {'seconds':>8} {'MB/s':>6} {'main MB':>8} {'workers':>7} "
              f"{'worker MB':>9} {'(own)':>6} {'bound MB':>9}")
        for s in synth:
            print(f"{s['mb']:>13.0f} MB {s['mode']:<16} {s['seconds']:>8.1f} {s['mb_per_s']:>6.2f} {s['peak_rss_mb']:>8.0f} "
                  f"{s['workers']:>7} {s['peak_rss_worker_mb']:>9.0f} {s['peak_rss_worker_vmhwm_mb']:>6.0f} "
                  f"{s['peak_rss_bound_mb']:>9.0f}")
        reuse = [s for s in synth if s["mode"] == "reuse tokenizer"]
        rate = statistics.median(s["mb_per_s"] for s in reuse)
        print(f"extrapolated 1 GB (1000 MB) with a given tokenizer: {1000 / rate / 60:.0f} min at {rate:.2f} MB/s, "
              f"main + workers at most {max(s['peak_rss_bound_mb'] for s in reuse):.0f} MB")
    return synth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--synthetic-mb", default="8,32", help="comma-separated sizes; empty to skip")
    ap.add_argument("--workers-mb", type=int, default=32,
                    help="size of the synthetic corpus for one process against all cores (0 to skip)")
    ap.add_argument("--only-workers", action="store_true", help="run the workers comparison alone")
    ap.add_argument("--only-memory", action="store_true",
                    help="run the memory rows of --synthetic-mb alone (a given tokenizer, no training row)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prepare_throughput.json"))
    args = ap.parse_args()
    if args.only_workers:
        return only_one(args, "workers")
    if args.only_memory:
        return only_one(args, "memory")

    work = Path(tempfile.mkdtemp(prefix="gf-prepare-bench-"))
    try:
        corpus = default_corpus()
        docs = corpus.train + corpus.val
        texts = [read_text(d) for d in docs]
        mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        train_s, tok = timed(lambda: Tokenizer.train(iter([read_text(d) for d in corpus.train]), args.vocab_size))
        tk = tok.tk

        # Machine limits in this run: one thread's encode speed, cores, disk.
        one_s, _ = timed(lambda: [tk.encode(t, add_special_tokens=False).ids for t in texts[:8]])
        one_mbps = sum(len(t.encode()) for t in texts[:8]) / 1e6 / one_s
        cores = os.cpu_count() or 1
        disk_mbps = write_bandwidth(work)

        names = ("raw encode_batch", "raw encode_batch_fast", "prepare (encode + write)")
        times = {k: [] for k in names}
        cpu = {k: [] for k in names}
        ref_tokens = None
        def run_path(k: str, r: int):
            nonlocal ref_tokens
            if k == names[0]:
                return timed_cpu(lambda: len([e.ids for e in tk.encode_batch(texts, add_special_tokens=False)]))
            if k == names[1]:
                dt, dc, ids = timed_cpu(lambda: [e.ids for e in tk.encode_batch_fast(texts, add_special_tokens=False)])
                ref_tokens = sum(len(i) for i in ids) + len(docs)  # + one end-of-text per document
                return dt, dc, None
            out = work / f"prep{r}"
            dt, dc, meta = timed_cpu(lambda: prepare(corpus, out, tokenizer=tok, show_progress=False))
            assert meta["train_tokens"] + meta["val_tokens"] == ref_tokens, "prepare and raw encoding disagree"
            shutil.rmtree(out)
            return dt, dc, None

        # Interleaved rounds in alternating order, so a change in the machine's load (it is
        # shared) hits both sides; the overhead is the median of each round's ratio.
        for r in range(args.rounds):
            order = [names[1], names[2], names[0]] if r % 2 == 0 else [names[2], names[1], names[0]]
            for k in order:
                dt, dc, _ = run_path(k, r)
                times[k].append(dt)
                cpu[k].append(dc)
        full_s, _ = timed(lambda: prepare(corpus, work / "full", vocab_size=args.vocab_size, show_progress=False))

        best = {k: min(v) for k, v in times.items()}
        fastest = names[1]
        ratio = {k: statistics.median(a / b for a, b in zip(times[k], times[fastest])) for k in names}
        cpu_ratio = {k: statistics.median(a / b for a, b in zip(cpu[k], cpu[fastest])) for k in names}
        print(f"default corpus: {mb:.2f} MB, {ref_tokens:,} tokens, vocabulary {tok.vocab_size}, "
              f"{cores} CPU cores, {args.rounds} interleaved rounds")
        print(f"{'path':<28} {'MB/s best':>10} {'MB/s median':>12} {'wall / raw fast':>16} {'CPU s':>6} {'CPU / raw fast':>15}")
        for k in names:
            print(f"{k:<28} {mb / best[k]:>10.2f} {mb / statistics.median(times[k]):>12.2f} {ratio[k]:>16.3f} "
                  f"{statistics.median(cpu[k]):>6.2f} {cpu_ratio[k]:>15.3f}")
        overhead, cpu_overhead = ratio[names[2]] - 1, cpu_ratio[names[2]] - 1
        print(f"prepare overhead over raw encode_batch_fast (median of per-round ratios): wall {overhead:+.1%}, "
              f"CPU time {cpu_overhead:+.1%} (target <= +10%)")
        print(f"tokenizer training on the training split: {mb * 0.91 / train_s:.2f} MB/s ({train_s:.1f} s); "
              f"prepare with training, end to end: {mb / full_s:.2f} MB/s ({full_s:.1f} s)")
        busy = {k: statistics.median(c / t for c, t in zip(cpu[k], times[k])) for k in names}
        print(f"machine limits: cores kept busy (CPU s / wall s, median) raw fast {busy[names[1]]:.2f}, "
              f"prepare {busy[names[2]]:.2f} of {cores}; one thread alone encodes {one_mbps:.2f} MB/s; "
              f"write+fsync {disk_mbps:.0f} MB/s (prepare writes {2 * ref_tokens / 1e6 / best[names[2]]:.2f} MB/s of ids)")

        # Bounded memory on synthetic corpora, each in a fresh process.
        lines = [ln for t in texts for ln in t.splitlines() if ln.strip()]
        tok_path = work / "full" / "tokenizer.json"
        sizes = [int(s) for s in args.synthetic_mb.split(",") if s.strip()]
        synth = memory_bench(work, tok_path, lines, sizes, args.vocab_size, train_largest=True)

        workers = workers_bench(work, tok_path, lines, args.workers_mb, cores) if args.workers_mb else None

        result = {
            "machine": {"cpu_cores": cores, "one_thread_encode_mb_per_s": one_mbps, "write_fsync_mb_per_s": disk_mbps,
                        "cores_busy_median": busy, "load_average_1min_at_end": os.getloadavg()[0]},
            "default_corpus": {"mb": mb, "tokens": ref_tokens, "vocab_size": tok.vocab_size, "rounds": args.rounds,
                               "seconds": times, "cpu_seconds": cpu, "best_mb_per_s": {k: mb / v for k, v in best.items()},
                               "median_wall_ratio_vs_encode_batch_fast": ratio, "median_cpu_ratio_vs_encode_batch_fast": cpu_ratio,
                               "overhead_vs_fastest_raw": overhead, "cpu_overhead_vs_fastest_raw": cpu_overhead, "train_tokenizer_seconds": train_s,
                               "prepare_with_training_seconds": full_s},
            "synthetic": synth,
            "workers": workers,
            "command": "python bench/prepare_throughput.py " + " ".join(sys.argv[1:]),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {Path(args.out).relative_to(ROOT) if Path(args.out).is_relative_to(ROOT) else args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def only_one(args, part: str) -> None:
    """--only-workers (workers_bench) or --only-memory (memory_bench, a given tokenizer), with a
    tokenizer trained on the default corpus's training split, written to --out."""
    work = Path(tempfile.mkdtemp(prefix="gf-prepare-bench-"))
    try:
        corpus = default_corpus()
        texts = [read_text(d) for d in corpus.train + corpus.val]
        tok = Tokenizer.train(iter(texts[:len(corpus.train)]), args.vocab_size)
        tok.save(work / "tokenizer.json")
        lines = [ln for t in texts for ln in t.splitlines() if ln.strip()]
        cores = len(os.sched_getaffinity(0))
        result = {"machine": {"cpu_cores": cores, "load_average_1min_at_start": os.getloadavg()[0]},
                  "vocab_size": tok.vocab_size}
        if part == "workers":
            result["workers"] = workers_bench(work, work / "tokenizer.json", lines, args.workers_mb, cores)
        else:
            sizes = [int(s) for s in args.synthetic_mb.split(",") if s.strip()]
            result["synthetic"] = memory_bench(work, work / "tokenizer.json", lines, sizes, args.vocab_size,
                                               train_largest=False)
        result["command"] = "python bench/prepare_throughput.py " + " ".join(sys.argv[1:])
        result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
