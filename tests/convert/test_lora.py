"""LoRA adapters: the wrapped product against its formula, step 0 is the base, merged logits equal
the adapted model's, the joined QKV / gate-up products skip an adapted module, the base's sha256
against an independent hash, the adapter checkpoint format, load of an adapter run, --base,
convert --merge-lora, and the bad inputs (clear errors, nothing written)."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from glassformer import speed
from glassformer.convert import lora as L
from glassformer.convert.lora import (
    LORA_TARGETS,
    LoRALinear,
    LoraConfig,
    adapter_state,
    apply_lora,
    base_sha256,
    load_adapter_state,
    merge_lora,
)
from glassformer.convert.quantize import quantize_int8
from glassformer.errors import UserError

from ..support import greedy_by_full_forward, greedy_cached, synthetic_text, tiny_checkpoint, tiny_model

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def _randomise_B(model, seed=1, std=0.05):
    """Give every B a value (B starts at zero), so the adapters change the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in L.lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * std)
    return model


def adapted(seed=0, cfg=LoraConfig(), **model_overrides):
    return _randomise_B(apply_lora(tiny_model(seed, **model_overrides), cfg))


# ----------------------------------------------------------------------------- the module and its math


def test_the_wrapped_product_is_base_plus_scaled_low_rank_term():
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 10, bias=True)
    m = LoRALinear(base, r=3, alpha=6.0)
    assert m.lora_A.shape == (3, 12) and m.lora_B.shape == (10, 3) and (m.lora_B == 0).all()
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    W, b, A, B = (t.detach().double() for t in (base.weight, base.bias, m.lora_A, m.lora_B))
    want = x @ W.T + b + 2.0 * (x @ A.T @ B.T)  # alpha / r = 2
    got = m.double()(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_step_zero_is_the_base_exactly_and_only_adapters_train():
    base = tiny_model(0)
    want, _ = base(IDS)
    model = apply_lora(tiny_model(0), LoraConfig(r=4))
    got, _ = model(IDS)
    assert torch.equal(got, want)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state(model))
    assert len(trainable) == 2 * len(LORA_TARGETS) * model.config.n_layers
    assert L.count_adapter_weights(model) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_merged_logits_equal_the_adapted_models():
    model = adapted(0, LoraConfig(r=4, alpha=8.0))
    want, _ = model(IDS)
    ref, _ = tiny_model(0)(IDS)
    assert (want - ref).abs().max() > 1e-2  # the adapters do change the logits
    merged = merge_lora(model)
    assert not L.lora_modules(merged) and all(p.requires_grad for p in merged.parameters())
    got, _ = merged(IDS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_targets_and_speed_keep_each_adapter():
    """Only wq and w_up adapted: speed re-classes the adapters' bases and the plain projections, leaves
    the adapters their class, and a decode step still runs each adapter."""
    model = adapted(0, LoraConfig(r=2, targets=("wq", "w_up")))
    blk = model.blocks[0]
    assert isinstance(blk.attn.wq, LoRALinear) and isinstance(blk.ffn.w_up, LoRALinear)
    assert type(blk.attn.wk).__name__ == "Linear" and type(blk.ffn.w_gate).__name__ == "Linear"
    want = greedy_by_full_forward(model, IDS[0].tolist(), 6)
    speed.install(model)  # the adapted modules keep their class; their bases and the rest are re-classed
    assert isinstance(blk.attn.wq, LoRALinear) and type(blk.attn.wq.base) is speed.RowsLinear
    assert type(blk.attn.wk) is speed.RowsLinear
    with torch.no_grad():
        assert greedy_cached(model, IDS, 6) == want
    # and the decode step's logits are the full forward's
    with torch.no_grad():
        full, _ = model(IDS)
        from glassformer import KVCache

        cache = KVCache.for_model(model, 1, IDS.shape[1])
        model(IDS[:, :-1], cache=cache, pos=0)
        last, _ = model(IDS[:, -1:], cache=cache, pos=IDS.shape[1] - 1)
    torch.testing.assert_close(last[0, -1], full[0, -1], rtol=1e-5, atol=1e-5)


def test_adapter_state_round_trips():
    a = adapted(0, LoraConfig(r=3))
    state = adapter_state(a)
    assert state["blocks.1.attn.wq.lora_A"].shape == (3, a.config.dim)
    assert state["blocks.1.ffn.w_down.lora_B"].shape == (a.config.dim, 3)
    b = apply_lora(tiny_model(0), LoraConfig(r=3))
    load_adapter_state(b, state)
    assert torch.equal(a(IDS)[0], b(IDS)[0])
    with pytest.raises(UserError, match="does not match"):
        load_adapter_state(b, {k: v for k, v in state.items() if "blocks.0" not in k})
    with pytest.raises(UserError, match="expected"):
        load_adapter_state(apply_lora(tiny_model(0), LoraConfig(r=2)), state)


def test_base_sha256_against_an_independent_hash():
    model = tiny_model(0, tie_embeddings=True)
    sd = model.state_dict()
    keys = sorted(k for k in sd if k != "lm_head.weight")  # the tied head is stored once, as embed.weight
    want = hashlib.sha256(b"".join(sd[k].float().numpy().tobytes() for k in keys)).hexdigest()
    assert base_sha256(model) == want
    adapted_model = apply_lora(model, LoraConfig(r=2))
    assert base_sha256(adapted_model) == want  # the adapters are not the base
    assert base_sha256(adapted_model.state_dict()) == want
    assert base_sha256(model.to(torch.bfloat16)) != want  # rounded weights are another base
    other = tiny_model(0, tie_embeddings=True)
    with torch.no_grad():
        other.blocks[1].ffn.w_down.weight[0, 0] += 1e-3
    assert base_sha256(other) != want


def test_bad_configs_are_refused():
    with pytest.raises(UserError, match="at least 1"):
        LoraConfig(r=0)
    with pytest.raises(UserError, match="alpha"):
        LoraConfig(alpha=0)
    with pytest.raises(UserError, match="wz is not"):
        LoraConfig.from_dict({"r": 4, "targets": "wq,wz"})
    with pytest.raises(UserError, match="w_gate does not exist"):
        apply_lora(tiny_model(0, ffn="gelu"), LoraConfig(targets=("w_gate",)))
    cfg = LoraConfig.from_dict({"r": 4, "alpha": 8, "dropout": 0.1, "targets": ["wq", "wv"], "base": {}})
    assert cfg == LoraConfig(4, 8.0, 0.1, ("wq", "wv")) and LoraConfig.from_dict(cfg.to_dict()) == cfg


def test_merging_onto_an_int8_base_is_refused():
    model = apply_lora(quantize_int8(tiny_model(0)), LoraConfig(r=2))
    out, loss = model(IDS, targets=IDS)  # an int8 base adapts (its adapter is fp32) and trains
    loss.backward()
    assert torch.isfinite(out).all() and all(m.lora_B.grad.abs().sum() > 0 for m in L.lora_modules(model).values())
    with pytest.raises(UserError, match="quantized"):
        merge_lora(model)


# ----------------------------------------------------------------------------- adapter checkpoints and load


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    """A tiny checkpoint with a tokenizer: (folder, model)."""
    folder = tmp_path_factory.mktemp("lora") / "base"
    model, _ = tiny_checkpoint(folder, synthetic_text(200, 0))
    return folder, model


def _saved_adapter(base_folder, base_model, dst, r=4, seed=3):
    import copy

    from glassformer.checkpoint.adapters import save_adapter

    model = _randomise_B(apply_lora(copy.deepcopy(base_model), LoraConfig(r=r)), seed=seed)
    save_adapter(dst, model, base_folder, tokenizer=None)
    return model


def test_an_adapter_checkpoint_loads_onto_its_base(base_ckpt, tmp_path, monkeypatch):
    import shutil

    from glassformer.checkpoint.loading import load
    from safetensors.torch import load_file

    folder, base = base_ckpt
    shutil.copytree(folder, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    want_model = _saved_adapter("base", base, Path("runs") / "adapter")
    meta = json.loads((tmp_path / "runs" / "adapter" / "config.json").read_text())
    assert meta["lora"]["r"] == 4 and meta["lora"]["alpha"] == 16.0 and meta["lora"]["targets"] == list(LORA_TARGETS)
    assert meta["lora"]["base"] == {"path": "../base", "sha256": base_sha256(base)}  # relative to the run
    monkeypatch.chdir(tmp_path / "runs")  # found from the adapter's folder, wherever the process is
    tmp_path = tmp_path / "runs"
    assert (tmp_path / "adapter" / "COMPLETE").is_file() and not (tmp_path / "adapter" / "model.safetensors").exists()
    stored = load_file(str(tmp_path / "adapter" / "adapter.safetensors"))
    assert set(stored) == set(adapter_state(want_model))
    model, tok = load(tmp_path / "adapter")
    assert tok is not None  # the base's tokenizer when the adapter has none
    assert torch.equal(model(IDS)[0], want_model(IDS)[0])


def test_the_adapter_file_grows_with_r_and_not_with_the_base(tmp_path):
    from glassformer.checkpoint.adapters import save_adapter

    sizes = {}
    for dim_ffn in (64, 256):  # a larger base: only the base's feed-forward grows
        for r in (2, 8):
            m = apply_lora(tiny_model(0, ffn_dim=dim_ffn), LoraConfig(r=r, targets=("wq", "wv")))
            save_adapter(tmp_path / f"a{dim_ffn}-{r}", m, tmp_path / "nowhere")
            sizes[dim_ffn, r] = (tmp_path / f"a{dim_ffn}-{r}" / "adapter.safetensors").stat().st_size
    assert sizes[64, 8] > 3 * sizes[64, 2]
    assert abs(sizes[256, 8] - sizes[64, 8]) < 200  # the same tensors: only the header's text may differ


def test_a_moved_base_is_found_with_base_and_a_different_base_is_refused(base_ckpt, tmp_path):
    import shutil

    from glassformer.checkpoint.folders import save_model
    from glassformer.checkpoint.loading import load

    folder, base = base_ckpt
    moved = tmp_path / "base"
    shutil.copytree(folder, moved)
    want_model = _saved_adapter(moved, base, tmp_path / "run" / "adapter")
    shutil.move(moved, tmp_path / "elsewhere")
    with pytest.raises(UserError, match="pass --base"):
        load(tmp_path / "run" / "adapter")
    model, _ = load(tmp_path / "run" / "adapter", base=tmp_path / "elsewhere")
    assert torch.equal(model(IDS)[0], want_model(IDS)[0])
    other = tiny_model(5, vocab_size=base.config.vocab_size)
    save_model(tmp_path / "other", other)
    with pytest.raises(UserError) as e:
        load(tmp_path / "run" / "adapter", base=tmp_path / "other")
    assert base_sha256(base) in str(e.value) and base_sha256(other) in str(e.value) and "other" in str(e.value)


# ----------------------------------------------------------------------------- convert --merge-lora


def test_convert_merge_lora_writes_a_plain_checkpoint(base_ckpt, tmp_path, capsys):
    from glassformer.checkpoint.loading import load
    from glassformer.cli import main

    folder, base = base_ckpt
    want_model = _saved_adapter(folder, base, tmp_path / "adapter")
    assert main(["convert", "--merge-lora", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    meta = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "lora" not in meta and (tmp_path / "merged" / "model.safetensors").is_file()
    merged, tok = load(tmp_path / "merged")
    assert tok is not None and not L.lora_modules(merged)
    torch.testing.assert_close(merged(IDS)[0], want_model(IDS)[0], rtol=0, atol=1e-6)
    # a plain checkpoint has nothing to merge; --base goes with an adapter run only
    assert main(["convert", "--merge-lora", str(folder), "--out", str(tmp_path / "m2")]) == 2
    assert "no LoRA adapter" in capsys.readouterr().err and not (tmp_path / "m2").exists()
    assert main(["convert", "--kv-heads", "1", "--checkpoint", str(folder), "--base", str(folder),
                 "--out", str(tmp_path / "m3")]) == 2
    assert "--base goes with" in capsys.readouterr().err and not (tmp_path / "m3").exists()


def test_merging_onto_a_quantized_base_is_refused_and_nothing_is_written(base_ckpt, tmp_path, capsys):
    from glassformer.checkpoint.adapters import save_adapter
    from glassformer.checkpoint.loading import load
    from glassformer.cli import main

    folder, _ = base_ckpt
    assert main(["convert", "--quantize", "int8", "--checkpoint", str(folder), "--out", str(tmp_path / "q")]) == 0
    qmodel, _ = load(tmp_path / "q")
    save_adapter(tmp_path / "adapter", apply_lora(qmodel, LoraConfig(r=2)), tmp_path / "q")
    capsys.readouterr()
    assert main(["convert", "--merge-lora", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "quantized" in err
    assert not (tmp_path / "merged").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_generate_eval_and_trace_take_an_adapter_run(base_ckpt, tmp_path, capsys):
    """Each verb reads the adapter through load: generate's greedy text equals the merged
    checkpoint's, eval's line too (to rounding), and trace runs the adapted model (its config
    stays a ModelConfig, which the page reads back)."""
    from glassformer import ModelConfig
    from glassformer.cli import main

    folder, base = base_ckpt
    _saved_adapter(folder, base, tmp_path / "adapter", seed=4)
    assert main(["convert", "--merge-lora", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    (tmp_path / "held.txt").write_text("The king walks to the castle. The old man sings of the sea.\n")
    outs = {}
    for name in ("adapter", "merged"):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(tmp_path / name), "--prompt", "The king", "--greedy",
                     "--max-new-tokens", "8"]) == 0
        text = capsys.readouterr().out
        assert main(["eval", "--checkpoint", str(tmp_path / name), "--data", str(tmp_path / "held.txt")]) == 0
        outs[name] = (text, json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs["adapter"][0] == outs["merged"][0]
    assert outs["adapter"][1]["loss"] == pytest.approx(outs["merged"][1]["loss"], abs=1e-5)
    assert main(["trace", "--checkpoint", str(tmp_path / "adapter"), "--text", "The king",
                 "--out", str(tmp_path / "t.json")]) == 0
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["lora"]["r"] == 4 and ModelConfig.from_dict(t["config"]).dim == base.config.dim  # reads back


# ----------------------------------------------------------------------------- cost --lora-r


@pytest.mark.parametrize("overrides, targets", [({}, None), ({"ffn": "gelu", "n_kv_heads": 1}, ("wq", "wo", "w_down"))])
def test_cost_lora_counts_equal_the_real_models_trainable_weights(overrides, targets, capsys):
    from glassformer import ModelConfig, Transformer
    from glassformer.cli import main
    from glassformer.cost import estimate
    from glassformer.cost.lora import TARGETS

    assert TARGETS == LORA_TARGETS
    cfg = ModelConfig.from_preset("tiny", **overrides)
    want_targets = targets or tuple(t for t in LORA_TARGETS if not (t == "w_gate" and cfg.ffn != "swiglu"))
    model = apply_lora(Transformer(cfg), LoraConfig(r=6, targets=want_targets))
    trainable = [p for p in model.parameters() if p.requires_grad]
    report = estimate(cfg, batch=2, seq=16, dtype="fp32", hardware="h100", lora_r=6, lora_targets=want_targets)
    lo = report["lora"]
    assert lo["trainable_weights"] == sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable)  # the optimizer state a LoRA run holds, measured
    model(IDS, targets=IDS)[1].backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    assert lo["optimizer_bytes"] == held
    assert lo["train_memory_by_part"]["grads"] == sum(p.grad.numel() * 4 for p in trainable)
    assert lo["train_memory_by_part"]["base_weights"] == 4 * model.num_params() - 4 * lo["trainable_weights"]
    if targets:  # the command line once, on the preset
        return
    assert main(["cost", "--preset", "tiny", "--lora-r", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora"]["trainable_weights"] == lo["trainable_weights"] and out["lora"]["r"] == 6
    assert main(["cost", "--preset", "tiny", "--lora-r", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- explain


@pytest.mark.parametrize("with_weights", [True, False])
def test_explain_shows_the_base_and_the_adapter_term_and_they_sum_to_the_product(with_weights):
    """At layer 0 the base term is the base model's own q (the same x), independently traced; the
    scaled adapter term is the rest of the adapted q; together the traced value."""
    from glassformer import explain, trace

    ids = IDS[0].tolist()
    base_tr = trace(tiny_model(0), ids)
    model = adapted(0, LoraConfig(r=3, alpha=6.0, targets=("wq", "w_down")))
    tr = trace(model, ids, with_weights=with_weights)
    assert tr.lora["r"] == 3 and "lora" not in tr.config  # config stays exactly ModelConfig's
    for probe, idx in (("blocks.0.attn.q", [2, 1, 5]), ("blocks.1.ffn.down", [4, 7])):
        e = explain(tr, probe, idx, model=None if with_weights else model)
        last = e.steps[-1]
        assert "(α/r)" in last["formula"] and e.text.count("(the adapter term)") == 1
        base_step, adapter_step = (e.steps[t[-1]["index"][0]] for t in last["terms"][:2])
        assert last["terms"][1][0]["value"] == 2.0  # alpha / r
        assert "the base term" in base_step["formula"] and "the adapter term" in adapter_step["formula"]
        assert base_step["value"] + 2.0 * adapter_step["value"] == pytest.approx(e.result, abs=1e-12)
        assert e.result == pytest.approx(e.value, abs=1e-4)
        if probe == "blocks.0.attn.q":
            assert base_step["value"] == pytest.approx(base_tr.value(probe, idx), abs=1e-4)
            assert abs(adapter_step["value"]) > 1e-3  # the adapter does add something here


def test_quantizing_an_adapted_model_quantizes_the_bases_and_keeps_the_adapters():
    from glassformer.convert.quantize import Int8Linear

    model = adapted(0, LoraConfig(r=2, targets=("wq", "w_up")))
    want, _ = model(IDS)
    quantize_int8(model)
    wq = model.blocks[0].attn.wq
    assert isinstance(wq, LoRALinear) and isinstance(wq.base, Int8Linear) and wq.lora_A.dtype == torch.float32
    assert isinstance(model.blocks[0].attn.wk, Int8Linear)
    got, _ = model(IDS)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # int8 rounding, not another model
