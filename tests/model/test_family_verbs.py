"""Every verb on a model with the families' switches on (docs/model.md#families): a dense one with
Gemma's, OLMo's, Qwen3's and SmolLM3's parts together, and a gpt-oss-like mixture of experts with
sinks. Each verb must run end to end on them; the numbers themselves are checked against
transformers in tests/convert/ and against their formulas in test_family_parts.py."""

import io
import json
import sys

import pytest
import torch

from glassformer import Transformer
from glassformer.config import ModelConfig

from ..support import reinit, run_cli, synthetic_text

SWITCHES = {
    "dense": dict(norm_offset=True, norm_placement="sandwich", ffn="geglu", embed_scale=True, qk_norm="head",
                  query_pre_attn_scalar=16.0, attn_softcap=20.0, logit_softcap=30.0, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"], rope_local_theta=100.0, nope_layers=[1]),
    "moe": dict(attn_bias=True, attn_sinks=True, ffn="swiglu_clamp", ffn_bias=True, n_experts=4, n_active_experts=2,
                expert_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                router_aux_loss_coef=0.01),
}


@pytest.fixture(scope="module", params=list(SWITCHES))
def family(request, tmp_path_factory):
    from glassformer.checkpoint.folders import save_model
    from glassformer.text.chat_template import CHATML_TEMPLATE
    from glassformer.text.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp(request.param)
    text = synthetic_text(200, 3)
    tok = Tokenizer.train([text], vocab_size=300)
    tok.add_chat_tokens()
    tok.chat_template = CHATML_TEMPLATE
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      **SWITCHES[request.param])
    torch.manual_seed(0)
    model = reinit(Transformer(cfg), std=0.08).eval()
    save_model(root / "ckpt", model, tok)
    (root / "text.txt").write_text(text[:3000])
    return root


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_generate_chat_eval_and_int8(family, capsys, monkeypatch):
    ck = str(family / "ckpt")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand again\n"))
    assert run_cli(["chat", "--checkpoint", ck, "--greedy", "--max-new-tokens", "5"]) == 0
    assert run_cli(["generate", "--checkpoint", ck, "--prompt", "the cat", "--max-new-tokens", "6", "--greedy"]) == 0
    assert run_cli(["eval", "--checkpoint", ck, "--data", str(family / "text.txt")]) == 0
    line = _last_json(capsys.readouterr().out)
    assert 0 < line["loss"] < 20 and line["tokens"] > 100
    assert run_cli(["convert", "--quantize", "int8", "--checkpoint", ck, "--out", str(family / "int8")]) == 0
    assert run_cli(["generate", "--checkpoint", str(family / "int8"), "--prompt", "the cat", "--max-new-tokens", "4",
                    "--greedy"]) == 0


def test_trace_explain_and_cost(family, capsys):
    ck, out = str(family / "ckpt"), family / "trace.json"
    assert run_cli(["trace", "--checkpoint", ck, "--text", "the cat sat on the mat", "--out", str(out), "--with-weights"]) == 0
    probes = json.loads(out.read_text())["probes"]
    if "moe" in family.name:
        assert "blocks.0.ffn.expert_weights" in probes and "blocks.1.attn.sink_weight" in probes
    else:
        assert "blocks.0.attn_post_norm" in probes and "blocks.1.attn.q_norm" in probes
    capsys.readouterr()
    from glassformer import explain

    new = (["blocks.0.ffn.down", "blocks.1.attn.sink_weight"] if "moe" in family.name
           else ["blocks.0.attn_post_norm", "blocks.1.attn.q_norm"])
    for probe in ["logits"] + new:
        data = torch.tensor(probes[probe]["data"])
        index = [2] + [0] * (data.dim() - 1)
        e = explain(out, probe, index)  # a rule for each new probe, recomputing the traced number
        assert e.result == pytest.approx(float(data[tuple(index)]), rel=1e-4, abs=1e-5), probe
    assert run_cli(["cost", "--checkpoint", ck, "--json"]) == 0
    report = _last_json(capsys.readouterr().out)
    from glassformer.checkpoint.loading import load

    model, _ = load(ck)
    assert report["params"] == sum(p.numel() for p in model.parameters())  # every new weight counted
    if "moe" in family.name:  # two of four experts active
        assert report["params_active"] < report["params"]


def test_train_with_lora(family, capsys):
    data = family / "data"
    assert run_cli(["prepare", "--corpus", str(family / "text.txt"), "--out", str(data), "--context", "32",
                    "--tokenizer", str(family / "ckpt" / "tokenizer.json")]) == 0
    run = family / "run"
    assert run_cli(["train", "--data", str(data), "--out", str(run), "--init-from", str(family / "ckpt"),
                    "--max-steps", "3", "--batch-size", "2", "--seq-len", "32", "--lora-r", "4",
                    "--eval-every", "3", "--eval-tokens", "64"]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in x for x in lines)


def test_the_serve_engine_batches_them_as_generate_runs_them_alone(family):
    """`serve`'s continuous batching (rows at their own positions, padded keys, prefill in chunks) gives each
    request the tokens `generate` gives it alone: the windows, sinks and routes hold row by row."""
    from glassformer import generate
    from glassformer.checkpoint.loading import load
    from glassformer.generation.batching import Engine, Request

    model, _ = load(str(family / "ckpt"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 13, 7, 20)]
    alone = [list(generate(model, p, max_new_tokens=12, greedy=True)) for p in prompts]
    engine = Engine(model, max_batch=3, prefill_chunk=8)
    tickets = [engine.submit(Request(p, 12, temperature=0)) for p in prompts]
    while engine.step():
        pass
    assert [[e.token for e in t.events(timeout=30) if e.token is not None] for t in tickets] == alone
