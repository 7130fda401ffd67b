"""Interventions change the next-token distribution exactly as the same change made by hand would."""

import copy

import pytest
import torch

from glassformer import probes
from glassformer.errors import UserError
from glassformer.tracing.interventions import ablate, logit_lens, patch, remove_head, run_with

from ..support import tiny_model

IDS = [4, 81, 9, 200, 33, 7]
OTHER = [12, 6, 410, 3, 95, 61]


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0]


@pytest.mark.parametrize("over", [{}, dict(norm_placement="post", n_kv_heads=4)])
def test_zero_ablating_a_heads_z_equals_removing_its_wo_columns_by_hand(over):
    m = tiny_model(**over)
    layer, head, H = 1, 2, m.config.head_dim
    r = ablate(m, IDS, f"blocks.{layer}.attn.z", head=head)
    by_hand = copy.deepcopy(m)
    with torch.no_grad():
        by_hand.blocks[layer].attn.wo.weight[:, head * H:(head + 1) * H] = 0
    assert torch.allclose(r.logits_after, logits_of(by_hand, IDS), atol=1e-6)
    assert torch.allclose(r.logits_before, logits_of(m, IDS), atol=1e-6)
    assert not torch.allclose(r.logits_after, r.logits_before, atol=1e-4)
    assert r.kl > 0
    rh = remove_head(m, IDS, layer, head)
    assert torch.equal(rh.logits_after, r.logits_after)
    assert not probes.active()


def test_mean_ablation_puts_the_token_mean_in_place():
    m = tiny_model()
    name = "blocks.0.ffn.down"
    _, seen = run_with(m, IDS, {}, record=[name])
    mean = seen[name].mean(dim=1, keepdim=True)  # (1, 1, D)
    _, after = run_with(m, IDS, {name: lambda n, x: x.mean(1, keepdim=True).expand_as(x)}, record=[name])
    assert torch.allclose(after[name], mean.expand_as(seen[name]))
    # Same change made by hand: the FFN's output replaced by its mean over the text.
    r = ablate(m, IDS, name, mode="mean")
    mean_out = mean[0, 0]

    class Const(torch.nn.Module):
        def forward(self, x):
            return mean_out.expand(*x.shape[:-1], -1)  # (B, T, D)

    by_hand = copy.deepcopy(m)
    by_hand.blocks[0].ffn.w_down = Const()
    assert torch.allclose(r.logits_after, logits_of(by_hand, IDS), atol=1e-6)


def test_patching_the_last_stream_from_another_text_gives_that_texts_logits():
    m = tiny_model()
    r = patch(m, IDS, "blocks.1.resid_out", OTHER)
    assert torch.allclose(r.logits_after, logits_of(m, OTHER), atol=1e-6)
    # Patch one token of the first block's output: positions before it cannot change (causal).
    r = patch(m, IDS, "blocks.0.resid_out", OTHER, tokens=[3])
    assert torch.allclose(r.logits_after[:3], r.logits_before[:3], atol=1e-6)
    assert not torch.allclose(r.logits_after[3:], r.logits_before[3:], atol=1e-5)


def test_intervention_report_and_bad_requests():
    m = tiny_model()
    r = ablate(m, IDS, "blocks.0.attn.out", position=2)
    d = r.to_dict(top=3)
    p, q = torch.softmax(r.logits_before[2].double(), -1), torch.softmax(r.logits_after[2].double(), -1)
    assert d["position"] == 2 and [row["id"] for row in d["before"]] == p.topk(3).indices.tolist()
    assert d["after"][0]["after"] == pytest.approx(float(q.max()))
    assert d["kl"] == pytest.approx(float((p * (p / q).log()).sum()))
    with pytest.raises(UserError, match="only shown"):
        ablate(m, IDS, "blocks.0.attn.weights")
    with pytest.raises(UserError):
        ablate(m, IDS, "blocks.0.resid_mid", head=1)
    with pytest.raises(UserError):
        ablate(m, IDS, "blocks.7.attn.z")


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_logit_lens_last_layer_equals_the_models_logits(placement):
    m = tiny_model(norm_placement=placement)
    lens = logit_lens(m, IDS)
    assert lens.shape == (m.config.n_layers, len(IDS), m.config.vocab_size)
    assert torch.allclose(lens[-1], logits_of(m, IDS), atol=1e-6)
    # The first block's lens: its stream through final norm and head, computed by hand.
    _, seen = run_with(m, IDS, {}, record=["blocks.0.resid_out", "blocks.0.ffn_norm"])
    stream = seen["blocks.0.resid_out" if placement == "pre" else "blocks.0.ffn_norm"][0]
    with torch.no_grad():
        ref = m.final_norm(stream) @ m.lm_head.weight.t()
    assert torch.allclose(lens[0], ref, atol=1e-6)


def test_interventions_on_the_families_probes():
    """A sink's weight is only shown; an expert's own probe holds its routed tokens, so tokens= is refused
    there by name, while zeroing the whole expert's output changes the mixture by exactly its share."""
    m = tiny_model(attn_sinks=True, n_experts=4, n_active_experts=2)
    with pytest.raises(UserError, match="only shown"):
        ablate(m, IDS, "blocks.0.attn.sink_weight")
    with pytest.raises(UserError, match="routed to that expert.*expert_out"):
        ablate(m, IDS, "blocks.0.ffn.experts.1.down", tokens=[0])
    _, rec = run_with(m, IDS, {"blocks.1.ffn.experts.2.down": lambda n, x: torch.zeros_like(x)},
                      record=["blocks.1.ffn.down", "blocks.1.ffn.expert_ids", "blocks.1.ffn.expert_weights"])
    _, base = run_with(m, IDS, {}, record=["blocks.1.ffn.down", "blocks.1.ffn.expert_out"])
    ids, w = rec["blocks.1.ffn.expert_ids"][0], rec["blocks.1.ffn.expert_weights"][0]
    share = ((ids == 2).float() * w)[..., None] * base["blocks.1.ffn.expert_out"][0]  # (T, k, D)
    assert torch.allclose(rec["blocks.1.ffn.down"][0], base["blocks.1.ffn.down"][0] - share.sum(1), atol=1e-5)
