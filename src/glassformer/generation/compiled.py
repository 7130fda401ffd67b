"""How a session compiles its decode step: the model's own forward under torch.compile, with the
guards a session holds fixed left out, and a fingerprint of the model's hooks checked instead.

Session(compile=True) compiles a private copy of `model_step` (one token per row through
`model(...)`, the same modules as every other path), so hooks, probes and replaced modules apply.
"""

from __future__ import annotations

import re
import types

import torch
import torch.nn as nn


def model_step(model, idx, cache=None, pos=0):
    """One forward of the model itself: what a session compiles for its decode steps."""
    return model(idx, cache=cache, pos=pos)


_HELD = ("model", "cache")  # what a session holds fixed (Session checks what could change under it)


def _step_guards(entries) -> list[bool]:
    """The guards a session's compiled step keeps: all but those on the model and the cache. The
    symbolic-shape guards stay: the first decode step at position 1 is compiled for that one value
    (torch specialises 0 and 1), and only its guard sends position 2 to a general recompile."""
    def root(name: str) -> str:  # "model._modules[...]", "L['model']..." -> "model"
        return re.split(r"[.\[\]']", name[3:] if name.startswith("L['") else name, maxsplit=1)[0]
    return [root(e.name) not in _HELD for e in entries]


# realize_reads_threshold 1: a value that several of inductor's loops use (a residual sum, read
# by the next norm and the next residual add) is computed once into a buffer as soon as it reads
# more than one input (inductor's default: more than four), rather than again inside every
# loop that uses it, some of them a product's loop over each weight row (bench/decode_parts.py).
CPU_STEP_OPTIONS = {"guard_filter_fn": _step_guards, "realize_reads_threshold": 1}
# On a GPU: CUDA graphs, with the same guard filter, since the host would check every guard
# (most of them on the model's modules and the cache) before each replay while the GPU waits.
CUDA_STEP_OPTIONS = {"guard_filter_fn": _step_guards, "triton.cudagraphs": True}


def compile_step(device: torch.device, options: dict | None = None):
    """torch.compile of a private copy of model_step, for one session; `options` replaces the device's
    inductor options (benchmarks and tests). The step drops the guards on the model and the cache, which
    a session holds fixed (_step_guards; bench/decode_parts.py), and the session checks `step_key`
    instead; TorchDynamo keeps compiled code per code object, so the private copy keeps one session's
    step from serving another model. docs/generation.md#compiled-steps."""
    f = model_step
    step = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__)
    if options is None:
        options = CUDA_STEP_OPTIONS if device.type == "cuda" else CPU_STEP_OPTIONS
    # A copy: torch.compile takes guard_filter_fn out of the dict it is given, so passing the
    # module's own would leave every later session's step with all its guards.
    return torch.compile(step, dynamic=True, options=dict(options))


def step_key(model: nn.Module) -> tuple:
    """What a compiled step took as fixed, checked before every step since the step keeps no guard on
    the model: its modules and their classes (a module replaced or re-classed is a new trace), the hooks on each and the global ones
    (traced when compiled; handles are numbered afresh, so removing one hook and adding another
    changes the key), the attention kernels, the weights' dtype and device, and on the CPU the thread
    count (inductor splits its loops among the threads when it compiles). What it costs a step:
    bench/decode_parts.py."""
    g = nn.modules.module
    mods, hooks, kernels, stack = [], [], [], [model]
    while stack:  # the module tree, without named_modules' names and memo (this runs every step)
        m = stack.pop()
        if m is None:  # an empty slot (a module attribute set to None)
            continue
        mods.append(m)
        mods.append(type(m))  # a module re-classed in place (glassformer.speed install/remove) is a new trace
        d = m.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"]:
            hooks.append((len(mods), tuple(d["_forward_pre_hooks"]), tuple(d["_forward_hooks"])))
        if "kernel" in d:
            kernels.append(d["kernel"])
        stack.extend(d["_modules"].values())
    w = model.embed.weight
    return (mods, tuple(hooks), tuple(g._global_forward_pre_hooks), tuple(g._global_forward_hooks), tuple(kernels),
            w.dtype, w.device, torch.get_num_threads())
