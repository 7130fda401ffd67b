"""RoPE's first-half feature q·cos θ − q'·sin θ: the minus is part of the factor −sin θ, not an extra −1."""

import math

import pytest

from glassformer.explaining.explain import explain
from glassformer.tracing.trace import trace

from ..support import reinit, tiny_model

IDS = [1, 5, 9, 2, 7, 3, 8]


def test_the_first_half_of_a_pair_multiplies_by_minus_sin_theta():
    m = reinit(tiny_model(), std=0.3)
    tr = trace(m, IDS, with_weights=True)
    e = explain(tr, "blocks.0.attn.q_rot", [3, 1, 1])  # feature 1 of H=16: pair 1, first half
    theta, rot = e.steps[0], e.steps[1]
    assert all(len(term) == 2 for term in rot["terms"])  # x · cos θ and x' · (−sin θ): two factors each
    consts = {o["label"]: o["value"] for t in rot["terms"] for o in t if o["source"] == "const"}
    assert "−1" not in consts and "sin θ" not in consts
    assert consts["−sin θ"] == pytest.approx(-math.sin(theta["value"]), abs=1e-6)
    assert rot["value"] == pytest.approx(float(tr["blocks.0.attn.q_rot"][3, 1, 1]), abs=1e-5)
