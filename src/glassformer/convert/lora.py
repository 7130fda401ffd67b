"""LoRA adapters (Hu et al., 2021): a frozen product x·Wᵀ plus a trainable low-rank one,
(α/r)·x·Aᵀ·Bᵀ with A (r, in) and B (out, r). B starts at zero, so an adapted model begins as
its base exactly. An adapted product is a module that wraps the one it replaces at the model's
weight-product seam (an nn.Linear, or an int8 one), from outside model.py; merging folds
(α/r)·B·A into W and puts the plain module back. docs/lora.md.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")  # the rest live in the feed-forward
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


@dataclass(frozen=True)
class LoraConfig:
    """Rank r, α (the adapter's product is scaled by α/r), dropout on the adapter's input while
    training, and which block products get one."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise UserError(f"LoRA rank r must be a whole number of at least 1, got {self.r}: pass --lora-r 8 (say)")
        if not 0 < self.alpha < math.inf:
            raise UserError(f"LoRA alpha must be a finite number above 0, got {self.alpha}: pass --lora-alpha 16 (say)")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise UserError(f"LoRA targets {list(self.targets)}: each must be one of {', '.join(LORA_TARGETS)}, "
                            f"given once" + (f" ({', '.join(unknown)} is not)" if unknown else ""))

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraConfig":
        """From to_dict's keys (other keys, such as "base", are ignored); validated."""
        targets = d.get("targets", LORA_TARGETS)
        if isinstance(targets, str):
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        r = d.get("r", cls.r)
        return cls(r=int(r) if isinstance(r, (int, float)) and float(r).is_integer() else r,
                   alpha=float(d.get("alpha", cls.alpha)), dropout=float(d.get("dropout", cls.dropout)),
                   targets=tuple(targets))


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """The adapter's term scale·x·Aᵀ·Bᵀ: x (..., in), A (r, in), B (out, r) -> (..., out).

    >>> x, A, B = torch.ones(1, 2), torch.ones(1, 2), torch.full((3, 1), 0.5)
    >>> lora_delta(x, A, B, 2.0).tolist()
    [[2.0, 2.0, 2.0]]
    """
    return F.linear(F.linear(x, A), B) * scale  # (..., r) -> (..., out)


def merged_weight(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B·A, (out, in), computed in fp32 and returned in W's dtype.

    >>> merged_weight(torch.zeros(3, 2), torch.ones(1, 2), torch.full((3, 1), 0.5), 2.0).tolist()
    [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    return (w.float() + scale * (B.float() @ A.float())).to(w.dtype)  # (out, r) @ (r, in) -> (out, in)


class LoRALinear(nn.Module):
    """`base` (frozen) plus the adapter: forward(x) = base(x) + (α/r)·dropout(x)·Aᵀ·Bᵀ.

    A (r, in) is drawn as nn.Linear draws its weights (Kaiming-uniform, as PEFT does), B (out, r)
    is zero. The dropout is a plain probability rather than an nn.Dropout module, so a training
    run's model-wide dropout setting leaves it alone."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.dropout = r, alpha, dropout
        self.scale = alpha / r
        w = base.weight
        dtype = w.dtype if w.dtype.is_floating_point else torch.float32  # an int8 base's adapter is fp32
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=w.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=w.device, dtype=dtype))
        if w.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (..., out)
        xd = F.dropout(x, self.dropout, self.training) if self.dropout > 0 and self.training else x
        return y + lora_delta(xd.to(self.lora_A.dtype), self.lora_A, self.lora_B, self.scale).to(y.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha:g}, dropout={self.dropout:g}"


def _parents(block: nn.Module, target: str) -> list[nn.Module]:
    """The modules holding `target` in a block: its attention, its feed-forward, or, where the
    feed-forward is a mixture of experts, every expert (and the shared one)."""
    if target in ATTENTION_TARGETS:
        return [block.attn]
    experts = getattr(block.ffn, "experts", None)
    if experts is None:
        return [block.ffn]
    return list(experts) + ([block.ffn.shared] if block.ffn.shared is not None else [])


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Each LoRALinear of the model by its path ("blocks.0.attn.wq")."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap each block's targeted products in a LoRALinear, in place, and freeze everything else:
    only the A and B matrices train. Records the config as model.lora_config. A target the model
    lacks (w_gate without SwiGLU) or a model already adapted is refused."""
    if lora_modules(model):
        raise UserError("this model already has LoRA adapters: merge them first (convert --merge-lora)")
    for target in cfg.targets:
        if any(getattr(m, target, None) is None for b in model.blocks for m in _parents(b, target)):
            raise UserError(f"LoRA target {target} does not exist in this model (its feed-forward is "
                            f"{model.config.ffn}); choose from those it has")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        for target in cfg.targets:
            for parent in _parents(block, target):
                setattr(parent, target, LoRALinear(getattr(parent, target), cfg.r, cfg.alpha, cfg.dropout))
    model.lora_config = cfg
    return model


def adapter_shapes(model: nn.Module, cfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """The shapes apply_lora(model, cfg) would give the adapters, adapter_state's keys, worked out
    from the model's products without allocating: what a file is checked against first (a rank of
    300,000 in a config would otherwise allocate gigabytes before its tensors were compared)."""
    out, path = {}, {m: name for name, m in model.named_modules()}
    for block in model.blocks:
        for target in cfg.targets:
            for parent in _parents(block, target):
                product = getattr(parent, target, None)
                if product is None:  # apply_lora names it
                    continue
                name = f"{path[parent]}.{target}"
                out[name + ".lora_A"] = (cfg.r, product.in_features)
                out[name + ".lora_B"] = (product.out_features, cfg.r)
    return out


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{"blocks.{i}.attn.wq.lora_A": (r, in), "....lora_B": (out, r), ...}, detached and contiguous."""
    out = {}
    for name, m in lora_modules(model).items():
        out[name + ".lora_A"] = m.lora_A.detach().contiguous()
        out[name + ".lora_B"] = m.lora_B.detach().contiguous()
    return out


def adapter_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a whole adapted model's state dict."""
    return {k: v for k, v in state.items() if k.endswith(ADAPTER_SUFFIXES)}


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], where: str = "the adapter") -> None:
    """Copy an adapter_state-keyed dict into the model's adapters: exactly their keys and shapes."""
    want = adapter_state(model)
    missing, unexpected = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing or unexpected:
        raise UserError(f"{where} does not match the model's adapters: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [f"{k} is {list(state[k].shape)}, expected {list(want[k].shape)}" for k in sorted(want)
             if state[k].shape != want[k].shape]
    if wrong:
        raise UserError(f"{where} does not match the model's adapters: {'; '.join(wrong[:3])}")
    for name, m in lora_modules(model).items():
        m.lora_A.copy_(state[name + ".lora_A"])
        m.lora_B.copy_(state[name + ".lora_B"])


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base, W + (α/r)·B·A, and put the base module back, in place: a
    plain model (every weight trainable again). An int8 base is refused (its weight cannot hold
    the sum without re-quantizing it)."""
    mods = lora_modules(model)
    if any(not m.base.weight.dtype.is_floating_point for m in mods.values()):
        raise UserError("cannot merge LoRA adapters onto a quantized (int8) base: merge onto the float base, "
                        "then quantize the merged checkpoint (convert --quantize int8)")
    for name, m in mods.items():
        m.base.weight.copy_(merged_weight(m.base.weight, m.lora_A, m.lora_B, m.scale))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, m.base)
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def base_state(model_or_state) -> dict[str, torch.Tensor]:
    """The base model's tensors by their plain names: adapters dropped, "….base.weight" back to
    "….weight", a tied head (the embedding's own tensor) dropped, as a checkpoint stores them."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    out = {k.replace(".base.", "."): v for k, v in state.items() if not k.endswith(ADAPTER_SUFFIXES)}
    head, emb = out.get("lm_head.weight"), out.get("embed.weight")
    if head is not None and emb is not None and head.data_ptr() == emb.data_ptr():
        del out["lm_head.weight"]
    return out


def base_sha256(model_or_state) -> str:
    """sha256 over the base's tensors as fp32, concatenated in sorted key order (base_state's keys):
    the same for a base stored in bf16 or fp32 when its values are; any changed weight changes it."""
    h = hashlib.sha256()
    state = base_state(model_or_state)
    for k in sorted(state):
        t = state[k].detach().to("cpu", torch.float32).contiguous()
        h.update(t.numpy().reshape(-1).view("uint8"))
    return h.hexdigest()


def count_adapter_weights(model: nn.Module) -> int:
    """The adapters' weights: r·(in + out) per adapted product."""
    return sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model).values())
