"""Every switch is a real path: it changes the output, and the model still learns."""

import pytest
import torch

from glassformer import ModelConfig, Transformer

VARIANTS = {
    "post-norm": dict(norm_placement="post"),
    "layernorm": dict(norm="layer"),
    "relu": dict(ffn="relu"),
    "gelu": dict(ffn="gelu"),
    "gelu_tanh": dict(ffn="gelu_tanh"),
    "learned-pos": dict(pos="learned"),
    "no-pos": dict(pos="none"),
    "bias": dict(bias=True),
    "qkv-bias": dict(qkv_bias=True),
    "tied": dict(tie_embeddings=True),
    "sliding-window": dict(sliding_window=4),
    "interleaved-rope": dict(rope_pairs="interleaved"),
}
BASE = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def _build(**kw):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, **kw}))
    with torch.no_grad():  # non-trivial biases and gains, so that switching them on matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.mul_(5.0)
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_switch_changes_output(name):
    ids = torch.randint(0, 64, (2, 16))
    base, variant = _build(), _build(**VARIANTS[name])
    # Same weights wherever both have them, so only the switch can make the difference.
    shared = {k: v for k, v in base.state_dict().items() if k in variant.state_dict()
              and variant.state_dict()[k].shape == v.shape}
    variant.load_state_dict(shared, strict=False)
    with torch.no_grad():
        a, _ = base.eval()(ids)
        b, _ = variant.eval()(ids)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(VARIANTS))
def test_switch_trains(name):
    """Loss on a fixed batch of 4 random sequences falls by more than half in 60 AdamW steps."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig(**{**BASE, **VARIANTS[name]}))
    data = torch.randint(0, 64, (4, 17))
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first, (first, loss.item())


def test_sliding_window_sees_only_recent_tokens():
    """With a window of 4, the logit at position 10 ignores a change at position 5."""
    model = _build(sliding_window=4, n_layers=1).eval()
    ids = torch.randint(0, 64, (1, 12))
    other = ids.clone()
    other[0, 5] = (ids[0, 5] + 1) % 64
    with torch.no_grad():
        a, b = model(ids)[0], model(other)[0]
    assert (a[0, 10] - b[0, 10]).abs().max() < 1e-6  # 10 - 5 >= 4: out of the window
    assert (a[0, 7] - b[0, 7]).abs().max() > 1e-4  # 7 - 5 < 4: inside it


def test_rope_frequencies_stay_fp32_in_a_bf16_model():
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.model import rope_inv_freq

    cfg = ModelConfig.from_preset("tiny")
    model = Transformer(cfg).to(torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.rope_inv_freq.dtype == torch.float32 and torch.equal(model.rope_inv_freq, rope_inv_freq(cfg))
    assert model.half().rope_inv_freq.dtype == torch.float32
    assert Transformer(cfg).double().rope_inv_freq.dtype == torch.float64  # never lower than fp32, higher kept


@pytest.mark.parametrize("tied", [False, True])
def test_padded_head_gives_the_same_logits_and_gradients(tied, monkeypatch):
    """On a GPU the head multiplies a zero-padded weight (speed.head.head_logits): forced here on the CPU,
    it must give the model's logits, loss and every gradient, the weights keeping their shape."""
    import glassformer.speed.head as M
    from glassformer import speed

    model = speed.install(_build(vocab_size=61, tie_embeddings=tied))  # 61: not a multiple of HEAD_PAD
    assert type(model.lm_head) is speed.PaddedHead
    x, y = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))

    def run():
        model.zero_grad()
        logits, loss = model(x, y)
        loss.backward()
        return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = run()
    monkeypatch.setattr(M, "pads_head", lambda x, V: V % M.HEAD_PAD != 0)
    padded = run()
    assert padded[0].shape == (2, 12, 61) and padded[0].stride(1) == 64  # the padded product's columns, cut
    assert model.lm_head.weight.shape == (61, 32)
    torch.testing.assert_close(padded[0], plain[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(padded[1], plain[1], rtol=0, atol=1e-6)
    for name, g in plain[2].items():
        torch.testing.assert_close(padded[2][name], g, rtol=0, atol=1e-6, msg=name)


def test_head_is_padded_only_for_many_rows_on_a_gpu():
    from types import SimpleNamespace

    from glassformer.speed.head import pads_head

    def x(rows, cuda=True, D=768):  # what pads_head reads of a tensor
        return SimpleNamespace(is_cuda=cuda, shape=(rows, D), numel=lambda: rows * D)

    assert pads_head(x(16 * 1024), 50257)  # a GPT-2 training step
    assert not pads_head(x(16 * 1024), 50304)  # already a multiple of 64
    assert not pads_head(x(1), 50257)  # a decode step: the copy would cost more than it saves
    assert not pads_head(x(16 * 1024, cuda=False), 50257)


@pytest.mark.gpu
def test_padded_head_on_a_gpu_matches_the_plain_product():
    """GPT-2's 50,257-token head over a training step's rows, in bf16 autocast on the GPU: the
    padded product (what the model runs there) against the plain one, forward and backward."""
    from glassformer.speed.head import head_logits, pads_head

    torch.manual_seed(0)
    w = (0.02 * torch.randn(50257, 768, device="cuda")).requires_grad_()
    x = torch.randn(8, 1024, 768, device="cuda", requires_grad=True)
    assert pads_head(x, 50257)
    out = {}
    for pad in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = head_logits(x, w, pad=pad)  # (8, 1024, V)
        logits.float().square().mean().backward()
        out[pad] = (logits.float(), w.grad.clone(), x.grad.clone())
        w.grad, x.grad = None, None
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)
