"""One optimizer update explained number by number (glassformer.explaining.optimizer): the
recomputed gradient is the one training used, bitwise (captured from the training loop itself);
the explained element, and the whole weight, equal the next checkpoint's bitwise, for AdamW and
for Muon; the clipping scale is max_norm / total norm; bad input is a UserError."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.explaining.optimizer import explain_update
from glassformer.text.data import TokenFile, get_batch

from ..support import data  # noqa: F401  (a fixture)

CLIP = 0.05  # small enough that every step clips
ARGS = ["--preset", "tiny", "--max-steps", "3", "--batch-size", "4", "--micro-batch", "2", "--seq-len", "32",
        "--eval-every", "1", "--eval-tokens", "64", "--log-every", "1", "--warmup-steps", "1", "--dropout", "0.1",
        "--keep-last", "10", "--grad-clip", str(CLIP), "--no-progress", "--seed", "5", "--threads", "1",
        "--stats-every", "1"]  # statistics at every step too: they must not move the next step


def train_recording(data, out, optimizer: str) -> dict[int, dict]:
    """Train a run; for each update k (1-based) the gradients its optimizer was given and the norm
    train_step returned, noted by wrapping the optimizer the training loop hands to train_step."""
    import glassformer.train.loop as loop

    seen: dict[int, dict] = {}
    real = loop.train_step

    class Noting:
        def __init__(self, inner, net):
            self.inner, self.net = inner, net

        @property
        def param_groups(self):
            return self.inner.param_groups

        def step(self):
            seen[len(seen) + 1] = {"grads": {n: p.grad.clone() for n, p in self.net.named_parameters()
                                             if p.grad is not None}}
            self.inner.step()

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none=set_to_none)

    def noting_step(net, optimizer, x, y, **kw):
        res = real(net, Noting(optimizer, net), x, y, **kw)
        seen[len(seen)]["grad_norm"] = res.grad_norm
        return res

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "train_step", noting_step)
        assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--optimizer", optimizer]) == 0
    return seen


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("update")
    return {opt: (root / opt, train_recording(data, root / opt, opt)) for opt in ("adamw", "muon")}


def weights(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"step-{step:06d}" / "model.safetensors"))


def direct_gradient(data, run, step: int, name: str) -> torch.Tensor:
    """∇ of the step's mean loss over its two micro-batches, in one backward, from the checkpoint's
    weights, the batch drawn from (seed, step) and the dropout seeded as docs/training.md says."""
    from glassformer.checkpoint.loading import load

    model, _ = load(run / f"step-{step:06d}")
    model.train()
    x, y = get_batch(TokenFile(data / "train.bin"), 4, 32, 5, step)  # (4, 32) each
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5 * 1_000_003 + step)
        loss = sum(model(x[m:m + 2], y[m:m + 2])[1] for m in (0, 2)) / 2
    loss.backward()
    return dict(model.named_parameters())[name].grad


def test_the_recomputed_gradient_is_the_one_training_used(runs, data):  # noqa: F811
    torch.set_num_threads(1)
    run, seen = runs["adamw"]
    name = "blocks.0.attn.wq.weight"
    for step in (1, 2):
        e = explain_update(run, step, name, (3, 5))
        assert torch.equal(e.clipped, seen[step + 1]["grads"][name])  # bitwise: the gradient the optimizer got
        assert e.summary["grad_norm"] == seen[step + 1]["grad_norm"]
        assert e.summary["accum"] == 2 and len(e.summary["micro_losses"]) == 2
        assert all(e.summary["checks"].values()) and e.summary["in_run"]
        assert torch.allclose(e.grad, direct_gradient(data, run, step, name), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("optimizer, name, index, kind", [
    ("adamw", "blocks.0.attn.wq.weight", (3, 5), "adamw"),
    ("adamw", "embed.weight", (7, 2), "adamw"),
    ("adamw", "blocks.1.ffn_norm.weight", (4,), "adamw"),  # no weight decay on a gain
    ("muon", "blocks.1.ffn.w_down.weight", (2, 9), "muon"),
    ("muon", "blocks.0.attn.wk.weight", (1, 0), "muon"),
    ("muon", "embed.weight", (3, 1), "adamw"),  # Muon trains the block matrices only
])
def test_the_explained_update_is_the_step_training_took(runs, optimizer, name, index, kind):
    torch.set_num_threads(1)
    run, _ = runs[optimizer]
    e = explain_update(run, 1, name, index)
    after = weights(run, 2)[name]
    assert e.summary["optimizer"] == kind
    assert e.value == float(after[index])  # the element, bitwise
    assert e.result == e.value and e.bitwise  # the float32 formula, step by step, bitwise
    assert torch.equal(e.new_param, after)  # the whole weight
    assert not torch.equal(after, weights(run, 1)[name])  # it did move
    assert e.steps[-1]["label"] == f"{name}[{', '.join(map(str, index))}]"
    if kind == "muon":
        assert e.summary["matrix_equal"] and any(s["op"] == "newton_schulz" for s in e.steps)


def test_the_clipping_scale_is_max_norm_over_the_norm(runs):
    e = explain_update(runs["muon"][0], 2, "blocks.0.attn.wq.weight", (0, 0))
    s = e.summary
    assert s["clipping"] and s["grad_norm"] > CLIP
    assert s["clip_scale"] == pytest.approx(CLIP / s["grad_norm"], rel=1e-5)
    scale = next(st for st in e.steps if st["label"] == "s")
    assert scale["value"] == s["clip_scale"]
    assert torch.allclose(e.clipped, e.grad * (CLIP / s["grad_norm"]), rtol=1e-5, atol=0)
    last = explain_update(runs["muon"][0], 3, "blocks.0.attn.wq.weight", (0, 0))  # after the run's last step
    assert not last.summary["in_run"] and "would take next" in last.summary["note"]


@pytest.mark.parametrize("step, name, index, words", [
    (7, "embed.weight", "0,0", "choose one of 1, 2, 3"),
    (1, "blocks.0.attn.wq.weigh", "0,0", "did you mean blocks.0.attn.wq.weight"),
    (1, "embed.weight", "0", "give 2 indices"),
    (1, "embed.weight", "0,999", "give 2 indices"),
    (1, "embed.weight", "a,b", "whole numbers"),
])
def test_bad_input_says_what_to_give(runs, step, name, index, words):
    with pytest.raises(UserError, match=words):
        explain_update(runs["adamw"][0], step, name, index)


def test_the_cli_prints_the_calculation(runs, capsys, tmp_path):
    run, _ = runs["adamw"]
    argv = ["explain", "--run", str(run), "--step", "1", "--param", "blocks.0.attn.wv.weight", "--index", "2,3"]
    assert main(argv + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bitwise"] and got["value"] == float(weights(run, 2)["blocks.0.attn.wv.weight"][2, 3])
    assert {"label", "op", "formula", "operands", "value", "text"} <= set(got["steps"][0])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "equals the optimizer's step bitwise" in out and "clipping active" in out
    assert main(["explain", "--run", str(tmp_path / "none"), "--step", "1", "--param", "x", "--index", "0"]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_the_float32_helpers_round_as_torchs_kernels():
    """lerp32 is torch.lerp's CPU kernel and fma32 torch.add(alpha=)'s (Muon's last step), element
    by element, bitwise; a multiply and an add rounded apart would miss some of them."""
    import numpy as np

    from glassformer.explaining.optimizer import fma32, lerp32

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, generator=g) * 1e-3, torch.randn(512, generator=g) * 1e-3  # 512: no scalar tail
    for w in (0.05, 0.95):
        want = torch.lerp(a, b, w)
        got = torch.tensor([float(lerp32(x, y, w)) for x, y in zip(a.tolist(), b.tolist())])
        assert torch.equal(got, want), w
    alpha = float(np.float32(-0.0123))
    want = torch.add(b, a, alpha=alpha)
    got = torch.tensor([float(fma32(x, alpha, y)) for x, y in zip(a.tolist(), b.tolist())])
    apart = torch.tensor([float(np.float32(x) * np.float32(alpha) + np.float32(y))  # float32 throughout
                          for x, y in zip(a.tolist(), b.tolist())])
    assert torch.equal(got, want) and not torch.equal(apart, want)
