"""glassformer.cost against the real model: numel, FlopCounterMode, autograd's saved tensors,
the KV cache's buffers, the tiled kernel's own tile log, and published figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from glassformer import PRESETS, KVCache, ModelConfig, Transformer
from glassformer.attention import tiled_attention
from glassformer.cli import main
from glassformer.cost import (
    activation_bytes,
    activations,
    crossover_seq,
    estimate,
    forward_flops,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_numbers_per_token,
    max_train_batch,
    parse_bytes,
    tiled_pairs,
    train_memory,
    weights,
)

from ..support import REPO, WORKED_FIGURES

WORKED = json.loads(WORKED_FIGURES.read_text())

# ----------------------------------------------------------------------------- helpers


@st.composite
def configs(draw, max_seq: int = 48):
    """Small configs with every switch the cost formulas distinguish."""
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_heads = n_kv * draw(st.sampled_from([1, 2, 3]))
    pos = draw(st.sampled_from(["rope", "learned", "none"]))
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    dim = n_heads * head_dim if draw(st.booleans()) else draw(st.sampled_from([8, 12, 20]))  # H ≠ D/N too
    return ModelConfig(
        vocab_size=draw(st.integers(5, 90)), dim=dim, n_layers=draw(st.integers(1, 3)), n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=draw(st.integers(3, 40)), max_seq_len=max_seq,
        norm=draw(st.sampled_from(["rms", "layer"])), norm_placement=draw(st.sampled_from(["pre", "post"])),
        ffn=draw(st.sampled_from(["swiglu", "relu", "gelu", "gelu_tanh"])), pos=pos,
        tie_embeddings=draw(st.booleans()), bias=draw(st.booleans()), qkv_bias=draw(st.booleans()),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 40))), attention_tile=draw(st.sampled_from([4, 8, 16])),
    )


def meta_model(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def part_of(name: str) -> str:
    """Which weights() part a parameter of the real model belongs to."""
    if name == "embed.weight":
        return "embedding"
    if name == "pos_embed.weight":
        return "positions"
    if name == "lm_head.weight":
        return "lm_head"
    if ".attn.q_norm." in name or ".attn.k_norm." in name:
        return "qk_norms"
    if "norm" in name:
        return "norms"
    if name.endswith(".attn.sinks"):
        return "attn_sinks"
    if ".attn." in name:
        return "attn_bias" if name.endswith("bias") else "attn_" + name.split(".")[-2][1]  # wq -> attn_q
    if ".ffn.router." in name:
        return "router"
    if ".ffn.shared." in name:
        return "shared_experts"
    if ".ffn.experts." in name:
        return "experts_bias" if name.endswith("bias") else "experts"
    if ".ffn." in name:
        return "ffn_bias" if name.endswith("bias") else "ffn"
    raise AssertionError(f"unexpected parameter {name}")


def real_parts(model: Transformer) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, p in model.named_parameters():  # named_parameters yields a tied matrix once
        out[part_of(name)] = out.get(part_of(name), 0) + p.numel()
    return out


def counted_flops(model, B, T, backward=False) -> int:
    idx = torch.randint(0, model.config.vocab_size, (B, T))
    with FlopCounterMode(display=False) as fc:
        _, loss = model(idx, idx if backward else None)
        if backward:
            loss.backward()
    return fc.get_total_flops()


def saved_for_backward(model, B, T) -> tuple[int, int]:
    """(floating-point elements, bytes) that autograd keeps for backward in one training
    forward, each storage counted once; the weights themselves are not activations."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, tuple[int, int, bool]] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen.setdefault(s.data_ptr(), (s.nbytes(), t.element_size(), t.dtype.is_floating_point))
        return t

    idx = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    elements = sum(nb // size for nb, size, is_float in seen.values() if is_float)
    return elements, sum(nb for nb, _, _ in seen.values())


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("preset", list(PRESETS))
def test_weights_equal_numel_for_every_preset(preset):
    cfg = ModelConfig.from_preset(preset)
    model = meta_model(cfg)
    w = weights(cfg)
    assert w["total"] == model.num_params() == sum(p.numel() for p in model.parameters())
    assert w["non_embedding"] == model.num_params(non_embedding=True)
    assert {k: v for k, v in w.items() if v and k not in ("total", "non_embedding", "active")} == real_parts(model)


@given(configs())
def test_weights_equal_numel_for_drawn_configs(cfg):
    model = meta_model(cfg)
    assert weights(cfg)["total"] == model.num_params()
    assert {k: v for k, v in weights(cfg).items() if v and k not in ("total", "non_embedding", "active")} == real_parts(model)


def test_weights_reduce_to_design_formula_for_mha():
    # design.md: P = L(4D² + 3·D·F + 2D) + D + 2VD (MHA, SwiGLU, RMSNorm, no tying or biases)
    L, D, F, V = 3, 48, 128, 300
    cfg = ModelConfig(vocab_size=V, dim=D, n_layers=L, n_heads=6, ffn_dim=F)
    assert weights(cfg)["total"] == L * (4 * D * D + 3 * D * F + 2 * D) + D + 2 * V * D
    assert weights(cfg.replace(tie_embeddings=True))["total"] == L * (4 * D * D + 3 * D * F + 2 * D) + D + V * D


def test_llama3_8b_published_figures():
    cfg = ModelConfig.from_preset("llama3-8b")
    ref = WORKED["llama3_8b_kv_cache"]
    assert weights(cfg)["total"] == 8_030_261_248  # Meta's model card: 8.03B
    assert kv_cache_bytes_per_token(cfg, "bf16") == ref["bytes_per_token"] == 131_072
    assert kv_cache_bytes(cfg, ref["tokens"], 1, "bf16") == ref["gqa_total_bytes"] == 2**30
    mha = cfg.replace(n_kv_heads=cfg.n_heads)  # one KV head per query head
    assert kv_cache_bytes(mha, ref["tokens"], 1, "bf16") == ref["mha_total_bytes"] == 4 * 2**30


@pytest.mark.parametrize("preset, published", [
    ("gpt2-124m", 124_439_808),  # Hugging Face gpt2
    ("smollm-135m", 134_515_008),  # HuggingFaceTB/SmolLM-135M
    ("llama3.2-1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B
    ("tinyllama-1.1b", 1_100_048_384),  # TinyLlama-1.1B
    ("mistral-7b", 7_241_732_096),  # mistralai/Mistral-7B-v0.1
])
def test_published_weight_counts(preset, published):
    assert weights(ModelConfig.from_preset(preset))["total"] == published


@pytest.mark.parametrize("kind, n_kv", [("MHA", 4), ("GQA", 2), ("MQA", 1)])
def test_walkthrough_toy_model_cache_numbers(kind, n_kv):
    # The walkthrough's toy: width 4, 4 heads of size 2, one block; its cache holds k and v per head.
    toy = ModelConfig(vocab_size=6, dim=WORKED["d_model"], n_layers=1, n_heads=WORKED["multi_head"]["n_heads"],
                      n_kv_heads=n_kv, head_dim=WORKED["d_head"], ffn_dim=8, ffn="relu")
    want = WORKED["multi_head"]["kv_cache_numbers_per_token"][kind]
    assert kv_cache_bytes_per_token(toy, "fp32") // 4 == kv_cache_numbers_per_token(toy) == want
    cache = KVCache(toy, batch_size=1, max_len=5, dtype=torch.float32)  # the real buffers, 5 positions
    assert sum(b.numel() for b in cache.buffers()) // 5 == want


# ----------------------------------------------------------------------------- FLOPs


@settings(max_examples=15)
@given(configs(), st.integers(1, 3), st.integers(2, 48))
def test_forward_flops_match_flop_counter_on_naive_kernel(cfg, B, T):
    model = Transformer(cfg.replace(attention="naive"))
    got = counted_flops(model, B, T)
    est = forward_flops(cfg, B, T, "naive")["total"]
    assert est == pytest.approx(got, rel=0.01)


@settings(max_examples=8)
@given(configs(), st.integers(1, 2), st.integers(2, 48))
def test_tiled_kernel_flops_and_skipped_tiles(cfg, B, T):
    model = Transformer(cfg.replace(attention="tiled"))
    f_tiled, f_naive = forward_flops(cfg, B, T, "tiled"), forward_flops(cfg, B, T, "naive")
    assert f_tiled["total"] == pytest.approx(counted_flops(model, B, T), rel=0.01)
    assert f_tiled["attn_scores"] <= f_naive["attn_scores"]
    # The kernel's own log says which tiles it skipped.
    log: list = []
    q = torch.randn(1, 1, T, 2)
    tiled_attention(q, q, q, q_pos=torch.arange(T)[None], window=cfg.sliding_window, start=0,
                    tile=cfg.attention_tile, tile_log=log)
    tp = tiled_pairs(T, cfg.attention_tile, cfg.sliding_window)
    assert sum(e["skipped"] for e in log) == tp["tiles_skipped"]
    assert sum(not e["skipped"] for e in log) == tp["tiles"]


def test_cpu_sdpa_has_no_flop_formula():
    # Why flops_forward is defined on the naive kernel: on the CPU, FlopCounterMode counts
    # nothing for the fused kernel, so it sees exactly the products with weights.
    cfg = ModelConfig.from_preset("tiny", attention="sdpa")
    r = estimate(cfg, batch=2, seq=64)
    assert counted_flops(Transformer(cfg), 2, 64) == r["flops_forward_no_scores"] < r["flops_forward"]


def test_walkthrough_flash_tiles():
    # Four tokens in tiles of 2: the tile where "I" and "like" would read "cats" and "too" is skipped.
    assert "never computed" in WORKED["flash_attention_tiles_of_2_row_cats"]["skipped_tiles"]
    tp = tiled_pairs(4, tile=2)
    assert (tp["tiles"], tp["tiles_skipped"], tp["pairs"]) == (3, 1, 12)


@settings(max_examples=6)
@given(configs(max_seq=32), st.integers(1, 2), st.integers(2, 32))
def test_training_step_is_three_forwards(cfg, B, T):
    model = Transformer(cfg.replace(attention="naive"))
    got = counted_flops(model, B, T, backward=True)
    assert estimate(cfg, batch=B, seq=T, attention="naive")["flops_train_step"] == pytest.approx(got, rel=0.01)


def test_forward_flops_reduce_to_design_formula_and_six_per_weight():
    L, D, F, V, B, T = 2, 64, 96, 200, 3, 40
    cfg = ModelConfig(vocab_size=V, dim=D, n_layers=L, n_heads=4, ffn_dim=F, max_seq_len=64)
    design = L * (8 * B * T * D * D + 4 * B * T * T * D + 6 * B * T * D * F) + 2 * B * T * D * V
    assert forward_flops(cfg, B, T)["total"] == design
    # Training ≈ 6 FLOPs per weight of a matrix product per token, plus the score terms.
    for c in (cfg, cfg.replace(tie_embeddings=True, bias=True, ffn="gelu", n_kv_heads=2)):
        r = estimate(c, batch=B, seq=T)
        w = r["params_by_part"]
        matmul_weights = sum(v for k, v in w.items() if k.startswith(("attn_", "ffn")) and "bias" not in k) + V * D
        assert 3 * r["flops_forward_no_scores"] == 6 * matmul_weights * B * T


@settings(max_examples=25)
@given(configs(), st.integers(1, 48))
def test_training_flops_per_token_is_palms_formula(cfg, T):
    """6 per weight of a matrix product (the LM head too) + 12·L·T·N·H; training's MFU uses this one count."""
    from glassformer.cost import train_flops_per_token
    from glassformer.train.metrics import flops_per_token

    w = weights(cfg)
    matmul_weights = sum(v for k, v in w.items() if k.startswith(("attn_", "ffn")) and "bias" not in k)
    palm = 6 * (matmul_weights + cfg.vocab_size * cfg.dim) + 12 * cfg.n_layers * T * cfg.q_dim
    assert train_flops_per_token(cfg, T) == palm == flops_per_token(cfg, T)


def test_crossover_is_where_scores_overtake_the_ffn():
    cfg = ModelConfig(vocab_size=100, dim=64, n_layers=1, n_heads=4, ffn_dim=96, max_seq_len=4096)
    assert crossover_seq(cfg) == 1.5 * cfg.ffn_dim  # design.md, MHA SwiGLU: T > 1.5·F
    for kernel in ("naive", "causal", "tiled"):
        T = crossover_seq(cfg, kernel)
        f, before = forward_flops(cfg, 1, T, kernel), forward_flops(cfg, 1, T - 1, kernel)
        assert f["attn_scores"] + f["attn_values"] >= f["ffn"]
        assert before["attn_scores"] + before["attn_values"] < before["ffn"]
    assert crossover_seq(cfg.replace(sliding_window=100), "causal") is None  # capped below the FFN
    assert crossover_seq(cfg.replace(ffn="relu")) == 64 * 96 // 64  # two matrices: m·D·F/(2·N·H)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("kernel", ["naive", "sdpa", "tiled"])
@settings(max_examples=8)
@given(cfg=configs(max_seq=40), B=st.integers(1, 3), T=st.integers(2, 40))
def test_activations_match_what_autograd_saves(kernel, cfg, B, T):
    model = Transformer(cfg.replace(attention=kernel))
    elements, nbytes = saved_for_backward(model, B, T)
    assert activations(cfg, B, T, kernel)["total"] == pytest.approx(elements, rel=0.15)
    assert activation_bytes(cfg, B, T, "fp32", kernel) == pytest.approx(nbytes, rel=0.15)


@pytest.mark.parametrize("kernel", ["naive", "sdpa", "tiled"])
def test_activations_with_dropout(kernel):
    cfg = ModelConfig.from_preset("tiny", attention=kernel, attention_tile=16, dropout=0.1)
    elements, nbytes = saved_for_backward(Transformer(cfg).train(), 2, 64)
    a = activations(cfg, 2, 64)
    assert a["dropout"] == (2 * cfg.n_layers + 1) * 2 * 64 * cfg.dim
    assert a["total"] == pytest.approx(elements, rel=0.15) and activation_bytes(cfg, 2, 64) == pytest.approx(nbytes, rel=0.15)
    assert a["total"] - a["dropout"] == activations(cfg.replace(dropout=0.0), 2, 64)["total"]


@pytest.mark.parametrize("kernel", ["naive", "sdpa", "tiled"])
def test_activation_bytes_in_bf16(kernel):
    cfg = ModelConfig.from_preset("tiny", attention=kernel, attention_tile=16)
    model = Transformer(cfg).to(torch.bfloat16)
    _, nbytes = saved_for_backward(model, 2, 64)
    assert activation_bytes(cfg, 2, 64, "bf16", kernel) == pytest.approx(nbytes, rel=0.15)


def test_only_naive_and_plain_tiled_store_score_grids():
    # sdpa keeps no T×T grid; the tiled kernel, under plain autograd, keeps its computed tiles.
    cfg = ModelConfig.from_preset("tiny", attention_tile=16)
    saved = {k: saved_for_backward(Transformer(cfg.replace(attention=k)), 1, 128)[0] for k in ("naive", "tiled", "sdpa")}
    grid = 2 * cfg.n_layers * cfg.n_heads * 128 * 128  # two fp32 grids per layer
    assert saved["naive"] - saved["sdpa"] == pytest.approx(grid, rel=0.01)
    assert saved["tiled"] - saved["sdpa"] > grid / 2  # at least the computed half, kept twice
    for k, v in saved.items():
        assert activations(cfg, 1, 128, k)["total"] == pytest.approx(v, rel=0.15)


def test_training_memory_parts_and_largest_batch():
    cfg = ModelConfig.from_preset("gpt2-124m")
    P = weights(cfg)["total"]
    fp32 = train_memory(cfg, 4, 1024, "fp32")
    assert fp32["weights"] + fp32["grads"] + fp32["optimizer"] == 16 * P and fp32["master_weights"] == 0
    mixed = train_memory(cfg, 4, 1024, "bf16")
    assert mixed["total"] - mixed["activations"] == 16 * P  # ZeRO's 2 + 2 + 12 bytes per weight
    pure = train_memory(cfg, 4, 1024, "bf16", master_weights=False)
    assert pure["total"] - pure["activations"] == 8 * P
    assert train_memory(cfg, 4, 1024, "fp32", optimizer="sgd")["optimizer"] == 4 * P
    m = parse_bytes("80GB")
    b = max_train_batch(cfg, 1024, m, "bf16")
    assert train_memory(cfg, b, 1024, "bf16")["total"] <= m < train_memory(cfg, b + 1, 1024, "bf16")["total"]
    assert max_train_batch(ModelConfig.from_preset("llama3-8b"), 8192, parse_bytes("80GB"), "bf16") == 0


def test_docstring_examples():
    import doctest
    import importlib

    for name in ("params", "flops"):
        result = doctest.testmod(importlib.import_module(f"glassformer.cost.{name}"))
        assert result.attempted > 0 and result.failed == 0


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6 and parse_bytes("1e9") == 10**9
    with pytest.raises(ValueError, match="e.g. 80GB"):
        parse_bytes("eighty")


@pytest.mark.gpu
def test_training_memory_against_cuda_peak():
    """Peak bytes allocated during an AdamW step (grads kept) against the estimate."""
    cfg = ModelConfig.from_preset("gpt2-124m", attention="sdpa")
    B, T = 8, 1024
    model = Transformer(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    for step in range(2):  # the first step allocates the moments
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    peak = torch.cuda.max_memory_allocated()
    est = train_memory(cfg, B, T, "fp32", "sdpa")["total"]
    print(f"gpt2-124m B={B} T={T} fp32: estimate {est / 2**30:.2f} GiB, cuda peak {peak / 2**30:.2f} GiB")
    assert 0.85 * est <= peak <= 1.35 * est


# ----------------------------------------------------------------------------- CLI

REQUIRED = ["params", "flops_forward", "flops_train_step", "flops_per_token", "activations", "train_memory_bytes",
            "kv_cache_bytes_per_token", "train_time_seconds", "max_batch"]


def run_json(capsys, *argv) -> dict:
    assert main(["cost", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_keys_and_definitions(capsys):
    r = run_json(capsys, "--preset", "tiny", "--batch", "3", "--seq", "100", "--dtype", "bf16", "--attention", "naive")
    assert set(REQUIRED) <= set(r)
    assert r["flops_per_token"] == r["flops_forward"] / (3 * 100)
    assert r["flops_forward"] == counted_flops(Transformer(ModelConfig.from_preset("tiny", attention="naive")), 3, 100)
    assert r["params"] == Transformer(ModelConfig.from_preset("tiny")).num_params()
    assert r["train_time_seconds"] == pytest.approx(r["train_steps"] * r["flops_train_step"] / (0.4 * 989.5e12))
    assert r["train_tokens"] >= 20 * r["params"]  # Chinchilla default, whole steps
    doc = (REPO / "docs" / "cost.md").read_text()
    for key in r:  # every key is defined in the docs
        assert f"`{key}`" in doc, key
    for group in ("inputs", "params_by_part", "flops_forward_by_part", "flops_scores", "tiled_tiles",
                  "activations_by_part", "train_memory_by_part", "decode", "hardware"):
        for key in r[group]:
            assert f"`{key}`" in doc, f"{group}.{key}"


def test_cli_table_plot_config_and_checkpoint(tmp_path, capsys):
    png = tmp_path / "cost.png"
    assert main(["cost", "--preset", "small", "--seq", "64", "--plot", str(png), "--hardware", "a100"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per token" in out and "training on a100" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = ModelConfig.from_preset("tiny", tie_embeddings=True, pos="learned")
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    assert run_json(capsys, "--config", str(tmp_path / "cfg.json"))["params"] == Transformer(cfg).num_params()
    from glassformer.checkpoint.folders import save_model

    model = Transformer(cfg.replace(n_layers=3))
    save_model(tmp_path / "ckpt", model)
    r = run_json(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--tokens", "1e6", "--memory", "1GiB")
    assert r["params"] == model.num_params() and r["inputs"]["memory_bytes"] == 2**30


def test_cli_cpu_hardware_is_measured(capsys):
    r = run_json(capsys, "--preset", "tiny", "--hardware", "cpu", "--steps", "10")
    assert r["inputs"]["dtype"] == "fp32" and r["hardware"]["peak_flops"]["fp32"] > 0
    assert r["train_time_seconds"] == pytest.approx(10 * r["flops_train_step"] / (0.4 * r["hardware"]["peak_flops"]["fp32"]))
    assert r["hardware"]["memory_bytes"] > 2**20 and r["decode"]["bandwidth"] > 0


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "tiny", "--seq", "4096"], "--seq must be in 1..128"),
    (["--preset", "tiny", "--memory", "lots"], "cannot read memory size"),
    (["--preset", "nope"], "unknown preset"),
    (["--config", "missing.json"], "does not exist"),
    (["--preset", "tiny", "--mfu", "2"], "mfu must be in"),
    (["--preset", "tiny", "--tokens", "1e6", "--steps", "3"], "not both"),
])
def test_cli_bad_input_is_one_error_line(capsys, argv, msg):
    assert main(["cost", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]


def preset_row(name: str) -> str:
    """A row of docs/cost.md's "Figures for the presets", rendered from `estimate`."""
    from glassformer.cost.report import human

    cfg = ModelConfig.from_preset(name)
    T = min(cfg.max_seq_len, 8192)
    r = estimate(cfg, batch=1, seq=T)
    return (f"| {name} | {r['params']:,} | {r['params_non_embedding']:,} | {T} | {human(r['flops_per_token'])} "
            f"({human(r['flops_per_token_no_scores'])}) | {r['crossover_seq']:,} | {r['kv_cache_bytes_per_token']:,} | "
            f"{human(r['train_memory_bytes'], 'B', 1024)} | {r['decode']['tokens_per_second_bound']:.3g} |")


def test_the_docs_preset_table_is_what_estimate_says():
    """Every row of the table in docs/cost.md is today's `estimate`, so a changed preset or memory model
    shows up here rather than as a stale figure."""
    doc = (REPO / "docs" / "cost.md").read_text()
    table = doc.split("## Figures for the presets", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| preset")]
    names = [row.split("|")[1].strip() for row in rows]
    assert names and set(names) <= set(PRESETS)
    for name, row in zip(names, rows):
        assert row == preset_row(name), f"docs/cost.md's {name} row is stale; today: {preset_row(name)}"
