"""The stream wiring (probes.STREAM_WIRING) against the model, and each shared fact defined once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from glassformer.probes import STREAM_WIRING, final_norm_reads, stream_points, stream_probes, stream_wiring
from glassformer.tracing.stream import placement_twins, stream_rms
from glassformer.tracing.trace import trace
from ..support import tiny_model

IDS = [3, 1, 4, 1, 5, 9, 2, 6]
SRC = Path(__file__).resolve().parents[2] / "src" / "glassformer"


def _module_inputs(model) -> dict[str, torch.Tensor]:
    """What each block, its norms, attention and feed-forward, and the final norm receive (the
    model's own modules, by forward pre-hooks: no probe involved)."""
    seen, hooks = {}, []

    def keep(name):
        def hook(module, args):
            seen[name] = args[0].detach()[0].float().clone()  # (T, D), batch row 0
        return hook

    for i, b in enumerate(model.blocks):
        for part, mod in (("block", b), ("attn_norm", b.attn_norm), ("attn", b.attn), ("ffn_norm", b.ffn_norm),
                          ("ffn", b.ffn), ("attn_post_norm", b.attn_post_norm), ("ffn_post_norm", b.ffn_post_norm)):
            if mod is not None:  # the post norms exist with sandwich norms only
                hooks.append(mod.register_forward_pre_hook(keep(f"{i}.{part}")))
    hooks.append(model.final_norm.register_forward_pre_hook(keep("final_norm")))
    hooks.append(model.blocks[-1].register_forward_hook(lambda m, a, out: seen.__setitem__("last_out", out.detach()[0].float())))
    try:
        with torch.no_grad():
            model(torch.tensor([IDS]))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "post_branch"])
def test_the_tables_probes_hold_the_stream_the_modules_read(placement):
    model = tiny_model(n_layers=3, norm_placement=placement)
    tr = trace(model, IDS)
    got = _module_inputs(model)
    L = model.config.n_layers
    reads = [("attn_reads", "attn"), ("ffn_reads", "ffn"), ("attn_norm_reads", "attn_norm"), ("ffn_norm_reads", "ffn_norm")]
    if placement == "sandwich":
        reads += [("attn_post_norm_reads", "attn_post_norm"), ("ffn_post_norm_reads", "ffn_post_norm")]
    for i in range(L):
        w = stream_probes(i, placement)
        # The stream entering block i is what block i reads, and what block i-1 leaves.
        assert torch.allclose(tr[w["in"]], got[f"{i}.block"], atol=1e-6), (i, w["in"])
        if i > 0:
            assert w["in"] == stream_probes(i - 1, placement)["out"]
        for key, module in reads:
            assert torch.allclose(tr[w[key]], got[f"{i}.{module}"], atol=1e-6), (i, key, w[key])
        # The stream after the attention addition: the sum itself (pre, sandwich, post_branch) or its norm (post);
        # what each addition adds is the branch's last probe (attn_adds, ffn_adds).
        mid_sum = tr[w["in"]] + tr[w["attn_adds"]]
        assert torch.allclose(tr[f"blocks.{i}.resid_mid"], mid_sum, atol=1e-5)
        assert (w["mid"] == f"blocks.{i}.resid_mid") == (placement != "post")
        assert torch.allclose(tr[f"blocks.{i}.resid_out"], tr[w["mid"]] + tr[w["ffn_adds"]], atol=1e-5)
        if placement in ("pre", "post"):
            assert (w["attn_adds"], w["ffn_adds"]) == (f"blocks.{i}.attn.out", f"blocks.{i}.ffn.down")
    # The stream leaving the last block is what the final norm reads.
    assert final_norm_reads(L, placement) == stream_probes(L - 1, placement)["out"]
    assert torch.allclose(tr[final_norm_reads(L, placement)], got["final_norm"], atol=1e-6)
    assert torch.allclose(tr[final_norm_reads(L, placement)], got["last_out"], atol=1e-6)
    assert stream_points(L, placement) == ["embed"] + [p for w in stream_wiring(L, placement) for p in (w["mid"], w["out"])]


@pytest.mark.parametrize("placement", ["sandwich", "post_branch"])
def test_attention_only_blocks_of_the_families_placements(placement):
    model = tiny_model(n_layers=2, norm_placement=placement, ffn="none")
    tr = trace(model, IDS)
    for i in range(2):
        w = stream_probes(i, placement, "none")
        assert w["out"] == w["mid"] == f"blocks.{i}.resid_mid" and not any(k.startswith("ffn") for k in w)
        assert torch.allclose(tr[w["mid"]], tr[w["in"]] + tr[w["attn_adds"]], atol=1e-5)


def test_post_norm_streams_have_rms_one_and_the_twins_share_weights():
    pre = tiny_model(n_layers=2)
    with torch.no_grad():
        for name, p in pre.named_parameters():
            if "norm" in name:
                p.fill_(1.0)  # γ = 1: a post-norm stream then has RMS 1 exactly (up to ε)
    twins = placement_twins(pre)
    assert twins["pre"] is pre and twins["post"].config.norm_placement == "post"
    assert pre.config.norm_placement == "pre"  # the original is left alone
    for k, v in pre.state_dict().items():
        assert torch.equal(v, twins["post"].state_dict()[k]), k
    tr = trace(twins["post"], IDS)
    for p in stream_points(2, "post")[1:]:  # every stream after an addition is a norm's output (γ = 1)
        assert torch.allclose(stream_rms(tr[p]), torch.ones(len(IDS), dtype=torch.float64), atol=1e-3), p


# ----------------------------------------------------------------------------- defined once


def _sources(exts=(".py", ".js")) -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text(encoding="utf-8") for p in SRC.rglob("*") if p.suffix in exts}


def test_the_stream_wiring_is_defined_once_and_imported_elsewhere():
    files = _sources()
    defs = [f for f, text in files.items() if re.search(r"^STREAM_WIRING\s*=", text, re.M)]
    assert defs == ["probes.py"]
    assert set(STREAM_WIRING) == {"pre", "post", "sandwich", "post_branch"}
    # Nowhere else does a line choose a stream probe by the norm placement (as
    # `"resid_out" if pre else "ffn_norm"` did in five modules and glass.js).
    leaves = r"(resid_mid|resid_out|attn_norm|ffn_norm)"
    placement = r"(norm_placement|postNorm|\bpost\b|\bpre\b|\.pre\b)"
    offenders = [f"{f}:{n + 1}: {line.strip()}" for f, text in files.items() if f not in ("probes.py", "model.py")
                 for n, line in enumerate(text.splitlines())
                 if re.search(leaves, line) and re.search(placement, line) and not line.lstrip().startswith(("#", "//", "*"))
                 and "`" not in line.split(leaves)[0][-1:]]
    assert offenders == []
    for user in ("explaining/rules.py", "tracing/analysis.py", "tracing/interventions.py", "tracing/trace.py",
                 "viewer/render.py", "worked/model.py"):
        assert re.search(r"from \.\.probes import .*\b(stream_probes|stream_wiring|stream_points|final_norm_reads)\b",
                         files[user]), user
    assert "P().wiring" in files["viewer/static/glass.js"]


def test_the_tile_walk_is_defined_once():
    files = _sources()
    # The online softmax recurrence (alpha = exp(m_old - m_new) rescaling l and o) is computed
    # only by the kernel; the walk of one row is read out of the kernel's log only in tiles.py.
    recur = [f for f, text in files.items() if re.search(r"alpha\s*\*\s*[lo]\b|Math\.exp\(m\b|exp\(m\s*-", text)]
    assert recur == ["attention/tiled.py"]
    walkers = [f for f, text in files.items() if re.search(r"^def (row_walk|kernel_log|kernel_walk|head_walk)\(", text, re.M)]
    assert walkers == ["tracing/tiles.py"]
    logs = sorted(f for f, text in files.items() if "tile_log=" in text)
    assert logs == ["attention/tiled.py", "tracing/tiles.py", "tracing/trace.py"]  # trace: the model's own run
    for user in ("tracing/trace.py", "tracing/analysis.py", "viewer/render.py", "viewer/source.py", "worked/model.py",
                 "worked/figures.py"):
        assert re.search(r"from \.\.tracing\.tiles import|from \.tiles import", files[user]), user
    assert "onlineSoftmax" not in files["viewer/static/glass.js"]


def test_the_stream_rms_and_the_twin_are_defined_once():
    files = _sources((".py",))
    rms = [f for f, text in files.items() if re.search(r"pow\(2\)\.mean\(-?1?\)?\.?sqrt|\.pow\(2\)\.mean\(-1\)\.sqrt", text)]
    assert rms == ["tracing/stream.py"]
    twins = [f for f, text in files.items() if re.search(r"\.norm_placement\s*=[^=]|replace\(norm_placement=", text)
             and f != "config.py"]
    assert twins == ["tracing/stream.py"]
    js = _sources((".js",))["viewer/static/glass.js"]
    assert "Math.sqrt(s / v.length)" not in js and "P().rms" in js
