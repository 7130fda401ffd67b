"""One forward: a PyTorch hook on any module changes generation, batches, traces and a compiled
session exactly as it changes model(ids), and removing it restores the old tokens."""

from __future__ import annotations

import pytest
import torch

from glassformer import generate, trace
from glassformer.generation.session import Session

from ..support import greedy_by_full_forward, reinit, tiny_model

PROMPT = [5, 3, 9, 1, 7]
STEPS = 8

# Every kind of module whose forward runs: blocks, attention, FFN, norms, the leaf projections.
MODULES = ["blocks.1", "blocks.1.attn", "blocks.1.ffn", "blocks.1.attn_norm", "blocks.1.ffn_norm", "final_norm",
           "blocks.1.attn.wq", "blocks.1.attn.wk", "blocks.1.attn.wv", "blocks.1.attn.wo",
           "blocks.1.ffn.w_up", "blocks.1.ffn.w_gate", "blocks.1.ffn.w_down", "lm_head", "embed"]


def _flip_output(module, args, out):
    return out.flip(-1) * 4  # a change no later layer undoes (a norm alone would undo a scale)


def _flip_input(module, args):
    return (args[0].flip(-1), *args[1:])  # features reversed


def _hook(model, name: str, kind: str):
    m = model.get_submodule(name)
    if kind == "forward":
        return m.register_forward_hook(_flip_output)
    return m.register_forward_pre_hook(_flip_input)


@pytest.fixture(scope="module")
def model():
    # Large weights: every module matters to the next token, so each hook below changes some token.
    return reinit(tiny_model(n_layers=2), std=0.3)


@pytest.mark.parametrize("kind", ["forward", "pre"])
@pytest.mark.parametrize("name", MODULES)
def test_a_hook_changes_generate_as_it_changes_the_model(model, name, kind):
    if kind == "pre" and name == "embed":
        pytest.skip("reversing the ids changes which tokens exist, not one step: covered by the forward hook")
    plain = list(generate(model, PROMPT, max_new_tokens=STEPS, greedy=True))
    assert plain == greedy_by_full_forward(model, PROMPT, STEPS)
    handle = _hook(model, name, kind)
    try:
        want = greedy_by_full_forward(model, PROMPT, STEPS)  # the hooked model's own argmax, step by step
        got = list(generate(model, PROMPT, max_new_tokens=STEPS, greedy=True))
    finally:
        handle.remove()
    assert want != plain, "the hook should change the tokens, or this test shows nothing"
    assert got == want
    assert list(generate(model, PROMPT, max_new_tokens=STEPS, greedy=True)) == plain  # removed: as before


@pytest.mark.parametrize("name", ["blocks.0.attn.wv", "blocks.1.ffn", "blocks.0.attn_norm", "lm_head"])
def test_a_hook_changes_batched_generation_row_by_row(model, name):
    prompts = [PROMPT, [2, 4], [8, 6, 4, 2, 1, 3, 5]]
    handle = _hook(model, name, "forward")
    try:
        alone = [greedy_by_full_forward(model, p, STEPS) for p in prompts]
        steps = list(Session(model, 3).send(prompts, max_new_tokens=STEPS, greedy=True))
    finally:
        handle.remove()
    assert [[s[b] for s in steps] for b in range(3)] == alone
    assert alone != [greedy_by_full_forward(model, p, STEPS) for p in prompts]


@pytest.mark.parametrize("name", ["blocks.0.ffn.w_down", "blocks.1.attn"])
def test_a_hook_changes_the_trace_the_explorer_draws(model, name):
    """The explorer draws viewer.source.trace_for_page's trace (the tiled kernel, the top logits):
    its logits follow a hook as model(ids) does, and so do glassformer.trace's."""
    from glassformer.viewer.source import trace_for_page

    ids = torch.tensor([PROMPT])
    handle = _hook(model, name, "forward")
    try:
        with torch.no_grad():
            want, _ = model(ids)
        t = trace(model, PROMPT)
        page = trace_for_page(model, PROMPT, [str(i) for i in PROMPT])
    finally:
        handle.remove()
    with torch.no_grad():
        plain, _ = model(ids)
    torch.testing.assert_close(torch.as_tensor(t.probes["logits"].data), want[0], rtol=1e-5, atol=1e-5)
    top = torch.as_tensor(page.probes["logits"].index["vocab"])  # (T, k): the page keeps the top logits
    assert torch.equal(top[:, 0], want[0].argmax(-1))  # the next token the page names is the hooked model's
    torch.testing.assert_close(torch.as_tensor(page.probes["logits"].data), want[0].gather(-1, top), rtol=1e-4, atol=1e-4)
    assert (want - plain).abs().max() > 1e-2


def test_a_compiled_session_follows_hooks_added_and_removed_after_it_compiled():
    model = tiny_model(n_layers=2)
    s = Session(model, compile=True)
    plain = list(s.send(PROMPT, max_new_tokens=STEPS, greedy=True))
    assert plain == greedy_by_full_forward(model, PROMPT, STEPS) and s.recompiles == 0
    handle = model.blocks[1].ffn.w_down.register_forward_hook(_flip_output)
    s.reset()
    hooked = list(s.send(PROMPT, max_new_tokens=STEPS, greedy=True))
    want = greedy_by_full_forward(model, PROMPT, STEPS)
    handle.remove()
    s.reset()
    again = list(s.send(PROMPT, max_new_tokens=STEPS, greedy=True))
    assert want != plain and hooked == want
    assert again == plain and s.recompiles == 2  # once for the hook, once for its removal


class Doubled(torch.nn.Module):
    """A module replacing a projection from outside the model, as an adapter or a quantized layer
    would: it has no weight, bias or out_features of its own."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


def test_a_replaced_projection_runs_in_training_generation_and_batches():
    model = reinit(tiny_model(n_layers=2), std=0.3)
    plain = list(generate(model, PROMPT, max_new_tokens=STEPS, greedy=True))  # installs glassformer.speed
    model.blocks[0].attn.wq = Doubled(model.blocks[0].attn.wq)
    model.blocks[1].ffn.w_gate = Doubled(model.blocks[1].ffn.w_gate)
    model.lm_head = Doubled(model.lm_head)
    ids = torch.tensor([PROMPT])
    _, loss = model.train()(ids, targets=ids)  # many rows with gradients: the joined QKV steps aside
    loss.backward()
    assert model.blocks[0].attn.wq.inner.weight.grad is not None
    model.eval()
    want = greedy_by_full_forward(model, PROMPT, STEPS)
    assert want != plain
    assert list(generate(model, PROMPT, max_new_tokens=STEPS, greedy=True)) == want
    prompts = [PROMPT, [2, 4]]
    steps = list(Session(model, 2).send(prompts, max_new_tokens=STEPS, greedy=True))
    assert [[s[b] for s in steps] for b in range(2)] == [greedy_by_full_forward(model, p, STEPS) for p in prompts]
