"""One call that prices a model: `estimate(cfg, ...)` -> the dict `glassformer cost --json` prints."""

from __future__ import annotations

import math

from ..config import ModelConfig
from .flops import KERNELS, all_score_pairs, crossover_seq, decode_flops, forward_flops, tiled_pairs, train_step_flops
from .hardware import Hardware, get_hardware, parse_bytes
from .memory import (
    activations,
    dtype_bytes,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_numbers_per_token,
    max_inference_batch,
    max_train_batch,
    train_memory,
)
from .lora import lora_keys
from .params import active_weights, weights

CHINCHILLA_TOKENS_PER_WEIGHT = 20  # Hoffmann et al., 2022: compute-optimal training data


def _check_inputs(cfg: ModelConfig, B: int, T: int, mfu: float, kernel: str) -> None:
    if B < 1 or T < 1:
        raise ValueError(f"batch and seq must be positive, got batch={B}, seq={T}")
    if T > cfg.max_seq_len:
        raise ValueError(f"seq {T} exceeds the model's context of {cfg.max_seq_len} tokens: choose --seq <= {cfg.max_seq_len}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if kernel not in KERNELS:
        raise ValueError(f"attention must be one of {', '.join(KERNELS)}; got {kernel!r}")


def _train_length(P: int, B: int, T: int, tokens: int | None, steps: int | None) -> tuple[int, int]:
    """(tokens, steps): whole steps of B·T tokens; tokens default to 20 per weight."""
    if tokens is not None and steps is not None:
        raise ValueError("give --tokens or --steps, not both")
    if steps is None:
        tokens = CHINCHILLA_TOKENS_PER_WEIGHT * P if tokens is None else int(tokens)
        steps = math.ceil(tokens / (B * T))
    return steps * B * T, steps


def _weight_keys(cfg: ModelConfig) -> dict:
    w = weights(cfg)
    # A mixture of experts holds every expert (params) and runs k of them per token (params_active).
    return {"params": w["total"], "params_non_embedding": w["non_embedding"], "params_active": active_weights(cfg),
            "params_by_part": {k: v for k, v in w.items() if k not in ("total", "non_embedding")}}


def _flop_keys(cfg: ModelConfig, B: int, T: int) -> dict:
    fwd = forward_flops(cfg, B, T, "naive")
    no_scores = fwd["total"] - fwd["attn_scores"] - fwd["attn_values"]
    tiles = tiled_pairs(T, cfg.attention_tile, cfg.sliding_window)
    every = forward_flops(cfg, B, T, "naive", all_experts=True)["total"]  # the dense equivalent of a mixture
    scores = {k: 4 * B * cfg.q_dim * all_score_pairs(cfg, T, k) for k in ("naive", "tiled", "causal")}
    return {
        "flops_forward": fwd["total"],
        "flops_forward_by_part": {k: v for k, v in fwd.items() if k != "total"},
        "flops_forward_no_scores": no_scores,
        "flops_per_token": fwd["total"] / (B * T),
        "flops_per_token_no_scores": no_scores / (B * T),
        "flops_per_token_all_experts": every / (B * T),
        "flops_scores": scores,
        "tiled_tiles": {"tile": cfg.attention_tile, "computed": tiles["tiles"], "skipped": tiles["tiles_skipped"],
                        "flops_skipped": scores["naive"] - scores["tiled"]},
        "flops_train_step": train_step_flops(fwd["total"]),
        "crossover_seq": crossover_seq(cfg, "naive"),
        "crossover_seq_causal": crossover_seq(cfg, "causal"),
    }


def _memory_keys(cfg: ModelConfig, B: int, T: int, dtype: str, kernel: str, optimizer: str,
                 master_weights: bool | None, recompute: bool = False) -> dict:
    act = activations(cfg, B, T, kernel, recompute)
    train = train_memory(cfg, B, T, dtype, kernel, optimizer, master_weights, recompute)
    return {
        "activations": act["total"],
        "activations_by_part": {k: v for k, v in act.items() if k != "total"},
        "activation_bytes": train["activations"],
        "train_memory_bytes": train["total"],
        "train_memory_by_part": {k: v for k, v in train.items() if k != "total"},
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, dtype),
        "kv_cache_numbers_per_token_per_layer": kv_cache_numbers_per_token(cfg) // cfg.n_layers,
        "kv_cache_bytes": kv_cache_bytes(cfg, T, B, dtype),
    }


def _decode_keys(cfg: ModelConfig, P: int, T: int, dtype: str, hw: Hardware) -> dict:
    # Each decoded token reads every weight it runs through (P: a mixture's active weights, as one row
    # at a time routes to k experts) and the whole cache once.
    decode_bytes = P * dtype_bytes(dtype) + kv_cache_bytes_per_token(cfg, dtype) * T
    return {"context": T, "flops_per_token": decode_flops(cfg, T), "bytes_per_token": decode_bytes,
            "tokens_per_second_bound": hw.bandwidth / decode_bytes, "bandwidth": hw.bandwidth}


def estimate(
    cfg: ModelConfig,
    batch: int = 1,
    seq: int | None = None,
    dtype: str | None = None,
    hardware: str = "h100",
    mfu: float = 0.4,
    tokens: int | None = None,
    steps: int | None = None,
    memory: int | str | None = None,
    attention: str | None = None,
    optimizer: str = "adamw",
    master_weights: bool | None = None,
    lora_r: int | None = None,
    lora_targets: tuple[str, ...] | None = None,
    activation_checkpointing: bool = False,
) -> dict:
    """Every cost of `cfg` for a batch of `batch` rows of `seq` tokens; see docs/cost.md for each key.

    seq defaults to the model's context, dtype to bf16 on a GPU and fp32 on the CPU,
    memory to the hardware's, attention to the config's kernel, tokens to 20 per weight.
    lora_r: also price LoRA fine-tuning at that rank (on lora_targets, default all): key "lora".
    activation_checkpointing: activations and memory as `train --activation-checkpointing` holds them.
    """
    B, T = int(batch), cfg.max_seq_len if seq is None else int(seq)
    kernel = cfg.attention if attention is None else attention
    _check_inputs(cfg, B, T, mfu, kernel)
    hw = get_hardware(hardware)
    dtype = ("fp32" if hardware == "cpu" else "bf16") if dtype is None else dtype
    dtype_bytes(dtype)  # validates
    mem_bytes = hw.memory_bytes if memory is None else parse_bytes(memory)
    r = {"config": cfg.to_dict(),
         "inputs": {"batch": B, "seq": T, "dtype": dtype, "attention": kernel, "hardware": hw.name,
                    "mfu": mfu, "optimizer": optimizer, "memory_bytes": mem_bytes,
                    "activation_checkpointing": activation_checkpointing},
         **_weight_keys(cfg), **_flop_keys(cfg, B, T),
         **_memory_keys(cfg, B, T, dtype, kernel, optimizer, master_weights, activation_checkpointing)}
    tokens, steps = _train_length(r["params"], B, T, tokens, steps)
    peak = hw.peak(dtype)
    r.update({
        "train_tokens": tokens,
        "train_steps": steps,
        "train_flops": r["flops_train_step"] * steps,
        "peak_flops": peak,
        "train_time_seconds": r["flops_train_step"] * steps / (mfu * peak),
        "max_batch": max_train_batch(cfg, T, mem_bytes, dtype, kernel, optimizer, master_weights, activation_checkpointing),
        "max_batch_inference": max_inference_batch(cfg, T, mem_bytes, dtype),
        "decode": _decode_keys(cfg, r["params_active"], T, dtype, hw),
        "hardware": {"name": hw.name, "peak_flops": hw.peak_flops, "memory_bytes": hw.memory_bytes,
                     "bandwidth": hw.bandwidth, "source": hw.source},
    })
    if lora_r is not None:
        r["lora"] = lora_keys(cfg, B, T, lora_r, lora_targets, dtype, kernel, optimizer, master_weights)
    return r


# ----------------------------------------------------------------------------- text


def human(n: float, unit: str = "", base: int = 1000) -> str:
    """1234567 -> '1.23 M'; with base=1024 and unit 'B' -> '1.18 MiB'."""
    prefixes = ["", "K", "M", "G", "T", "P", "E"]
    i = 0
    x = float(n)
    while abs(x) >= base and i < len(prefixes) - 1:
        x /= base
        i += 1
    p = prefixes[i] + ("i" if base == 1024 and i else "")
    return f"{x:.3g} {p}{unit}".rstrip()


def duration(seconds: float) -> str:
    for unit, s in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= s:
            return f"{seconds / s:.3g} {unit}"
    return f"{seconds:.3g} s"


def format_table(r: dict) -> str:
    """The readable table `glassformer cost` prints."""
    i = r["inputs"]
    B, T = i["batch"], i["seq"]
    rows: list[tuple[str, str]] = []

    def add(name: str, value: str) -> None:
        rows.append((name, value))

    add("weights", f"{r['params']:,} ({human(r['params'])}; {r['params_non_embedding']:,} non-embedding)")
    if r["params_active"] != r["params"]:
        add("  active per token", f"{r['params_active']:,} ({human(r['params_active'])}: the router, "
            f"{r['config']['n_active_experts']} of {r['config']['n_experts']} experts, the shared ones)")
    for k, v in r["params_by_part"].items():
        if v:
            add(f"  {k}", f"{v:,}")
    add(f"forward FLOPs, B={B} T={T}", f"{human(r['flops_forward'], 'FLOP')} (full T×T score grid, matrix products)")
    for k, v in r["flops_forward_by_part"].items():
        if v:
            add(f"  {k}", f"{human(v, 'FLOP')} ({v / r['flops_forward']:.1%})")
    add("  without scores", f"{human(r['flops_forward_no_scores'], 'FLOP')}")
    s = r["flops_scores"]
    add("  score FLOPs by kernel", f"naive {human(s['naive'])} · tiled {human(s['tiled'])} · causal pairs only {human(s['causal'])}")
    t = r["tiled_tiles"]
    add("  tiled kernel skips", f"{t['skipped']:,} of {t['skipped'] + t['computed']:,} tiles of {t['tile']} ({human(t['flops_skipped'], 'FLOP')})")
    add("forward FLOPs per token", f"{human(r['flops_per_token'], 'FLOP')} ({human(r['flops_per_token_no_scores'])} without scores)")
    if r["flops_per_token_all_experts"] != r["flops_per_token"]:
        add("  with every expert", f"{human(r['flops_per_token_all_experts'], 'FLOP')} (all experts on every token; "
            f"the router runs {r['config']['n_active_experts']})")
    add("training step FLOPs", f"{human(r['flops_train_step'], 'FLOP')} (3 × forward)")
    cs, cc = r["crossover_seq"], r["crossover_seq_causal"]
    if cs is None:
        add("scores pass FFN at T", "no feed-forward (ffn='none')")
    else:
        add("scores pass FFN at T", f"{cs:,} (full grid); {'never (window)' if cc is None else f'{cc:,}'} (causal pairs)")
    add(f"activations ({i['attention']})", f"{human(r['activations'])} numbers, {human(r['activation_bytes'], 'B', 1024)}"
        + (" (checkpointed: each block's input, one block recomputed at a time)" if i.get("activation_checkpointing") else ""))
    add(f"training memory ({i['dtype']}, {i['optimizer']})", human(r["train_memory_bytes"], "B", 1024))
    for k, v in r["train_memory_by_part"].items():
        if v:
            add(f"  {k}", human(v, "B", 1024))
    add("KV cache per token", f"{r['kv_cache_bytes_per_token']:,} B ({i['dtype']}); {human(r['kv_cache_bytes'], 'B', 1024)} for {B}×{T} tokens")
    add(f"training on {i['hardware']}", f"{human(r['train_tokens'])} tokens = {r['train_steps']:,} steps: "
        f"{duration(r['train_time_seconds'])} at MFU {i['mfu']:.0%} of {human(r['peak_flops'], 'FLOP/s')}")
    add(f"largest batch in {human(i['memory_bytes'], 'B')}", f"training {r['max_batch']:,}; inference {r['max_batch_inference']:,} (T={T})")
    d = r["decode"]
    add(f"decode at context {d['context']:,}", f"≤ {d['tokens_per_second_bound']:.3g} tokens/s per row "
        f"({human(d['bytes_per_token'], 'B', 1024)} read per token at {human(d['bandwidth'], 'B/s')})")
    if "lora" in r:
        _lora_rows(r, add)
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a.ljust(width)}  {b}" for a, b in rows)


def _lora_rows(r: dict, add) -> None:
    lo, i = r["lora"], r["inputs"]
    add(f"LoRA r={lo['r']} ({','.join(lo['targets'])})",
        f"{lo['trainable_weights']:,} trainable weights ({lo['trainable_fraction']:.2%}); "
        f"adapter file {human(lo['adapter_file_bytes'], 'B', 1024)} (fp32)")
    add(f"  optimizer state ({i['optimizer']})", f"{human(lo['optimizer_bytes'], 'B', 1024)} "
        f"(full fine-tuning: {human(r['train_memory_by_part']['optimizer'], 'B', 1024)})")
    add(f"  training memory ({i['dtype']})", f"{human(lo['train_memory_bytes'], 'B', 1024)} "
        f"(full fine-tuning: {human(r['train_memory_bytes'], 'B', 1024)})")
