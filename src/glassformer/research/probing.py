"""Linear probes: does layer L's activation at a probe name hold a label linearly? A logistic
regression per layer (softmax over the classes), trained on part of a labelled set of texts and
scored on the rest (Alain & Bengio, 2016, "Understanding intermediate layers using linear classifier
probes"). The activations come from the model's own probes (glassformer.probes), recorded in one
forward per batch of texts. docs/research.md#linear-probes.

Saved: probes.safetensors (per layer `layer{L}.weight` (C, F), `layer{L}.bias` (C,), and the
standardisation `layer{L}.mean`, `layer{L}.std` (F,) the weights read after), probes.json (classes,
site, per-layer accuracies), accuracy.svg (the picture; accuracy.png too with matplotlib installed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..probes import stream_probes
from .tokens import encode_texts

# Sites named by the stream's place, whatever the norm placement (probes.STREAM_WIRING); any other
# site is a probe's leaf name inside block L (attn.out, ffn.down, ffn.act, attn.z, ...).
STREAM_SITES = {"resid_pre": "in", "resid_mid": "mid", "resid_post": "out"}
POSITIONS = ("last", "mean")
# Probes whose width depends on the text (scores, weights) or that hold some tokens only (one expert's):
# no fixed feature vector to probe.
_UNFIT = ("scores", "weights", "tiles")


@dataclass
class LayerProbe:
    layer: int
    weight: torch.Tensor  # (C, F), reading standardised features
    bias: torch.Tensor  # (C,)
    mean: torch.Tensor  # (F,)
    std: torch.Tensor  # (F,)
    train_accuracy: float
    heldout_accuracy: float

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, F) raw activations -> (n, C) class scores."""
        return ((x.double() - self.mean.double()) / self.std.double()) @ self.weight.double().T + self.bias.double()


@dataclass
class ProbeResult:
    site: str
    position: str
    classes: list
    layers: list[LayerProbe]
    n_train: int
    n_heldout: int
    baseline: float  # held-out accuracy of always answering the training set's most common class
    names: dict[int, str] = field(default_factory=dict)  # layer -> the probe name read


# ----------------------------------------------------------------------------- data


def read_labelled(path: str | Path) -> tuple[list[str], list]:
    """A JSONL file of {"text": ..., "label": ...} lines -> (texts, labels); one line per bad input."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"cannot read --data {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--data {path} is not UTF-8 text (byte offset {e.start})") from None
    texts, labels = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--data {path}, line {n} is not JSON ({e.msg}): each line is "
                            '{"text": ..., "label": ...}') from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or "label" not in row:
            raise UserError(f'--data {path}, line {n}: each line is {{"text": "...", "label": ...}} (a string text '
                            "and a label)")
        label = row["label"]
        if not isinstance(label, (str, int, bool)):
            raise UserError(f"--data {path}, line {n}: the label must be a string, a whole number or true/false, "
                            f"got {json.dumps(label)}")
        texts.append(row["text"])
        labels.append(label)
    check_labels(labels, str(path))
    return texts, labels


def check_labels(labels: list, where: str) -> None:
    if not labels:
        raise UserError(f"{where} holds no labelled text: give JSONL lines {{\"text\": ..., \"label\": ...}}")
    classes = sorted(set(map(json.dumps, labels)))
    if len(classes) < 2:
        raise UserError(f"{where} has one class only ({classes[0]}, {len(labels)} texts): a probe needs at "
                        "least two labels to tell apart")


def split(n: int, heldout: float, seed: int, labels: list | None = None) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: a seeded shuffle, held-out the last `heldout` share of each class
    (stratified, so a rare class is in both parts), at least one text per part."""
    if not 0 < heldout < 1:
        raise UserError(f"--heldout must be between 0 and 1 (the share of texts scored, not trained on), got {heldout}")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).tolist()
    groups: dict[str, list[int]] = {}
    for i in order:
        groups.setdefault(json.dumps(labels[i]) if labels is not None else "", []).append(i)
    train, held = [], []
    for idx in groups.values():
        k = min(len(idx) - 1, max(1, round(len(idx) * heldout))) if len(idx) > 1 else 0
        held += idx[len(idx) - k:]
        train += idx[:len(idx) - k]
    if not train or not held:
        raise UserError(f"{n} texts are too few to split into a training and a held-out part: give more")
    return sorted(train), sorted(held)


# ----------------------------------------------------------------------------- activations


def site_names(model, site: str, layers: list[int]) -> dict[int, str]:
    """layer -> the probe name read there; an unknown site is refused, listing the sites."""
    cfg = model.config
    for L in layers:
        if not 0 <= L < cfg.n_layers:
            raise UserError(f"--layers {L}: this model has {cfg.n_layers} blocks (0..{cfg.n_layers - 1})")
    if site in STREAM_SITES:
        return {L: stream_probes(L, cfg.norm_placement, cfg.ffn)[STREAM_SITES[site]] for L in layers}
    known = available_sites(model)
    if site not in known:
        raise UserError(f"unknown --site {site!r}: the sites are {', '.join(list(STREAM_SITES) + known)}")
    return {L: f"blocks.{L}.{site}" for L in layers}


@torch.no_grad()
def available_sites(model) -> list[str]:
    """The leaf names of block 0's probes that hold one feature vector per token."""
    from ..tracing.trace import TraceRecorder, eval_mode, recording

    rec = TraceRecorder(layers=[0])
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    with eval_mode(model), recording(rec):
        model(ids)
    out = []
    for name in rec.seen:
        parts = name.split(".")
        if parts[:2] != ["blocks", "0"] or "experts" in parts or parts[-1] in _UNFIT:
            continue
        out.append(".".join(parts[2:]))
    return out


@torch.no_grad()
def activations(model, rows: list[list[int]], names: dict[int, str], position: str = "last",
                batch: int = 16) -> dict[int, torch.Tensor]:
    """layer -> (n, F) float32: each text's activation at names[layer], at its last token or the mean
    over its tokens; trailing axes (heads × features) flattened. Right-padded batches: a causal
    model's positions never read the padding after them."""
    from ..tracing.trace import TraceRecorder, eval_mode, recording

    if position not in POSITIONS:
        raise UserError(f"--position must be one of {', '.join(POSITIONS)}, got {position!r}")
    device = next(model.parameters()).device
    want = set(names.values())
    out: dict[int, list[torch.Tensor]] = {L: [] for L in names}
    for lo in range(0, len(rows), batch):
        part = rows[lo:lo + batch]
        n = torch.tensor([len(r) for r in part])  # (b,)
        T = int(n.max())
        ids = torch.tensor([r + [0] * (T - len(r)) for r in part], device=device)  # (b, T)
        rec = TraceRecorder(only=want)
        with eval_mode(model), recording(rec):
            model(ids)
        for L, name in names.items():
            x = rec.seen[name].reshape(len(part), T, -1).double()  # (b, T, F)
            if position == "last":
                out[L].append(x[torch.arange(len(part)), n - 1])  # (b, F)
            else:
                keep = (torch.arange(T)[None] < n[:, None]).double()  # (b, T)
                out[L].append((x * keep[..., None]).sum(1) / n[:, None].double())  # (b, F)
    return {L: torch.cat(v).float() for L, v in out.items()}


# ----------------------------------------------------------------------------- fitting


def fit_logistic(x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float = 1e-3,
                 steps: int = 200) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression on standardised features: minimises mean cross-entropy +
    l2/2 · |W|² with L-BFGS from zero (a convex problem: one answer whatever the start). Returns
    (weight (C, F), bias (C,), mean (F,), std (F,)), in float64."""
    x = x.double()
    mean, std = x.mean(0), x.std(0, unbiased=False)
    std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant feature reads as 0
    xs = (x - mean) / std  # (n, F)
    W = torch.zeros(n_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1.0, max_iter=steps, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def loss_fn():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xs @ W.T + b, y) + 0.5 * l2 * (W * W).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(loss_fn)
    return W.detach(), b.detach(), mean, std


def train_probes(model, tokenizer, texts: list[str], labels: list, site: str, layers: list[int] | None = None,
                 position: str = "last", heldout: float = 0.25, seed: int = 0, l2: float = 1e-3) -> ProbeResult:
    """A logistic probe per layer at `site`, trained on a seeded share of the texts, scored on the rest."""
    check_labels(labels, "the labelled data")
    if len(texts) != len(labels):
        raise UserError(f"{len(texts)} texts but {len(labels)} labels: give one label per text")
    cfg = model.config
    layers = list(range(cfg.n_layers)) if layers is None else list(dict.fromkeys(layers))
    names = site_names(model, site, layers)
    if position not in POSITIONS:
        raise UserError(f"--position must be one of {', '.join(POSITIONS)}, got {position!r}")
    rows = encode_texts(tokenizer, texts, "the data", cfg.max_seq_len)
    classes = [json.loads(c) for c in sorted(set(map(json.dumps, labels)))]  # (1 and true stay two classes)
    index = {json.dumps(c): i for i, c in enumerate(classes)}
    y = torch.tensor([index[json.dumps(v)] for v in labels])  # (n,)
    train, held = split(len(texts), heldout, seed, labels)
    feats = activations(model, rows, names, position)
    majority = int(torch.bincount(y[train], minlength=len(classes)).argmax())
    baseline = float((y[held] == majority).double().mean())
    out = []
    for L in layers:
        x = feats[L]
        W, b, mean, std = fit_logistic(x[train], y[train], len(classes), l2)
        probe = LayerProbe(L, W, b, mean, std, 0.0, 0.0)
        probe.train_accuracy = float((probe.logits(x[train]).argmax(-1) == y[train]).double().mean())
        probe.heldout_accuracy = float((probe.logits(x[held]).argmax(-1) == y[held]).double().mean())
        out.append(probe)
    return ProbeResult(site, position, classes, out, len(train), len(held), baseline, names)


# ----------------------------------------------------------------------------- saving


def save_probes(result: ProbeResult, out: str | Path, extra: dict | None = None) -> dict:
    """Write probes.safetensors, probes.json and accuracy.svg (+ .png with matplotlib) into `out`;
    returns the JSON summary."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for p in result.layers:
        for key, t in (("weight", p.weight), ("bias", p.bias), ("mean", p.mean), ("std", p.std)):
            tensors[f"layer{p.layer}.{key}"] = t.float().contiguous()
    save_file(tensors, str(out / "probes.safetensors"), metadata={"format": "glassformer-probes", "site": result.site})
    summary = {"site": result.site, "position": result.position, "classes": result.classes,
               "n_train": result.n_train, "n_heldout": result.n_heldout, "baseline": result.baseline,
               "layers": [{"layer": p.layer, "probe": result.names.get(p.layer), "features": int(p.weight.shape[1]),
                           "train_accuracy": p.train_accuracy, "heldout_accuracy": p.heldout_accuracy}
                          for p in result.layers],
               **(extra or {})}
    (out / "probes.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "accuracy.svg").write_text(accuracy_svg(result), encoding="utf-8")
    try:
        _png(result, out / "accuracy.png")
    except ImportError:  # matplotlib is the optional `plot` extra; the SVG above is the picture
        pass
    return summary


def load_probes(folder: str | Path) -> dict[int, LayerProbe]:
    """layer -> LayerProbe from a folder save_probes wrote (accuracies from its probes.json)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    t = load_file(str(folder / "probes.safetensors"))
    summary = json.loads((folder / "probes.json").read_text(encoding="utf-8"))
    out = {}
    for row in summary["layers"]:
        L = row["layer"]
        out[L] = LayerProbe(L, t[f"layer{L}.weight"], t[f"layer{L}.bias"], t[f"layer{L}.mean"], t[f"layer{L}.std"],
                            row["train_accuracy"], row["heldout_accuracy"])
    return out


def accuracy_svg(result: ProbeResult, width: int = 480, height: int = 280) -> str:
    """Held-out (solid) and training (dashed) accuracy per layer, the majority-class baseline as a grey
    line: a self-contained SVG, no plotting library needed."""
    left, right, top, bottom = 48, 16, 44, 36
    w, h = width - left - right, height - top - bottom
    layers = [p.layer for p in result.layers]
    lo, hi = min(layers), max(layers)

    def px(layer):
        return left + (w / 2 if hi == lo else (layer - lo) / (hi - lo) * w)

    def py(acc):
        return top + (1 - acc) * h

    def path(values):
        return " ".join(f"{'M' if i == 0 else 'L'}{px(L):.1f},{py(a):.1f}" for i, (L, a) in enumerate(values))

    held = [(p.layer, p.heldout_accuracy) for p in result.layers]
    train = [(p.layer, p.train_accuracy) for p in result.layers]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11">',
             f'<text x="{left}" y="16" font-size="12">linear probe at {_esc(result.site)} ({result.position} token): '
             f'accuracy by layer</text>']
    for acc in (0, 0.25, 0.5, 0.75, 1):
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{py(acc):.1f}" y2="{py(acc):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{py(acc) + 4:.1f}" text-anchor="end">{acc:g}</text>')
    for L in layers:
        parts.append(f'<text x="{px(L):.1f}" y="{top + h + 16}" text-anchor="middle">{L}</text>')
    parts.append(f'<text x="{left + w / 2}" y="{height - 4}" text-anchor="middle">layer</text>')
    parts.append(f'<line x1="{left}" x2="{left + w}" y1="{py(result.baseline):.1f}" y2="{py(result.baseline):.1f}" '
                 f'stroke="#999" stroke-dasharray="2,3"><title>majority class: {result.baseline:.3f}</title></line>')
    parts.append(f'<path d="{path(train)}" fill="none" stroke="#ff7f0e" stroke-dasharray="5,3"/>')
    parts.append(f'<path d="{path(held)}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    for L, a in held:
        parts.append(f'<circle cx="{px(L):.1f}" cy="{py(a):.1f}" r="3" fill="#1f77b4">'
                     f'<title>layer {L}: held-out {a:.3f}</title></circle>')
    parts.append(f'<text x="{left}" y="32" fill="#555"><tspan fill="#1f77b4">— held-out</tspan> · '
                 f'<tspan fill="#ff7f0e">- - training</tspan> · <tspan fill="#999">··· majority class</tspan></text>')
    parts.append("</svg>\n")
    return "\n".join(parts)


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _png(result: ProbeResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    layers = [p.layer for p in result.layers]
    ax.plot(layers, [p.heldout_accuracy for p in result.layers], "o-", label="held-out")
    ax.plot(layers, [p.train_accuracy for p in result.layers], "--", label="training")
    ax.axhline(result.baseline, color="grey", linestyle=":", label="majority class")
    ax.set(xlabel="layer", ylabel="accuracy", ylim=(0, 1.02), title=f"linear probe at {result.site}", xticks=layers)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
