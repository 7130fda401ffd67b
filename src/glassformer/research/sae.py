"""Sparse autoencoders on one site of the model: a TopK SAE (Gao et al., 2024, "Scaling and
evaluating sparse autoencoders") trained on the activations the model's own probes show, its
features browsed by their top-activating contexts and their direct effect on the logits, and
ablated or steered while the model generates. docs/research.md#sparse-autoencoders.

The SAE, as SAELens's "topk" architecture computes it (so an export loads there unchanged):
    pre  = (x - b_dec) @ W_enc + b_enc           (d_sae,)
    acts = relu of the k largest of pre, 0 elsewhere
    x̂    = acts @ W_dec + b_dec                  W_dec's rows (one per feature) have unit norm

Folder format (one folder per SAE):
    sae_weights.safetensors   W_enc (d_in, d_sae), b_enc (d_sae,), W_dec (d_sae, d_in), b_dec (d_in,), float32
    cfg.json                  SAELens's config for those weights (architecture "topk"), so SAELens's
                              SAE.load_from_disk reads the folder itself
    sae.json                  ours: format, site, probe, d_in, d_sae, k, the model's shape, training
                              settings and the last evaluation
    train_state.pt            what `--resume` needs: optimizer, step, chunk, per-feature last firing
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..probes import stream_probes
from ..tracing.trace import eval_mode, recording

FORMAT = "glassformer-sae"
WEIGHTS, SAELENS_CFG, META, STATE = "sae_weights.safetensors", "cfg.json", "sae.json", "train_state.pt"
SAELENS_VERSION = "6.54.12"  # the SAELens whose loader the export is tested against
# Residual-stream and sublayer sites by TransformerLens's hook names (what SAELens's hook_name holds).
KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
_HOOK = re.compile(r"blocks\.(\d+)\.hook_(resid_pre|resid_mid|resid_post|attn_out|mlp_out)")
_NOT_SITES = ("scores", "weights", "probs", "logits", "uncapped", "tiles")  # shown only, or not a hidden state


# ----------------------------------------------------------------------------- sites


@dataclass(frozen=True)
class Site:
    """Where an SAE reads: the probe that holds it, and its TransformerLens hook name where it has one."""

    probe: str
    hook: str | None  # 'blocks.L.hook_resid_pre' etc., or None for a probe with no TransformerLens twin
    layer: int | None
    kind: str | None  # one of KINDS, or None

    @property
    def name(self) -> str:
        return self.hook or self.probe


def _kind_probe(cfg, layer: int, kind: str) -> str:
    if kind == "mlp_out" and cfg.ffn == "none":
        raise UserError(f"blocks.{layer}.hook_mlp_out: this model has no feed-forward (ffn='none'), so no mlp_out")
    if kind in ("attn_out", "mlp_out"):
        return f"blocks.{layer}." + ("attn.out" if kind == "attn_out" else "ffn.down")
    w = stream_probes(layer, cfg.norm_placement, cfg.ffn)
    return w[{"resid_pre": "in", "resid_mid": "mid", "resid_post": "out"}[kind]]


def resolve_site(model, name: str) -> Site:
    """A site named by its TransformerLens hook ('blocks.2.hook_resid_pre') or by one of our probes
    ('blocks.1.resid_out', 'blocks.0.ffn.act'); unknown names are refused listing the sites."""
    cfg = model.config
    m = _HOOK.fullmatch(name)
    if m:
        layer, kind = int(m[1]), m[2]
        if not 0 <= layer < cfg.n_layers:
            raise UserError(f"site {name}: this model's blocks run 0..{cfg.n_layers - 1}")
        return Site(_kind_probe(cfg, layer, kind), name, layer, kind)
    widths = probe_widths(model)
    if name not in widths:
        kinds = [k for k in KINDS if k != "mlp_out" or cfg.ffn != "none"]
        raise UserError(f"unknown site {name!r}: give blocks.L.hook_X, X one of {', '.join(kinds)} (L 0..{cfg.n_layers - 1}), "
                        f"or a probe of width D per token, e.g. {', '.join(list(widths)[:4])}")
    for layer in range(cfg.n_layers):  # the same place under its hook name, when it has one
        for kind in KINDS:
            if kind == "mlp_out" and cfg.ffn == "none":
                continue
            if _kind_probe(cfg, layer, kind) == name:  # the first: blocks.0.resid_out is hook_resid_post of 0
                return Site(name, f"blocks.{layer}.hook_{kind}", layer, kind)
    m = re.match(r"blocks\.(\d+)\.", name)
    return Site(name, None, int(m[1]) if m else None, None)


@torch.no_grad()
def probe_widths(model) -> dict[str, int]:
    """Every probe that holds one vector per token (B, T, D'), with D', from one forward of 2 tokens."""
    seen: dict[str, int] = {}

    class _All:
        def wants(self, name):
            return True

        def __call__(self, name, x):
            if x.dim() == 3 and x.is_floating_point() and name.rsplit(".", 1)[-1] not in _NOT_SITES:
                seen.setdefault(name, int(x.shape[-1]))
            return x

    idx = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    with eval_mode(model), recording(_All()):
        model(idx)
    return seen


def model_shape(cfg) -> dict:
    """What an SAE remembers of the model it was made on, to refuse another."""
    return {"n_layers": cfg.n_layers, "dim": cfg.dim, "vocab_size": cfg.vocab_size, "norm_placement": cfg.norm_placement}


# ----------------------------------------------------------------------------- the SAE


def weighted_rows(v: torch.Tensor, i: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Σ_j v[..., j] · W[i[..., j]] for (..., k) weights and row indices: (..., D). embedding_bag does it
    without the (..., k, D) copy of the gathered rows that an einsum over W[i] makes, and its backward
    adds into W's chosen rows directly: half the time of a TopK SAE step on a CPU (bench/sae.py)."""
    flat = torch.nn.functional.embedding_bag(i.reshape(-1, i.shape[-1]), W, per_sample_weights=v.reshape(-1, v.shape[-1]),
                                             mode="sum")
    return flat.reshape(*i.shape[:-1], W.shape[-1])


class TopKSAE(nn.Module):
    """A TopK sparse autoencoder with SAELens's parameter names and shapes."""

    def __init__(self, d_in: int, d_sae: int, k: int):
        super().__init__()
        if not 1 <= k <= d_sae:
            raise UserError(f"--k must lie in 1..{d_sae} (the number of features), got {k}")
        self.d_in, self.d_sae, self.k = d_in, d_sae, k
        self.W_enc = nn.Parameter(torch.empty(d_in, d_sae))
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.W_dec = nn.Parameter(torch.empty(d_sae, d_in))
        self.b_dec = nn.Parameter(torch.zeros(d_in))

    @torch.no_grad()
    def initialize(self, generator: torch.Generator, mean: torch.Tensor | None = None) -> None:
        """Unit-norm random decoder rows, the encoder their transpose (Gao et al. 2024 §A.1: tied at the
        start, then free), b_dec the data's mean (so the first encodings are of centred activations)."""
        w = torch.randn(self.d_sae, self.d_in, generator=generator)
        self.W_dec.copy_(w / w.norm(dim=-1, keepdim=True))
        self.W_enc.copy_(self.W_dec.T)
        self.b_enc.zero_()
        self.b_dec.copy_(torch.zeros(self.d_in) if mean is None else mean)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.b_dec) @ self.W_enc + self.b_enc  # (..., d_sae)

    def encode_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices), each (..., k): the k chosen features and their activations (ReLU'd)."""
        v, i = self.pre(x).topk(self.k, dim=-1, sorted=False)
        return v.relu(), i

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Dense feature activations (..., d_sae): zero outside each row's top k."""
        v, i = self.encode_topk(x)
        return torch.zeros(*x.shape[:-1], self.d_sae, dtype=v.dtype, device=v.device).scatter_(-1, i, v)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        return acts @ self.W_dec + self.b_dec

    def decode_topk(self, v: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """x̂ from the top k alone (a gather of k rows, not a d_sae-wide product)."""
        return weighted_rows(v, i, self.W_dec) + self.b_dec

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v, i = self.encode_topk(x)
        return self.decode_topk(v, i), v, i

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Drop the part of W_dec's gradient along each row: with rows renormalised after each step, that
        part would only change their length (Bricken et al., 2023)."""
        if self.W_dec.grad is not None:
            w = self.W_dec
            self.W_dec.grad -= (self.W_dec.grad * w).sum(-1, keepdim=True) * w


def explained_variance(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """1 − Σ‖x − x̂‖² / Σ‖x − mean(x)‖² over the tokens: the share of the activations' variance kept."""
    x, x_hat = x.double(), x_hat.double()
    return float(1 - ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum().clamp_min(1e-30))


# ----------------------------------------------------------------------------- activations


class _Stop(Exception):
    """Raised by the recorder once it holds the site: the rest of the forward is not needed."""


class _Grab:
    """A probes.Recorder that keeps one probe's tensor (on its device) and stops the forward there."""

    def __init__(self, name: str):
        self.name, self.x = name, None

    def wants(self, name):
        return name == self.name

    def __call__(self, name, x):
        if name == self.name:
            self.x = x.detach()
            raise _Stop
        return x


@torch.no_grad()
def site_activations(model, probe: str, windows: torch.Tensor) -> torch.Tensor:
    """The site's activations (B, T, d_in) in float32 for token windows (B, T): one forward, stopped at the site."""
    grab = _Grab(probe)
    dev = next(model.parameters()).device
    with eval_mode(model), recording(grab):
        try:
            model(windows.to(dev))
        except _Stop:
            pass
    if grab.x is None:
        raise UserError(f"the model never showed probe {probe}")
    return grab.x.float()


def _windows(ids: np.ndarray, n_windows: int, ctx: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - ctx + 1, (n_windows,), generator=g).numpy()
    return torch.from_numpy(np.stack([ids[s:s + ctx] for s in starts]).astype(np.int64))


def chunk_generator(seed: int, chunk: int) -> torch.Generator:
    """The draws of chunk `chunk` (its windows and their order) depend on (seed, chunk) alone, so a resumed
    run reads exactly what an unbroken one would."""
    return torch.Generator().manual_seed((seed * 1_000_003 + chunk) % (1 << 63))


# ----------------------------------------------------------------------------- training


@dataclass
class TrainSettings:
    features: int
    k: int
    tokens: int = 2_000_000  # training tokens in all (a resumed run continues to this total)
    batch_tokens: int = 4096  # activations per optimizer step
    chunk_batches: int = 16  # steps per harvested chunk (its activations are shuffled together)
    context: int = 128  # tokens per window the model reads
    lr: float = 4e-4
    aux_k_coef: float = 1 / 32  # AuxK loss on dead features (Gao et al. 2024 §A.2)
    dead_tokens: int = 1_000_000  # a feature that has not fired for this many training tokens is dead
    eval_tokens: int = 16384
    seed: int = 0

    @property
    def chunk_tokens(self) -> int:
        return self.batch_tokens * self.chunk_batches


def check_settings(s: TrainSettings, max_seq_len: int) -> None:
    for flag, v in (("--features", s.features), ("--k", s.k), ("--tokens", s.tokens), ("--batch-tokens", s.batch_tokens),
                    ("--context", s.context), ("--eval-tokens", s.eval_tokens)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    if s.k > s.features:
        raise UserError(f"--k {s.k} is more than --features {s.features}: each token keeps k of the features")
    if s.context > max_seq_len:
        raise UserError(f"--context {s.context} is longer than the model's {max_seq_len} tokens")
    if s.batch_tokens % s.context:
        raise UserError(f"--batch-tokens {s.batch_tokens} must be a multiple of --context {s.context} (whole windows)")
    if not s.lr > 0:
        raise UserError(f"--lr must be > 0, got {s.lr}")


def _aux_loss(sae: TopKSAE, x: torch.Tensor, x_hat: torch.Tensor, pre: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """AuxK: the dead features' top k_aux pre-activations reconstruct the residual x − x̂, so a dead
    feature gets a gradient again (Gao et al. 2024 §A.2; k_aux = d_in / 2)."""
    k_aux = min(sae.d_in // 2 or 1, int(dead.sum()))
    e = (x - x_hat).detach()
    masked = pre.masked_fill(~dead, float("-inf"))
    v, i = masked.topk(k_aux, dim=-1)
    e_hat = weighted_rows(v.relu(), i, sae.W_dec)
    return ((e - e_hat) ** 2).sum(-1).mean() / (e ** 2).sum(-1).mean().clamp_min(1e-12)


@torch.no_grad()
def evaluate(sae: TopKSAE, x: torch.Tensor, batch: int = 4096) -> dict:
    """Explained variance, L0 (features firing per token) and dead features (never firing) on activations x (N, d_in)."""
    fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=x.device)
    x_hat, l0 = [], 0.0
    for s in range(0, len(x), batch):
        xh, v, i = sae(x[s:s + batch])
        x_hat.append(xh)
        pos = v > 0
        l0 += float(pos.sum())
        fired[i[pos]] = True
    x_hat = torch.cat(x_hat)
    dead = int((~fired).sum())
    return {"explained_variance": explained_variance(x, x_hat), "l0": l0 / len(x), "dead_features": dead,
            "dead_fraction": dead / sae.d_sae, "eval_tokens": len(x)}


class Trainer:
    """A resumable TopK SAE training run into `out` (docs/research.md#sparse-autoencoders)."""

    def __init__(self, model, site: Site, train_ids: np.ndarray, eval_ids: np.ndarray, settings: TrainSettings,
                 out: str | Path, model_name: str = "", device: str | torch.device = "cpu", resume: bool = False):
        self.model, self.site, self.s, self.out = model, site, settings, Path(out)
        self.model_name, self.device = model_name, torch.device(device)
        check_settings(settings, model.config.max_seq_len)
        for what, ids in (("training", train_ids), ("evaluation", eval_ids)):
            if len(ids) < settings.context:
                raise UserError(f"the {what} data holds {len(ids)} tokens, fewer than one --context window "
                                f"of {settings.context}: give more text or a shorter --context")
        self.train_ids, self.eval_ids = train_ids, eval_ids
        self.d_in = int(site_activations(model, site.probe, torch.zeros(1, 1, dtype=torch.long)).shape[-1])
        self.sae = TopKSAE(self.d_in, settings.features, settings.k).to(self.device)
        self.opt = torch.optim.Adam(self.sae.parameters(), lr=settings.lr, betas=(0.9, 0.999), eps=6.25e-10)
        self.step = self.chunk = self.tokens = 0
        self.since_fired = torch.zeros(settings.features, dtype=torch.long, device=self.device)
        self.seconds = 0.0
        if resume:
            self._resume()
        elif (self.out / STATE).exists() or (self.out / WEIGHTS).exists():
            raise UserError(f"{self.out} already holds an SAE: pass --resume to continue it, or give a new --out")

    def _resume(self) -> None:
        if not (self.out / STATE).is_file():
            raise UserError(f"--resume: {self.out} holds no {STATE} to continue from")
        meta = read_meta(self.out)
        check_fits(meta, self.model.config, self.site.probe, self.d_in, str(self.out))
        if (meta["d_sae"], meta["k"]) != (self.s.features, self.s.k):
            raise UserError(f"--resume: {self.out} has {meta['d_sae']} features and k {meta['k']}, but --features "
                            f"{self.s.features} --k {self.s.k} were given")
        load_weights(self.sae, self.out)
        st = torch.load(self.out / STATE, map_location=self.device, weights_only=True)
        self.opt.load_state_dict(st["optimizer"])
        self.step, self.chunk, self.tokens = int(st["step"]), int(st["chunk"]), int(st["tokens"])
        self.since_fired = st["since_fired"].to(self.device)
        self.seconds = float(st.get("seconds", 0.0))

    def _chunk_acts(self, ids: np.ndarray, n_tokens: int, g: torch.Generator) -> torch.Tensor:
        """n_tokens activations (N, d_in) of the site over random windows, harvested a batch of windows at a time."""
        ctx = self.s.context
        n_windows = math.ceil(n_tokens / ctx)
        wins = _windows(ids, n_windows, ctx, g)
        per = max(1, self.s.batch_tokens // ctx)
        acts = [site_activations(self.model, self.site.probe, wins[b:b + per]).reshape(-1, self.d_in)
                for b in range(0, n_windows, per)]
        return torch.cat(acts)[:n_tokens].to(self.device)

    def train(self, progress: bool = True) -> dict:
        from tqdm import tqdm

        s = self.s
        eval_acts = self._chunk_acts(self.eval_ids, s.eval_tokens, chunk_generator(s.seed, -1))
        total_steps = math.ceil(s.tokens / s.batch_tokens)
        bar = tqdm(total=total_steps, initial=min(self.step, total_steps), unit="step", disable=not progress,
                   desc=f"sae {self.site.name}", dynamic_ncols=True)
        t0 = time.perf_counter()
        last = {}
        while self.step < total_steps:
            g = chunk_generator(s.seed, self.chunk)
            acts = self._chunk_acts(self.train_ids, s.chunk_tokens, g)
            if self.step == 0:
                self.sae.initialize(torch.Generator().manual_seed(s.seed), acts.mean(0).cpu())
            order = torch.randperm(len(acts), generator=g).to(self.device)
            for b in range(s.chunk_batches):
                if self.step >= total_steps:
                    break
                last = self._train_step(acts[order[b * s.batch_tokens:(b + 1) * s.batch_tokens]])
                bar.update(1)
                bar.set_postfix(ev=f"{last['explained_variance']:.3f}", l0=f"{last['l0']:.1f}", dead=last["dead"])
            self.chunk += 1
            self.seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            self.save()
        bar.close()
        ev = evaluate(self.sae, eval_acts)
        result = {"site": self.site.name, "probe": self.site.probe, "d_in": self.d_in, "d_sae": s.features, "k": s.k,
                  "steps": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                  "tokens_per_s": self.tokens / max(self.seconds, 1e-9), **ev}
        self.save(result)
        return result

    def _train_step(self, x: torch.Tensor) -> dict:
        sae, s = self.sae, self.s
        pre = sae.pre(x)
        v, i = pre.topk(sae.k, dim=-1, sorted=False)
        v = v.relu()
        x_hat = weighted_rows(v, i, sae.W_dec) + sae.b_dec
        var = ((x - x.mean(0)) ** 2).sum(-1).mean().clamp_min(1e-12)
        mse = ((x - x_hat) ** 2).sum(-1).mean() / var  # normalised: 1 − explained variance, whatever the site's scale
        dead = self.since_fired > s.dead_tokens
        loss = mse + (s.aux_k_coef * _aux_loss(sae, x, x_hat, pre, dead) if dead.any() else 0.0)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.remove_parallel_grad()
        self.opt.step()
        sae.normalize_decoder()
        with torch.no_grad():
            fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=x.device)
            fired[i[v > 0]] = True
            self.since_fired += len(x)
            self.since_fired[fired] = 0
        self.step += 1
        self.tokens += len(x)
        return {"loss": float(loss.detach()), "explained_variance": 1 - float(mse.detach()), "l0": float((v > 0).sum()) / len(x),
                "dead": int(dead.sum())}

    def save(self, result: dict | None = None) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "site": self.site.name, "probe": self.site.probe, "hook_name": self.site.hook,
                "layer": self.site.layer, "d_in": self.d_in, "d_sae": self.s.features, "k": self.s.k,
                "model": model_shape(self.model.config), "model_name": self.model_name,
                "settings": {k: getattr(self.s, k) for k in TrainSettings.__dataclass_fields__},
                "steps": self.step, "tokens": self.tokens}
        if result is not None:
            meta["evaluation"] = {k: result[k] for k in ("explained_variance", "l0", "dead_features", "dead_fraction",
                                                         "eval_tokens")}
        save_sae(self.sae, self.out, meta, context_size=self.s.context)
        state = {"optimizer": self.opt.state_dict(), "step": self.step, "chunk": self.chunk, "tokens": self.tokens,
                 "since_fired": self.since_fired.cpu(), "seconds": self.seconds}
        tmp = self.out / (STATE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / STATE)


# ----------------------------------------------------------------------------- files


def saelens_config(sae: TopKSAE, meta: dict, context_size: int | None = None) -> dict:
    """cfg.json as SAELens 6.54 writes it for a TopKSAE (SAEConfig.to_dict), our site in its metadata."""
    return {"d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
            "normalize_activations": "none", "reshape_activations": "none",
            "metadata": {"sae_lens_version": SAELENS_VERSION, "sae_lens_training_version": SAELENS_VERSION,
                         "model_name": meta.get("model_name") or "glassformer",
                         "hook_name": meta.get("hook_name") or meta["probe"], "hook_head_index": None,
                         "context_size": context_size, "prepend_bos": False, "model_class_name": "glassformer"},
            "k": sae.k, "rescale_acts_by_decoder_norm": False, "architecture": "topk"}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def save_sae(sae: TopKSAE, folder: str | Path, meta: dict, context_size: int | None = None) -> Path:
    """Write the weights, SAELens's cfg.json and our sae.json into `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().float().cpu().contiguous() for n, p in sae.named_parameters()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT})
    tmp.replace(folder / WEIGHTS)
    _write_json(folder / SAELENS_CFG, saelens_config(sae, meta, context_size))
    _write_json(folder / META, meta)
    return folder


def export_saelens(folder: str | Path, out: str | Path) -> Path:
    """SAELens's two files alone (cfg.json, sae_weights.safetensors) in `out`, e.g. for a Hub upload."""
    import shutil

    folder, out = Path(folder), Path(out)
    read_meta(folder)
    if out.resolve() == folder.resolve():
        raise UserError(f"--out {out} is the SAE's own folder, which already holds SAELens's files")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in (WEIGHTS, SAELENS_CFG):
        shutil.copyfile(folder / name, out / name)
    return out


def read_meta(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / META
    if not path.is_file():
        raise UserError(f"{folder} is not an SAE folder: it has no {META} (make one with `glassformer sae train`)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is not a glassformer SAE (format {meta.get('format')!r})")
    return meta


def load_weights(sae: TopKSAE, folder: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(folder / WEIGHTS))
    for n, p in sae.named_parameters():
        if n not in sd or tuple(sd[n].shape) != tuple(p.shape):
            got = tuple(sd[n].shape) if n in sd else "missing"
            raise UserError(f"{folder / WEIGHTS}: {n} is {got}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(sd[n])


def check_fits(meta: dict, cfg, probe: str, width: int, where: str) -> None:
    """Refuse an SAE made for another model, site or width, naming both shapes."""
    mine = model_shape(cfg)
    theirs = {k: meta["model"].get(k) for k in mine}
    if theirs != mine:
        raise UserError(f"{where} was made for a model of {_shape(theirs)}; this model has {_shape(mine)}: "
                        f"train the SAE on this model")
    if meta["probe"] != probe or meta["d_in"] != width:
        raise UserError(f"{where} reads {meta['site']} ({meta['probe']}, width {meta['d_in']}); this site is "
                        f"{probe} of width {width}")


def _shape(m: dict) -> str:
    return f"{m['n_layers']} blocks of width {m['dim']}, {m['vocab_size']} tokens, {m['norm_placement']}-norm"


def load_sae(folder: str | Path, model=None, device="cpu") -> tuple[TopKSAE, dict, Site | None]:
    """(sae, sae.json, site): with `model`, the SAE is checked to fit it (same shape, its site there of its width)."""
    folder = Path(folder)
    meta = read_meta(folder)
    sae = TopKSAE(meta["d_in"], meta["d_sae"], meta["k"])
    load_weights(sae, folder)
    site = None
    if model is not None:
        check_fits(meta, model.config, meta["probe"], meta["d_in"], str(folder))  # the model's shape first
        site = resolve_site(model, meta["site"])
        width = probe_widths(model).get(site.probe)
        check_fits(meta, model.config, site.probe, width, str(folder))
    return sae.to(device).eval(), meta, site


# ----------------------------------------------------------------------------- data


def data_ids(path: str | Path, model, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, evaluation ids) from a prepared folder (its train and val splits) or a UTF-8 text file
    (its last tenth held out for evaluation)."""
    path = Path(path)
    vocab = model.config.vocab_size
    if path.is_dir():
        from ..text.data import load_split, read_meta as read_data_meta

        meta = read_data_meta(path)
        if meta["vocab_size"] != vocab:
            raise UserError(f"{path} was tokenized with {meta['vocab_size']} token ids but the model has {vocab}: "
                            f"use the data folder the model was trained on, or a text file")
        train = load_split(path, "train", meta)
        train_ids = np.asarray(train.array[:len(train)])
        try:
            val = load_split(path, "val", meta)
            eval_ids = np.asarray(val.array[:len(val)])
        except (FileNotFoundError, UserError):
            eval_ids = train_ids
        return train_ids, eval_ids
    if not path.is_file():
        raise UserError(f"--data {path} does not exist: give a UTF-8 text file or a prepared data folder")
    if tokenizer is None:
        raise UserError("this checkpoint has no tokenizer.json, so a text file cannot be read: give a prepared folder")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--data {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    cut = len(ids) - max(len(ids) // 10, 1)
    return ids[:cut], ids[cut:]


# ----------------------------------------------------------------------------- browsing features


def _piece(tokenizer, i: int) -> str:
    from .tokens import pieces

    return pieces(tokenizer, [i])[0] if tokenizer is not None else f"#{i}"


@torch.no_grad()
def logit_effects(model, sae: TopKSAE, features: list[int], n: int = 8, tokenizer=None) -> dict[int, dict] | None:
    """Each feature's direct effect on the logits: its decoder row read as the stream, through the final
    norm and the LM head (the logit lens of the direction; the norm's scale is the row's own, so the
    tokens' order is that of W_dec[f] · diag(norm weight) · W_Uᵀ). None when the site is not as wide as
    the stream."""
    if sae.d_in != model.config.dim or not features:
        return None
    out = {}
    w = model.lm_head.weight
    for s in range(0, len(features), 256):
        fs = features[s:s + 256]
        rows = sae.W_dec[fs].to(device=w.device, dtype=w.dtype)  # (F, D)
        logits = model.unembed(model.final_norm(rows)).float().cpu()  # (F, V)
        k = min(n, logits.shape[-1])
        top, bottom = logits.topk(k, dim=-1), logits.topk(k, dim=-1, largest=False)
        for r, f in enumerate(fs):
            out[f] = {"top": [[_piece(tokenizer, int(t)), round(float(v), 4)] for v, t in zip(top.values[r], top.indices[r])],
                      "bottom": [[_piece(tokenizer, int(t)), round(float(v), 4)]
                                 for v, t in zip(bottom.values[r], bottom.indices[r])]}
    return out


@torch.no_grad()
def browse_ids(path: str | Path, model, tokenizer) -> np.ndarray:
    """The ids the feature browser reads: a prepared folder's val split, or the whole of a text file
    (data_ids holds its last tenth out for training; browsing need not)."""
    train_ids, eval_ids = data_ids(path, model, tokenizer)
    return eval_ids if Path(path).is_dir() else np.concatenate([train_ids, eval_ids])


def feature_report(model, sae: TopKSAE, site: Site, ids: np.ndarray, tokenizer=None, *, n_tokens: int = 32768,
                   context: int = 128, top: int = 8, window: int = 8, features: list[int] | None = None,
                   max_features: int = 256) -> dict:
    """The browser's data: for each feature its top-activating contexts in the first n_tokens of `ids`
    (read in consecutive windows of `context` tokens, as the model reads them), each context's tokens
    with the feature's activation on every one, how often it fires, and its logit effects.
    features: these features only; else the max_features that fire most often (then by id)."""
    dev = next(model.parameters()).device
    sae = sae.to(dev)
    n = min(n_tokens, len(ids)) // context * context
    if n == 0:
        raise UserError(f"the data holds {len(ids)} tokens, fewer than one --context window of {context}")
    ids = np.asarray(ids[:n], dtype=np.int64)
    wins = torch.from_numpy(ids.reshape(-1, context))
    vals, idxs = [], []
    per = max(1, 8192 // context)
    for b in range(0, len(wins), per):
        x = site_activations(model, site.probe, wins[b:b + per])
        v, i = sae.encode_topk(x.reshape(-1, sae.d_in))
        vals.append(v.cpu())
        idxs.append(i.cpu())
    V, I = torch.cat(vals), torch.cat(idxs)  # (n, k) each: every token's chosen features
    on = V > 0
    count = torch.bincount(I[on], minlength=sae.d_sae)
    if features is None:
        fired = torch.nonzero(count).flatten().tolist()
        fired.sort(key=lambda f: (-int(count[f]), f))
        chosen = sorted(fired[:max_features])
    else:
        bad = [f for f in features if not 0 <= f < sae.d_sae]
        if bad:
            raise UserError(f"feature {bad[0]} is not one of this SAE's 0..{sae.d_sae - 1}")
        chosen = list(features)
    pos, feat = torch.nonzero(on, as_tuple=True)
    acts, fid = V[pos, feat], I[pos, feat]
    report = []
    effects = logit_effects(model, sae, chosen, tokenizer=tokenizer) or {}
    for f in chosen:
        sel = fid == f
        p_f, a_f = pos[sel], acts[sel]
        best = a_f.topk(min(top, len(a_f)))
        ctxs = []
        for a, p in zip(best.values.tolist(), p_f[best.indices].tolist()):
            w0 = p // context * context  # the window the model read this token in
            lo, hi = max(w0, p - window), min(w0 + context, p + window + 1)
            row_acts = [float((V[q] * (I[q] == f)).sum()) for q in range(lo, hi)]
            ctxs.append({"act": round(a, 5), "at": p - lo, "position": p,
                         "tokens": [_piece(tokenizer, int(t)) for t in ids[lo:hi]],
                         "acts": [round(x, 5) for x in row_acts]})
        entry = {"id": f, "frequency": float(count[f]) / n, "max": round(float(a_f.max()), 5) if len(a_f) else 0.0,
                 "contexts": ctxs}
        if f in effects:
            entry["logits"] = effects[f]
        report.append(entry)
    return {"site": site.name, "probe": site.probe, "d_in": sae.d_in, "d_sae": sae.d_sae, "k": sae.k, "tokens": n,
            "context": context, "dead_features": int((count == 0).sum()), "features": report}


# ----------------------------------------------------------------------------- ablating and steering


def parse_steer(spec: str) -> tuple[int, float]:
    """'F:SCALE' -> (F, SCALE).

    >>> parse_steer("12:-4.5")
    (12, -4.5)
    """
    m = re.fullmatch(r"(\d+):([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", spec.strip())
    if not m:
        raise UserError(f"--sae-steer {spec!r}: give FEATURE:SCALE, e.g. 12:8 or 12:-4.5")
    return int(m[1]), float(m[2])


class FeatureEdit:
    """Ablate or steer SAE features at their site while the model runs, as forward hooks on the model's own
    modules (the block's input for resid_pre, its output for resid_post, attention's or the feed-forward's
    output for attn_out / mlp_out), so the one forward stays one, with the KV cache and in batches.

    ablate: each feature's own contribution act·W_dec[f] is taken out of the activation; the rest, the
    SAE's reconstruction error included, stays (so ablating nothing changes nothing). steer (f, scale):
    scale·W_dec[f] is added at every position, prompt and new tokens alike."""

    def __init__(self, model, sae: TopKSAE, site: Site, ablate=(), steer=()):
        bad = [f for f in [*ablate, *(f for f, _ in steer)] if not 0 <= f < sae.d_sae]
        if bad:
            raise UserError(f"feature {bad[0]} is not one of this SAE's 0..{sae.d_sae - 1}")
        if site.kind not in ("resid_pre", "resid_post", "attn_out", "mlp_out"):
            raise UserError(f"{site.name}: ablating or steering needs an SAE on blocks.L.hook_resid_pre, "
                            f"hook_resid_post, hook_attn_out or hook_mlp_out (a module's input or output)")
        self.sae, self.ablate = sae, torch.tensor(sorted(set(ablate)), dtype=torch.long)
        add = torch.zeros(sae.d_in)
        for f, scale in steer:
            add += scale * sae.W_dec[f].detach().float().cpu()
        self.add = add if steer else None
        block = model.blocks[site.layer]
        if site.kind == "resid_pre":
            self._handle = block.register_forward_pre_hook(lambda m, args: (self.edit(args[0]),) + tuple(args[1:]))
        else:
            mod = {"resid_post": block, "attn_out": block.attn, "mlp_out": block.ffn}[site.kind]
            self._handle = mod.register_forward_hook(lambda m, args, out: self.edit(out))

    @torch.no_grad()
    def edit(self, x: torch.Tensor) -> torch.Tensor:
        sae = self.sae
        if self.ablate.device != x.device:  # moved once, on the first forward on that device
            sae.to(x.device)
            self.ablate = self.ablate.to(x.device)
            self.add = None if self.add is None else self.add.to(x.device)
        out = x.float()
        if len(self.ablate):
            v, i = sae.encode_topk(out)  # (..., k)
            hit = (i.unsqueeze(-1) == self.ablate).any(-1)  # (..., k): a chosen feature being ablated
            out = out - weighted_rows(v * hit, i, sae.W_dec)  # their contributions taken out
        if self.add is not None:
            out = out + self.add
        return out.to(x.dtype)

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
