"""One optimizer update of one weight, explained number by number, equal to training's bitwise.

    explain_update(run, step, param, index) -> UpdateExplanation

run: a run folder (what `glassformer train --out` wrote); step: a checkpoint step S in it
(`step-00000S/`); the update explained is the NEXT one, step S+1: the checkpoint's weights and
optimizer state are loaded, the gradient of step S+1 is recomputed from the run's data and
(seed, step) through the training code's own functions (train/loop.py `step_inputs`,
train/step.py `backward_step` and `clip_gradients`): every micro-batch, the accumulation, the
global gradient norm and the clipping scale; then the run's own optimizer takes the step, and the
update of the element `param[index]` is written out with the optimizer's formula in float32:
AdamW (moments, bias corrections 1 − β^t, the schedule's learning rate, decoupled weight decay,
eps) or Muon (momentum buffer, Nesterov's look-ahead, the Newton–Schulz orthogonalisation of
the whole matrix, the shape scale). The formula's value is compared with the optimizer's
bitwise, and the comparison is part of the answer (`bitwise`).

param: a parameter name of the model's state dict (e.g. "blocks.0.attn.wq.weight"; shapes as
torch stores them, (out, in) for a Linear); index: one integer per axis (a list or "i,j").

The answer (`UpdateExplanation.to_dict()`, what POST /api/update sends) is a calculation in
the explain format the explorer's showCalc draws:
    {"title", "probe": param, "index", "label", "value": the new element as the optimizer wrote it,
     "result": the formula's value, "bitwise": bool, "text", "steps": [{"label", "op", "formula",
     "operands": [{"label", "source", "name", "index", "value"}], "value", "text"}],
     "summary": {"step", "update_step", "optimizer", "loss", "micro_losses", "grad_norm",
                 "grad_clip", "clip_scale", "lr", "accum"}}
For tests it also holds the full recomputed gradient (`grad`, before clipping), the clipped
gradient (`clipped`) and the new parameter tensor (`new_param`).
Bad input (no such run, step, parameter or index) raises UserError saying what to give.
"""

from __future__ import annotations
