"""glassformer as a model of the lm-evaluation-harness (docs/eval.md).

`lm.py` is `GlassformerLM` (the harness's TemplateLM; importing it registers the model name
`glassformer`), `scoring.py` the log-likelihoods with each shared context prefilled once,
`generating.py` generate_until on a Session with the project's stop-string rule, `tasks.py` what
`glassformer eval --tasks` runs and prints. `python -m glassformer.harness ARGS` is `lm_eval ARGS`
with the `glassformer` model registered first. Needs the `harness` extra (lm-eval).
"""

from __future__ import annotations

__all__ = ["GlassformerLM"]


def __getattr__(name):
    if name == "GlassformerLM":  # imported on first use: lm_eval is an optional extra and slow to import
        from .lm import GlassformerLM

        return GlassformerLM
    raise AttributeError(name)
