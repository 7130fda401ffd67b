"""The GPU goals of the training and generation issues, measured in one run beside Hugging Face.

  train   gpt2-124m, bf16 autocast, torch.compile, 16 × 1024 tokens a step, gradient clipping,
          the engine's finite check of loss and norm (a host sync a step), fused AdamW:
          tokens/s and MFU against the GPU's published dense bf16 peak (metrics.GPU_BF16_PEAK;
          goal: at least 45% on an H200); beside it transformers' GPT2LMHeadModel holding the
          same weights, compiled and run the same way; then 3 of our steps under the torch
          profiler (wall time against the GPU's busy time, the costliest host operations);
          and the LM head's product alone, padded (as the model runs it on a GPU) and plain.
  decode  llama3.2-1b in bf16 (random weights), batch 1, greedy, 16-token prompt, the decode
          step compiled (CUDA graphs): tokens/s, bytes read per token (every weight once, the
          cache up to the position) and the fraction of the published 4.8 TB/s (goal: at least
          70%) and of a device-to-device copy measured here; beside it transformers' generate
          with a static cache and a compiled forward (its documented fast path), and ours
          again without run-ahead (the host reading each token before queuing the next
          step: what Session.run_ahead saves); then 32
          steps under the torch profiler: wall time per step against the device's busy
          time (the gap is host work the GPU waits for) and the costliest host operations.

Rounds alternate between the two sides; the best round counts.

    python bench/gpu.py [--out bench/results/gpu.json] [--only train decode] [--rounds 3] [--new-tokens 256]
    python bench/gpu.py --smoke     # tiny shapes, no compile, CPU if no GPU: a check that the
                                    # script runs end to end (tests/test_bench_gpu.py), not a measurement
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from glassformer import ModelConfig, Transformer, speed  # noqa: E402
from glassformer.convert import to_transformers  # noqa: E402
from glassformer.generation.session import Session  # noqa: E402
from glassformer.train.metrics import flops_per_token, gpu_peak  # noqa: E402
from glassformer.speed.head import head_logits  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, NVIDIA H200 SXM datasheet (cost/hardware.py)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fns: dict, rounds: int, device: torch.device) -> dict:
    """Seconds of each function's fastest call, calls alternating between the functions."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def bench_train(device: torch.device, smoke: bool, rounds: int) -> dict:
    small = dict(dim=64, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=512, max_seq_len=64)
    cfg = ModelConfig.from_preset("gpt2-124m", **(small if smoke else {}))
    B, T = (2, 32) if smoke else (16, 1024)
    torch.manual_seed(0)
    ours = Transformer(cfg).to(device).train()
    if device.type == "cuda":  # as `glassformer train` does on a GPU: the head's products over a padded vocabulary
        speed.install(ours)
    hf = to_transformers(ours, torch.float32).train()
    x = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    y = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    run_ours = ours if smoke else torch.compile(ours)
    run_hf = hf if smoke else torch.compile(hf)

    def loss_ours():
        return run_ours(x, y)[1]

    def loss_hf():
        logits = run_hf(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    with torch.no_grad(), cast:  # the same weights give the same loss: a like-for-like comparison
        first = {"glassformer": float(loss_ours()), "transformers": float(loss_hf())}

    def stepper(net, loss_fn):
        opt = make_optimizer(net, 1e-4, 0.1, (0.9, 0.95), device)

        def step():  # what `glassformer train` does each step, on either model
            with cast:
                loss = loss_fn()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            if not (math.isfinite(float(loss.detach())) and math.isfinite(float(norm))):  # the engine's check: a sync a step
                raise SystemExit("non-finite loss or gradient norm in the benchmark")
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {"glassformer": stepper(ours, loss_ours), "transformers": stepper(hf, loss_hf)}
    for fn in steps.values():  # compile and warm up
        for _ in range(3):
            fn()
    sec = best_of(steps, rounds, device)
    peak = gpu_peak(device) if device.type == "cuda" else None
    fpt = flops_per_token(cfg, T)
    rows = {k: {"sec_per_step": s, "tokens_per_s": B * T / s,
                "mfu": None if peak is None else fpt * B * T / s / peak, "first_loss": first[k]} for k, s in sec.items()}
    return {"preset": "gpt2-124m" + (" (smoke: shrunk)" if smoke else ""), "batch": B, "seq": T, "compile": not smoke,
            "dtype": "bf16 autocast" if device.type == "cuda" else "fp32", "peak_flops": peak, "flops_per_token": fpt,
            "rows": rows, "ratio": rows["glassformer"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"],
            "step_profile": profiled(lambda: [steps["glassformer"]() for _ in range(3)], 3, device),
            "head_product": bench_head(device, smoke, rounds)}


def bench_head(device: torch.device, smoke: bool, rounds: int) -> dict:
    """The LM head's product alone, forward and backward under bf16 autocast, over GPT-2's 50,257
    tokens: the padded product a model with glassformer.speed installed runs on a GPU
    (speed.head.head_logits) against the plain one."""
    V, D, N = (61, 64, 64) if smoke else (50257, 768, 16 * 1024)
    w = torch.randn(V, D, device=device, requires_grad=True)
    x = torch.randn(N, D, device=device, requires_grad=True)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grad = torch.randn(N, V, device=device, dtype=dtype)

    def run(pad: bool):
        def f():
            with cast:
                logits = head_logits(x, w, pad=pad)  # (N, V)
            logits.backward(grad)
        return f

    fns = {"plain": run(False), "padded to a multiple of 64": run(True)}
    for f in fns.values():
        f()
    sec = best_of(fns, max(rounds, 5), device)
    return {"vocab": V, "dim": D, "rows": N, "ms": {k: 1e3 * s for k, s in sec.items()},
            "speedup": sec["plain"] / sec["padded to a multiple of 64"]}


def copy_bandwidth(device: torch.device, n_bytes: int) -> float:
    """Bytes/s of a device copy (each byte read once and written once)."""
    a = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def profiled(run, steps: int, device: torch.device) -> dict:
    """Where a step's time goes, from run() doing `steps` steps under the torch profiler: wall
    time per step against the device's busy time (the gap is host work the device waits for:
    Python, guards, launches, syncs) and the host operations that cost most."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        sync(device)
        t = time.perf_counter()
        run()
        sync(device)
        wall = time.perf_counter() - t
    ev = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0) for e in ev)  # microseconds over the steps
    host = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:8]
    return {"steps": steps, "wall_us_per_step": wall / steps * 1e6, "device_busy_us_per_step": busy / steps,
            "top_host_ops_us_per_step": {e.key[:80]: e.self_cpu_time_total / steps for e in host}}


def step_profile(session: Session, prompt: list[int], device: torch.device, n: int = 32) -> dict:
    """profiled() of n decode steps of a warm session."""
    session.reset()
    list(session.send(prompt, max_new_tokens=4, greedy=True))  # prefill and warm steps
    return profiled(lambda: list(session.send(None, max_new_tokens=n, greedy=True)), n, device)


def bench_decode(device: torch.device, smoke: bool, rounds: int, new_tokens: int) -> dict:
    small = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=512)
    cfg = ModelConfig.from_preset("llama3.2-1b", max_seq_len=8192, **(small if smoke else {}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=dtype).eval()
    hf = to_transformers(model, dtype).eval()
    prompt = torch.randint(0, cfg.vocab_size, (16,))
    N = new_tokens
    session = Session(model, max_len=len(prompt) + N, compile=not smoke, run_ahead=True)  # (a GPU's default)
    if not smoke:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    out = {}

    def ours(run_ahead: bool = True, key: str = "glassformer"):
        session.reset()  # a fresh text, the same compiled step
        session.run_ahead = run_ahead
        out[key] = list(session.send(prompt.tolist(), max_new_tokens=N, greedy=True))
        session.run_ahead = True

    def ours_in_step():  # the host reads each token before queuing the next step: what run-ahead saves
        ours(False, "glassformer, no run-ahead")

    def theirs():
        ids = prompt[None].to(device)
        with torch.inference_mode():
            got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                              do_sample=False, pad_token_id=0, cache_implementation="static")
        out["transformers"] = got[0, len(prompt):].tolist()

    runs = {"glassformer": ours, "glassformer, no run-ahead": ours_in_step, "transformers": theirs}
    for fn in runs.values():  # compile, capture, warm up
        fn()
    sec = best_of(runs, rounds, device)
    nb = torch.finfo(dtype).bits // 8
    weights = model.num_params() - (0 if cfg.tie_embeddings else model.embed.weight.numel() - cfg.dim)
    kv_per_pos = 2 * cfg.n_layers * cfg.kv_dim * nb
    bytes_per_token = weights * nb + kv_per_pos * (len(prompt) + N / 2)
    bw = copy_bandwidth(device, (2 if smoke else 4096) * 2**20)
    rows = {k: {"tokens_per_s": N / s, "bytes_per_s": bytes_per_token * N / s,
                "fraction_of_4_8_TBps": bytes_per_token * N / s / H200_BANDWIDTH,
                "fraction_of_measured_copy": bytes_per_token * N / s / bw} for k, s in sec.items()}
    return {"preset": "llama3.2-1b" + (" (smoke: shrunk)" if smoke else ""), "dtype": str(dtype).split(".")[-1],
            "new_tokens": N, "compile": not smoke, "bytes_per_token": bytes_per_token, "copy_bandwidth": bw,
            "identical_tokens": all(t == out["transformers"] for t in out.values()), "rows": rows,
            "recompiles": session.recompiles,  # the step traced anew after its first compile (hooks, kernels changed)
            "ratio": rows["glassformer"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"],
            "step_profile": step_profile(session, prompt.tolist(), device, min(32, N - 4))}  # within the cache: prompt + N


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu.json"))
    ap.add_argument("--only", nargs="+", choices=["train", "decode"], default=["train", "decode"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no compile (a check, not a measurement)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA GPU here: this benchmark measures the GPU goals (--smoke checks the script on a CPU)")
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if "train" in args.only:
        res["train"] = bench_train(device, args.smoke, args.rounds)
        r = res["train"]["rows"]
        print("train " + ", ".join(f"{k}: {v['tokens_per_s']:,.0f} tok/s" + (f", MFU {100 * v['mfu']:.1f}%" if v["mfu"] else "")
                                   for k, v in r.items()) + f"; ratio {res['train']['ratio']:.2f}x", flush=True)
        sp = res["train"]["step_profile"]
        print(f"train step (profiled): {sp['wall_us_per_step']:.0f} us wall, "
              f"device busy {sp['device_busy_us_per_step']:.0f} us", flush=True)
        hp = res["train"]["head_product"]
        print("LM head product, fwd+bwd: " + ", ".join(f"{k} {v:.2f} ms" for k, v in hp["ms"].items())
              + f"; padded {hp['speedup']:.2f}x", flush=True)
    if "decode" in args.only:
        res["decode"] = bench_decode(device, args.smoke, args.rounds, 8 if args.smoke else args.new_tokens)
        r = res["decode"]["rows"]
        print("decode " + ", ".join(f"{k}: {v['tokens_per_s']:,.1f} tok/s, {100 * v['fraction_of_4_8_TBps']:.1f}% of 4.8 TB/s"
                                    for k, v in r.items())
              + f"; identical tokens: {res['decode']['identical_tokens']}", flush=True)
        sp = res["decode"]["step_profile"]
        print(f"decode step (profiled): {sp['wall_us_per_step']:.0f} us wall, "
              f"device busy {sp['device_busy_us_per_step']:.0f} us", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
