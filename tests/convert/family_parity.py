"""Parity checks shared by the family tests (dense and mixture of experts): a tiny random model
built by transformers, converted through a real folder, and compared with transformers itself.

    hf = hf_random(transformers.Qwen3Config(**tiny(...)))   # random weights, norms off identity
    ours = ours_from_hf(hf, tmp_path)                         # save_pretrained -> load_hf
    assert_logits_match(hf, ours, ids)                        # within 1e-4 of the largest logit
    assert_greedy_match(hf, ours, prompt, 20)                 # generate() against our cached greedy
    assert_back_to_hf(ours, hf, ids, tmp_path)                # save_hf -> from_pretrained: 1e-5
or all four at once with check_family(hc, tmp_path).

Every model runs transformers' eager attention: its soft-capped, sink and sliding-window paths
are written out there, and an sdpa mask would hide nothing but cost a second implementation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..support import greedy_cached

# No end-of-text id: generate() would stop at it and so differ from plain greedy for 20 tokens.
NO_EOS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny(**overrides) -> dict:
    """Keyword arguments for a tiny config of any llama-like family: hidden 64, 2 layers, 4 query
    heads of 16 over 2 key/value heads, a vocabulary of 101; overrides win."""
    base = dict(
        vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=160, tie_word_embeddings=False, **NO_EOS,
    )
    return {**base, **overrides}


@torch.no_grad()
def move_off_identity(model: torch.nn.Module, std: float = 0.08, norm_std: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Every weight redrawn with a large std so a real bug shows above the tolerance; every norm
    weight (a 1-D parameter with 'norm' in its name) drawn around its own initial value instead
    (1 for a plain RMSNorm, 0 for Gemma's (1 + w)), so a norm read as w where it is (1 + w), or
    the other way round, changes the logits."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.ndim == 1 and "norm" in name:
            p.copy_((p.float().mean() + noise * norm_std).to(p.dtype))
        else:
            p.copy_((noise * std).to(p.dtype))
    return model


def hf_random(hc, seed: int = 0, std: float = 0.08, norm_std: float = 0.1) -> torch.nn.Module:
    """A transformers causal LM of config hc with random weights (move_off_identity), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hc, attn_implementation="eager", dtype=torch.float32)
    return move_off_identity(model, std, norm_std, seed).eval()


def ours_from_hf(hf: torch.nn.Module, tmp_path: Path, name: str = "hf") -> torch.nn.Module:
    """hf saved by transformers (save_pretrained) and read back by load_hf: the path a user's
    folder takes, with every key, shape and config field checked on the way."""
    from glassformer.convert import load_hf

    folder = Path(tmp_path) / name
    hf.save_pretrained(folder)
    ours, _ = load_hf(folder)
    return ours.eval()


def _rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    assert ref.shape == got.shape, (tuple(ref.shape), tuple(got.shape))
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@torch.no_grad()
def assert_logits_match(hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, rel: float = 1e-4) -> float:
    """Our logits within rel of transformers' largest logit on ids; returns the relative error."""
    ref = hf(ids).logits
    got, _ = ours(ids)
    assert ref.abs().max() > 0.1, "logits too small for the tolerance to mean anything"  # a bug could hide
    err = _rel_err(ref, got)
    assert err <= rel, f"logits differ from transformers by {err:.2e} of the largest (allowed {rel:.0e})"
    return err


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    """transformers' own greedy continuation of ids[0] (with its cache), exactly `steps` tokens."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=steps, min_new_tokens=steps,
                      do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def assert_greedy_match(hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, steps: int = 20) -> list[int]:
    """The same `steps` greedy tokens from transformers' generate() and from our KV-cached decode."""
    ref = hf_greedy(hf, ids, steps)
    got = greedy_cached(ours, ids[:1], steps)
    assert got == ref, f"greedy tokens differ from transformers:\n ours {got}\n hf   {ref}"
    return got


@torch.no_grad()
def assert_back_to_hf(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, tmp_path: Path,
                      rel: float = 1e-5, name: str = "back", family: str | None = None) -> torch.nn.Module:
    """ours written by save_hf (as the family export picks, or the one named) and loaded by
    transformers itself gives hf's own logits within rel, as the same architecture; returns the
    reloaded transformers model."""
    import transformers

    from glassformer.convert import save_hf

    folder = save_hf(ours, Path(tmp_path) / name, family=family)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    assert type(back) is type(hf), f"exported as {type(back).__name__}, read from {type(hf).__name__}"
    err = _rel_err(hf(ids).logits, back(ids).logits)
    assert err <= rel, f"the exported folder's logits differ from the original's by {err:.2e} (allowed {rel:.0e})"
    return back


def check_family(hc, tmp_path: Path, seq: int = 48, steps: int = 20, prompt: int = 8, seed: int = 0,
                 rel: float = 1e-4, back_rel: float = 1e-5, family: str | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """All four checks on config hc: random ids of length seq (make it longer than any sliding
    window), a prompt of `prompt` tokens continued for `steps`, the way back written as the family
    export picks (or `family`). Returns (hf, ours)."""
    hf = hf_random(hc, seed=seed)
    ours = ours_from_hf(hf, tmp_path)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hc.vocab_size, (2, seq), generator=g)
    assert_logits_match(hf, ours, ids, rel)
    assert_greedy_match(hf, ours, ids[:, :prompt], steps)
    assert_back_to_hf(ours, hf, ids, tmp_path, back_rel, family=family)
    return hf, ours
