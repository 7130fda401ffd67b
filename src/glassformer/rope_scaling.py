"""RoPE for contexts longer than the model was trained on: the frequencies of `rope_inv_freq`
rescaled by a Hugging Face `rope_scaling` dict (model.py calls `scale_inv_freq`).

- linear: every pair slowed by `factor` (position interpolation, Chen et al., 2023).
- llama3: slow (long-wavelength) pairs slowed by `factor`, fast ones kept, the band between blended
  (Meta's llama3 reference code).
- yarn: the same idea with a linear ramp over pair indices, plus a factor on cos and sin
  (Peng et al., 2023, "YaRN"; gpt-oss), computed as transformers' `_compute_yarn_parameters` does.
Imports torch alone.
"""

from __future__ import annotations

import math

import torch


def scaling_kind(sc: dict) -> str:
    return sc.get("rope_type", sc.get("type"))


def scale_inv_freq(inv: torch.Tensor, sc: dict, theta: float, H: int) -> torch.Tensor:
    """`inv` (H/2,), theta^(-2i/H), rescaled by the scaling dict `sc`."""
    kind, factor = scaling_kind(sc), float(sc["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        return _yarn_inv_freq(inv, sc, theta, H)
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)


def _yarn_inv_freq(inv: torch.Tensor, sc: dict, theta: float, H: int) -> torch.Tensor:
    """Pairs that turn more than beta_fast times over the original context keep their frequency
    (extrapolate), those turning fewer than beta_slow times are slowed by `factor` (interpolate),
    and a linear ramp over the pair index blends the ones between."""
    factor = float(sc["factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times over old_ctx
        return H * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_turning(fast), pair_turning(slow)
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, H - 1)
    if lo == hi:
        hi += 0.001  # no zero-width ramp
    ramp = ((torch.arange(H // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # (H/2,) 0 fast .. 1 slow
    keep = 1 - ramp
    return (inv / factor) * (1 - keep) + inv * keep


def attention_factor(sc: dict | None) -> float:
    """The factor YaRN puts on cos and sin (so on every score, squared): 0.1·ln(factor) + 1 unless the
    dict gives `attention_factor` (or mscale / mscale_all_dim); 1 for the other scalings."""
    if sc is None or scaling_kind(sc) != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = float(sc["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(float(sc["mscale"])) / mscale(float(sc["mscale_all_dim"]))
    return mscale(1.0)
