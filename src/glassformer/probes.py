"""Named probes: the places where the model shows its intermediate tensors, `tap(name, x)`.

With no recorder installed `tap` returns `x` after one test of a global, so a trace costs nothing when
off; a recorder (see `glassformer.trace`) may store x or return a replacement (ablation, patching).
A recorder sees the forwards of the thread that installed it only: a server that traces one request
while another thread runs the same model (the explorer beside `serve`'s engine, a test computing a
reference) keeps each forward's probes to itself.
The names, and the shapes as tapped (batch first): docs/trace-format.md#probe-entries; docs/explain.md.
"""

from __future__ import annotations

from threading import get_ident
from typing import Protocol

import torch


class Recorder(Protocol):
    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor: ...

    def wants(self, name: str) -> bool: ...


_recorders: dict[int, Recorder] = {}  # thread id -> the recorder that thread installed


def tap(name: str, x: torch.Tensor) -> torch.Tensor:
    """Show `x` to this thread's recorder under `name`; returns x (or the recorder's replacement)."""
    if not _recorders:
        return x
    r = _recorders.get(get_ident())
    return x if r is None else r(name, x)


def wants(name: str) -> bool:
    """True when this thread has a recorder that asks for probe `name` (used for costly extras)."""
    r = _recorders.get(get_ident()) if _recorders else None
    return r is not None and r.wants(name)


def active() -> bool:
    """True when this thread's forwards are being recorded."""
    return bool(_recorders) and get_ident() in _recorders


def set_recorder(r: Recorder | None) -> Recorder | None:
    """Install `r` for this thread's forwards (None removes it); returns the one this thread had before."""
    me = get_ident()
    old = _recorders.get(me)
    if r is None:
        _recorders.pop(me, None)
    else:
        _recorders[me] = r
    return old


# ----------------------------------------------------------------------------- stream wiring
# Which probe holds the residual stream at each point of block i, for each norm placement.
# This is the one statement of it (explain, analysis, the viewer and its page, worked, the
# logit lens all read it); tests/tracing/test_wiring.py checks it against model.Block.forward.
# Pre-norm never normalises the stream, so it is the sum itself (resid_mid, resid_out);
# post-norm normalises the stream right after each addition, so the stream proper is the
# norm's output (attn_norm, ffn_norm) and the sums resid_mid/resid_out are what those norms read.
# Sandwich (Gemma 2/3) is pre-norm with a second norm on each sublayer's output, before the
# addition; post_branch (OLMo 2) has that second norm only: the sublayer reads the stream itself
# and its output is normalised (by attn_norm / ffn_norm) before it is added.
# Keys (leaf names inside block i; "in" is the stream entering block i):
#   mid               the stream after the attention addition
#   out               the stream leaving the block (what block i+1, or the final norm, reads)
#   attn_reads        what attention's q, k, v projections read
#   ffn_reads         what the feed-forward reads
#   attn_norm_reads   what the attention-side norm normalises
#   ffn_norm_reads    what the feed-forward-side norm normalises
#   attn_adds         what the attention addition adds to the stream (its branch's last probe)
#   ffn_adds          what the feed-forward addition adds to the stream
# and, with sandwich norms only, attn_post_norm_reads / ffn_post_norm_reads (the sublayer's output).
STREAM_WIRING = {
    "pre": {"mid": "resid_mid", "out": "resid_out", "attn_reads": "attn_norm", "ffn_reads": "ffn_norm",
            "attn_norm_reads": "in", "ffn_norm_reads": "resid_mid", "attn_adds": "attn.out", "ffn_adds": "ffn.down"},
    "post": {"mid": "attn_norm", "out": "ffn_norm", "attn_reads": "in", "ffn_reads": "attn_norm",
             "attn_norm_reads": "resid_mid", "ffn_norm_reads": "resid_out", "attn_adds": "attn.out", "ffn_adds": "ffn.down"},
    "sandwich": {"mid": "resid_mid", "out": "resid_out", "attn_reads": "attn_norm", "ffn_reads": "ffn_norm",
                 "attn_norm_reads": "in", "ffn_norm_reads": "resid_mid", "attn_adds": "attn_post_norm",
                 "ffn_adds": "ffn_post_norm", "attn_post_norm_reads": "attn.out", "ffn_post_norm_reads": "ffn.down"},
    "post_branch": {"mid": "resid_mid", "out": "resid_out", "attn_reads": "in", "ffn_reads": "resid_mid",
                    "attn_norm_reads": "attn.out", "ffn_norm_reads": "ffn.down", "attn_adds": "attn_norm",
                    "ffn_adds": "ffn_norm"},
}


def attention_only(row: dict[str, str]) -> dict[str, str]:
    """A STREAM_WIRING row for blocks without a feed-forward (ffn='none'): the stream leaves the
    block right after the attention addition (out = mid), and the ffn keys are absent."""
    return {k: (row["mid"] if k == "out" else v) for k, v in row.items() if not k.startswith("ffn")}


def stream_probes(layer: int, norm_placement: str, ffn: str = "swiglu") -> dict[str, str]:
    """Full probe names of STREAM_WIRING for block `layer`, with "in" resolved; ffn: the config's
    feed-forward kind ('none': attention_only's row).

    >>> stream_probes(1, "post")["in"], stream_probes(0, "pre")["attn_norm_reads"]
    ('blocks.0.ffn_norm', 'embed')
    >>> stream_probes(1, "pre", "none")["in"]
    'blocks.0.resid_mid'
    """
    if norm_placement not in STREAM_WIRING:
        raise ValueError(f"norm_placement must be one of {sorted(STREAM_WIRING)}, got {norm_placement!r}")
    row = STREAM_WIRING[norm_placement] if ffn != "none" else attention_only(STREAM_WIRING[norm_placement])
    enter = "embed" if layer == 0 else f"blocks.{layer - 1}.{row['out']}"
    out = {"in": enter}
    for key, leaf in row.items():
        out[key] = enter if leaf == "in" else f"blocks.{layer}.{leaf}"
    return out


def stream_wiring(n_layers: int, norm_placement: str, ffn: str = "swiglu") -> list[dict[str, str]]:
    """stream_probes of every block, in order (the page receives this in its data)."""
    return [stream_probes(i, norm_placement, ffn) for i in range(n_layers)]


def final_norm_reads(n_layers: int, norm_placement: str, ffn: str = "swiglu") -> str:
    """The stream the final norm reads: the one leaving the last block."""
    return stream_probes(n_layers - 1, norm_placement, ffn)["out"] if n_layers else "embed"


def stream_points(n_layers: int, norm_placement: str, ffn: str = "swiglu") -> list[str]:
    """The stream at the embedding, then after every addition: embed, mid and out of each block
    (mid alone where it is also out: an attention-only block has one addition)."""
    wiring = stream_wiring(n_layers, norm_placement, ffn)
    return ["embed"] + [p for w in wiring for p in dict.fromkeys((w["mid"], w["out"]))]
