"""A session's packed forward, and its decode step compiled: options, guards, static weights.

generate.Session runs its prefills through PackedForward and, with compile=True, its decode
steps through a private compiled copy of _packed_step (_compile_step).
"""

from __future__ import annotations

import re
import types

import torch

from .packed import packed_forward, tensors


def _packed_step(model, weights, idx, cache=None, pos=0):
    """The packed forward with its weights passed in: what a session compiles for decode steps."""
    return packed_forward(model, idx, cache, pos, weights=weights), None


def step_layout(device: torch.device, compile: bool) -> str:
    """The packed layout a session's forwards use: on the CPU a compiled session's one-row
    products are generated row sums over (out, in) weights, ~2x the bytes per second of the
    BLAS kernels (packed._lin, bench/matvec.py); everything else keeps the (in, out) row blocks."""
    return "out_in" if compile and device.type == "cpu" else "rows"


_HELD = ("model", "weights", "cache")  # what a session holds fixed (Session._model checks it)


def _step_guards(entries) -> list[bool]:
    """The guards a session's compiled step keeps: all but those on the model, the packed weights
    and the cache. The symbolic-shape guards stay: the first decode step at position 1 is
    compiled for that one value (torch specialises 0 and 1), and only its guard sends
    position 2 to a general recompile."""
    def root(name: str) -> str:  # "model._modules[...]", "L['model']..." -> "model"
        return re.split(r"[.\[\]']", name[3:] if name.startswith("L['") else name, maxsplit=1)[0]
    return [root(e.name) not in _HELD for e in entries]


# realize_reads_threshold 1: a value that several of inductor's loops use (a residual sum, read
# by the next norm and the next residual add) is computed once into a buffer as soon as it reads
# more than one input (inductor's default: more than four), rather than again inside every
# loop that uses it, some of them a product's loop over each weight row (bench/decode_parts.py).
# No cpp_wrapper: calling the kernels from C++ paid 1.04-1.07x when the products were library
# calls; with generated row sums it gains nothing measurable (bench/decode_parts.py).
CPU_STEP_OPTIONS = {"guard_filter_fn": _step_guards, "realize_reads_threshold": 1}
# On a GPU: mode="reduce-overhead" (CUDA graphs), with the same guard filter, since the
# ~500 guards would be checked on the host before every replay while the GPU waits.
CUDA_STEP_OPTIONS = {"guard_filter_fn": _step_guards, "triton.cudagraphs": True}


def _compile_step(device: torch.device, options: dict | None = None):
    """torch.compile of a private copy of _packed_step, for one session.

    Before each call TorchDynamo checks the guards of the compiled code, here ~500, most of
    them on the model's modules, the packed weights and the cache. A session holds those
    fixed, so its step drops them (_step_guards; bench/decode_parts.py measures it on the CPU); the
    session recompiles when the packed weights' layout, blocks, dtype, device or shapes, an
    attention kernel or the thread count change (Session._model), and inductor's generated
    code checks every input's shape on entry. TorchDynamo keeps compiled code per code
    object, so the private copy keeps one session's step from serving another model. On a
    GPU CUDA graphs replay the step's kernels, reading the packed weights in place
    (mark_static). `options` replaces the device's inductor
    options (for benchmarks and tests).
    """
    f = _packed_step
    step = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__)
    if options is None:
        options = CUDA_STEP_OPTIONS if device.type == "cuda" else CPU_STEP_OPTIONS
    # A copy: torch.compile takes guard_filter_fn out of the dict it is given, so passing the
    # module's own would leave every later session's step with all its guards.
    return torch.compile(step, dynamic=True, options=dict(options))


def mark_static(weights: dict) -> None:
    """Tell CUDA graphs that the packed weights stay where they are: inputs not so marked
    are copied into the graph's own memory before every replay (all the weights, each step).
    Unguarded: a pack rebuilt at new addresses makes the graph re-record, not recompile."""
    for t in tensors(weights):
        torch._dynamo.mark_static_address(t)


class PackedForward:
    """A model's packed forward (packed.py), called like the model itself: (logits, None)."""

    def __init__(self, model, layout: str = "rows"):
        self.model, self.layout = model, layout

    def __call__(self, idx, cache=None, pos=0, last=None):
        return packed_forward(self.model, idx, cache, pos, last=last, layout=self.layout), None
