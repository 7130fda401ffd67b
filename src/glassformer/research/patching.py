"""Activation patching sweeps, as TransformerLens's `patching.get_act_patch_*` (docs/research.md#patching).

Run the corrupted text; at one site of one layer, at one position (or one head, for `z`), put back the
clean run's activation, and read the metric logit(answer) − logit(wrong) at the last position. A sweep
does that for every layer × position (layer × head): `grid[l][j]` is the patched run's metric.

Every patch goes through the model's own probes (glassformer.probes): a recorder swaps the tensor on
its way through, so there is no second forward implementation. Many patches run in one forward: the
batch dimension holds one patch per row, each row's recorder mask naming its own (layer, cell).

`method="attribution"` is attribution patching (Nanda, 2023): one forward and one backward of the
corrupted text give the metric's gradient at every site, and grad · (clean − corrupt) summed over a
cell's features estimates the change that patching that cell makes (first order); the grid holds
corrupt + that estimate, so it reads like the exact grid.

Sites, with TransformerLens's names for the same sweep:
  resid_pre  the stream entering block l (probes.stream_probes(l, ...)["in"])   get_act_patch_resid_pre
  attn_out   attention's output, blocks.l.attn.out                              get_act_patch_attn_out
  mlp_out    the feed-forward's output, blocks.l.ffn.down                       get_act_patch_mlp_out
  z          each head's output before W_O, blocks.l.attn.z, all positions      get_act_patch_attn_head_out_all_pos
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..probes import stream_probes
from ..tracing.trace import eval_mode, recording

SITES = ("resid_pre", "attn_out", "mlp_out", "z")
METHODS = ("exact", "attribution", "both")
# TransformerLens's function that makes the same grid (the docs and the JSON name it).
TL_FUNCTIONS = {"resid_pre": "get_act_patch_resid_pre", "attn_out": "get_act_patch_attn_out",
                "mlp_out": "get_act_patch_mlp_out", "z": "get_act_patch_attn_head_out_all_pos"}
ELEMENTS_PER_FORWARD = 1 << 25  # rows per batched forward: its largest activation stays near 128 MB in fp32


def sites_of(cfg) -> tuple[str, ...]:
    """The sites this model has: no mlp_out without a feed-forward (ffn='none')."""
    return tuple(s for s in SITES if s != "mlp_out" or cfg.ffn != "none")


def check_site(cfg, site: str) -> None:
    if site not in sites_of(cfg):
        extra = " (this model has no feed-forward, so no mlp_out)" if site == "mlp_out" else ""
        raise UserError(f"unknown site {site!r}{extra}: the sites are {', '.join(sites_of(cfg))}")


def site_probe(cfg, site: str, layer: int) -> str:
    """The probe that holds `site` at block `layer`.

    >>> from glassformer import ModelConfig
    >>> cfg = ModelConfig.from_preset("tiny")
    >>> [site_probe(cfg, "resid_pre", i) for i in (0, 1)], site_probe(cfg, "z", 1)
    (['embed', 'blocks.0.resid_out'], 'blocks.1.attn.z')
    """
    check_site(cfg, site)
    if site == "resid_pre":
        return stream_probes(layer, cfg.norm_placement, cfg.ffn)["in"]
    return f"blocks.{layer}." + {"attn_out": "attn.out", "mlp_out": "ffn.down", "z": "attn.z"}[site]


def columns(cfg, site: str, T: int) -> int:
    """The grid's width: heads for z, else positions."""
    return cfg.n_heads if site == "z" else T


class _Swap:
    """A probes.Recorder: each probe in `changes` goes through its function on the way; probes in
    `keep` are kept as they pass (on their device, after any change)."""

    def __init__(self, changes: dict | None = None, keep=()):
        self.changes = dict(changes or {})
        self.keep = set(keep)
        self.seen: dict[str, torch.Tensor] = {}

    def wants(self, name: str) -> bool:
        return name in self.changes or name in self.keep

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        fn = self.changes.get(name)
        if fn is not None:
            x = fn(x)
        if name in self.keep:
            self.seen[name] = x.detach()
        return x


def _ids(model, ids) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    return t.to(next(model.parameters()).device)  # (1, T)


def _last_logits(model, ids: torch.Tensor, recorder) -> torch.Tensor:
    """The last position's logits (B, V) of ids (B, T) with `recorder` installed, dropout off."""
    B, T = ids.shape
    with eval_mode(model), recording(recorder):
        logits, _ = model(ids, logits_at=torch.full((B,), T - 1, dtype=torch.long, device=ids.device))
    return logits[:, -1].float()  # (B, V)


@torch.no_grad()
def record(model, ids, names) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One forward of ids: ({name: activation (1, T, ...)}, the last position's logits (V,))."""
    rec = _Swap(keep=names)
    logits = _last_logits(model, _ids(model, ids), rec)
    return rec.seen, logits[0]


def _put(x: torch.Tensor, mask: torch.Tensor, src: torch.Tensor, heads: bool) -> torch.Tensor:
    """x (B, T, ...) with src (1, T, ...) where mask (B, cols) says: per position, or per head (z)."""
    m = mask[:, None, :, None] if heads else mask.view(*mask.shape, *([1] * (x.dim() - 2)))
    return torch.where(m, src.to(x.dtype), x)


def rows_per_forward(cfg, T: int) -> int:
    """How many patches one batched forward holds: its largest activation (B·T·max(D, F, N·T)) near
    ELEMENTS_PER_FORWARD elements."""
    widest = max(cfg.dim, cfg.ffn_dim or 0, cfg.n_heads * T)
    return max(1, ELEMENTS_PER_FORWARD // (T * widest))


@torch.no_grad()
def exact(model, clean, corrupt, answer: int, wrong: int, site: str, batch: int | None = None,
          clean_acts: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact sweep: (logit(answer), logit(wrong)) of every patched run, each (layers, cols).

    batch: patches per forward (default rows_per_forward; 1 is one forward per patch)."""
    cfg = model.config
    L, T = cfg.n_layers, len(corrupt)
    names = [site_probe(cfg, site, layer) for layer in range(L)]
    if clean_acts is None:
        clean_acts, _ = record(model, clean, names)
    P = columns(cfg, site, T)
    cells = [(layer, j) for layer in range(L) for j in range(P)]
    rows = max(1, batch or rows_per_forward(cfg, T))
    ids = _ids(model, corrupt)
    out = torch.empty(len(cells), 2)
    for start in range(0, len(cells), rows):
        chunk = cells[start:start + rows]
        B = len(chunk)
        changes = {}
        for layer in sorted({c[0] for c in chunk}):
            mask = torch.zeros(B, P, dtype=torch.bool, device=ids.device)
            for k, (ll, j) in enumerate(chunk):
                if ll == layer:
                    mask[k, j] = True
            changes[names[layer]] = functools.partial(_put, mask=mask, src=clean_acts[names[layer]], heads=site == "z")
        logits = _last_logits(model, ids.expand(B, T), _Swap(changes))  # (B, V)
        out[start:start + B, 0] = logits[:, answer].cpu()
        out[start:start + B, 1] = logits[:, wrong].cpu()
    return out[:, 0].view(L, P), out[:, 1].view(L, P)


def attribution(model, clean, corrupt, answer: int, wrong: int, site: str,
                clean_acts: dict | None = None) -> tuple[torch.Tensor, float]:
    """Attribution patching: (grad · (clean − corrupt) per cell (layers, cols), the corrupt metric).

    One forward of the clean text (its activations) and one forward and backward of the corrupted
    one: a zero tensor is added at each site, and the metric's gradient with respect to it is its
    gradient with respect to the activation, without cutting the graph between sites."""
    cfg = model.config
    L = cfg.n_layers
    names = [site_probe(cfg, site, layer) for layer in range(L)]
    if clean_acts is None:
        clean_acts, _ = record(model, clean, names)
    zeros: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (the added zero, the corrupt activation)

    def add_zero(name, x):
        z = torch.zeros_like(x, requires_grad=True)
        zeros[name] = (z, x.detach())
        return x + z

    rec = _Swap({n: functools.partial(add_zero, n) for n in names})
    with torch.enable_grad():
        logits = _last_logits(model, _ids(model, corrupt), rec)  # (1, V)
        metric = logits[0, answer] - logits[0, wrong]
        grads = torch.autograd.grad(metric, [zeros[n][0] for n in names], allow_unused=True)
    rows = []
    for n, g in zip(names, grads):
        diff = (clean_acts[n].float() - zeros[n][1].float())  # (1, T, ...)
        g = torch.zeros_like(diff) if g is None else g.float()  # a site the metric does not read
        prod = (g * diff)[0]  # (T, ...)
        rows.append(prod.sum(dim=(0, 2)) if site == "z" else prod.reshape(prod.shape[0], -1).sum(-1))  # (N,) or (T,)
    return torch.stack(rows).cpu(), float(metric.detach())


def pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Pearson's correlation of two grids' cells; None where either is constant."""
    x, y = a.double().flatten(), b.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    den = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return None if den == 0 else float((x * y).sum()) / den


@dataclass
class PatchResult:
    """A sweep's grids and the numbers each cell is made of (to_dict: the CLI's JSON)."""

    site: str
    method: str
    clean: float  # metric of the clean run
    corrupt: float  # metric of the corrupted run
    clean_logits: tuple[float, float]  # (logit(answer), logit(wrong)) of the clean run
    corrupt_logits: tuple[float, float]
    patched_answer: torch.Tensor | None = None  # (layers, cols) logit(answer) of each patched run
    patched_wrong: torch.Tensor | None = None
    attribution: torch.Tensor | None = None  # (layers, cols) grad · (clean − corrupt)
    probes: list[str] = field(default_factory=list)  # the probe patched in each layer
    seconds: dict = field(default_factory=dict)

    @property
    def exact(self) -> torch.Tensor | None:
        return None if self.patched_answer is None else self.patched_answer - self.patched_wrong

    @property
    def estimate(self) -> torch.Tensor | None:
        """Attribution patching's estimate of each patched run's metric: corrupt + grad · Δ."""
        return None if self.attribution is None else self.corrupt + self.attribution

    @property
    def grid(self) -> torch.Tensor:
        return self.exact if self.exact is not None else self.estimate

    @property
    def correlation(self) -> float | None:
        """Pearson's r between the exact grid and the attribution estimate (both methods run)."""
        if self.exact is None or self.attribution is None:
            return None
        return pearson(self.exact, self.estimate)

    def to_dict(self) -> dict:
        def rows(t):
            return None if t is None else [[float(v) for v in r] for r in t.tolist()]

        out = {"site": self.site, "method": self.method, "axes": ["layer", "head" if self.site == "z" else "position"],
               "metric": "logit(answer) - logit(wrong) at the last position", "probes": self.probes,
               "transformer_lens": TL_FUNCTIONS[self.site],
               "clean": self.clean, "corrupt": self.corrupt,
               "clean_logits": list(self.clean_logits), "corrupt_logits": list(self.corrupt_logits),
               "grid": rows(self.grid)}
        if self.exact is not None:
            out["patched_answer"], out["patched_wrong"] = rows(self.patched_answer), rows(self.patched_wrong)
        if self.attribution is not None:
            out["attribution"], out["attribution_terms"] = rows(self.estimate), rows(self.attribution)
        if self.method == "both":
            out["correlation"] = self.correlation
        out["seconds"] = self.seconds
        return out


def patch_sweep(model, clean, corrupt, answer: int, wrong: int, site: str, method: str = "exact",
                batch: int | None = None) -> PatchResult:
    """The sweep of `site` over every layer × position (layer × head for z): clean and corrupt are
    token ids of equal length; answer and wrong are token ids. method: exact, attribution or both."""
    cfg = model.config
    check_site(cfg, site)
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}: the methods are {', '.join(METHODS)}")
    clean, corrupt = [int(i) for i in clean], [int(i) for i in corrupt]
    if len(clean) != len(corrupt) or not clean:
        raise UserError(f"the clean and corrupt texts must have the same number of tokens (at least one): "
                        f"clean is {len(clean)}, corrupt is {len(corrupt)}")
    for flag, i in (("answer", answer), ("wrong", wrong)):
        if not 0 <= int(i) < cfg.vocab_size:
            raise UserError(f"{flag} id {i} is outside the model's vocabulary 0..{cfg.vocab_size - 1}")
    names = [site_probe(cfg, site, layer) for layer in range(cfg.n_layers)]
    t0 = time.perf_counter()
    clean_acts, clean_logits = record(model, clean, names)
    _, corrupt_logits = record(model, corrupt, [])
    pair = lambda lg: (float(lg[answer]), float(lg[wrong]))  # noqa: E731
    res = PatchResult(site, method, pair(clean_logits)[0] - pair(clean_logits)[1],
                      pair(corrupt_logits)[0] - pair(corrupt_logits)[1], pair(clean_logits), pair(corrupt_logits),
                      probes=names)
    res.seconds["runs"] = time.perf_counter() - t0
    if method in ("exact", "both"):
        t0 = time.perf_counter()
        res.patched_answer, res.patched_wrong = exact(model, clean, corrupt, answer, wrong, site, batch, clean_acts)
        res.seconds["exact"] = time.perf_counter() - t0
    if method in ("attribution", "both"):
        t0 = time.perf_counter()
        res.attribution, _ = attribution(model, clean, corrupt, answer, wrong, site, clean_acts)
        res.seconds["attribution"] = time.perf_counter() - t0
    return res
