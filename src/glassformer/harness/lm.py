"""`GlassformerLM`: a glassformer model as a model of the lm-evaluation-harness (`lm_eval`).

It subclasses the harness's TemplateLM, so a request's context and continuation are split into
tokens exactly as the harness's own models split them; the model runs through its own modules
(docs/eval.md). Registered under the name `glassformer` when this module is imported, and named
by the package's `lm_eval.models` entry point for harness versions that read it.
"""

from __future__ import annotations

import warnings

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..errors import UserError
from .scoring import loglikelihoods
from .generating import generate_until

NAME = "glassformer"
DEFAULT_BATCH = 16  # what batch_size=auto means here: the harness's own search is for its hf model


def parse_batch_size(value) -> int:
    """batch_size as the harness passes it: an int, its text, or 'auto' / 'auto:N'.

    >>> parse_batch_size("8"), parse_batch_size("auto:4"), parse_batch_size(None)
    (8, 16, 16)
    """
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH
    try:
        n = int(value)
    except ValueError:
        raise UserError(f"batch_size must be a whole number or auto, got {value!r}") from None
    if n < 1:
        raise UserError(f"batch_size must be at least 1, got {n}")
    return n


def load_for_harness(checkpoint, device="auto", quantize=None, base=None, dtype="float32"):
    """(model, tokenizer) through checkpoint.loading.load, in eval mode, quantized if asked."""
    from ..checkpoint.loading import load
    from ..convert.hf import parse_dtype
    from ..convert.quantize import check_method, quantize as quantize_model
    from ..train.setup import resolve_device

    method = check_method(quantize)  # before any weights are read
    device = str(device or "auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        # The harness's command line passes --device cuda:0 unless told otherwise; its hf model
        # then runs where it can, and so does this one.
        warnings.warn(f"device {device} asked for but PyTorch sees no CUDA GPU: running on the CPU")
        device = "cpu"
    device = resolve_device(device)
    model, tokenizer = load(checkpoint, device=device, dtype=parse_dtype(dtype), base=base)
    if tokenizer is None:
        raise UserError(f"{checkpoint} has no tokenizer.json: the harness gives text, so the model needs its tokenizer")
    return quantize_model(model.eval(), method), tokenizer


class GlassformerLM(TemplateLM):
    """model_args: checkpoint=CKPT (a checkpoint, run or Hugging Face folder, a Hub name, an
    adapter run), batch_size=N, device=D, quantize=int8, base=CKPT (an adapter's moved base),
    dtype=float32|bfloat16|float16, prefix_token_id=ID. Or give model= and tokenizer= objects."""

    def __init__(self, checkpoint=None, batch_size=None, device="auto", quantize=None, base=None,
                 dtype="float32", prefix_token_id=None, max_batch_size=None, model=None, tokenizer=None, **unknown):
        super().__init__()
        if unknown:
            raise UserError(f"unknown model_args for glassformer: {', '.join(sorted(unknown))} "
                            "(it takes checkpoint, batch_size, device, quantize, base, dtype, prefix_token_id)")
        if model is None:
            if checkpoint is None:
                raise UserError("glassformer needs model_args checkpoint=CKPT")
            model, tokenizer = load_for_harness(checkpoint, device, quantize, base, dtype)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = parse_batch_size(batch_size)
        self._prefix = None if prefix_token_id is None else int(prefix_token_id)
        self._device = next(model.parameters()).device

    # ---- what TemplateLM asks of a model ------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """The end-of-text id (documents are joined with it), else the tokenizer's eos_token."""
        tok = self.tokenizer
        eos = tok.special_tokens.get("eos_token")
        found = tok.eot_id if tok.eot_id is not None else (tok.tk.token_to_id(eos) if eos else None)
        if found is None:
            raise UserError("the tokenizer has no end-of-text or eos token: give model_args prefix_token_id=ID")
        return found

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling text's first token are conditioned on: the
        end-of-text token, else BOS (prefix_token_id= in model_args wins)."""
        if self._prefix is not None:
            return self._prefix
        tok = self.tokenizer
        if tok.eot_id is None and tok.special_tokens.get("bos_token"):
            return tok.tk.token_to_id(tok.special_tokens["bos_token"])
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.config.max_seq_len

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the harness's hf model encodes: the tokenizer.json's own special tokens (its
        post-processor, e.g. a BOS) unless asked otherwise or the text already starts with BOS."""
        if add_special_tokens is None:
            bos = self.tokenizer.special_tokens.get("bos_token")
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer.tk.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode([ids] if isinstance(ids, int) else ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation) strings or None, context ids, continuation ids)."""
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="glassformer loglikelihood")

        def progress(done):
            for i, answer in done.items():
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            bar.update(len(done))

        out = loglikelihoods(self.model, [(c, k) for _, c, k in requests], self.batch_size, progress)
        bar.close()
        return out

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """(context, scored tokens) windows of a text: every token scored once, the first after
        the prefix token, each window of the model's context (the harness's own rule)."""
        return [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=1)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of every token's log-probability, per text; all texts' windows batched together."""
        texts = [req.args[0] for req in requests]
        windows = [(t, w) for t, text in enumerate(texts) for w in self.rolling_windows(text)]
        scores = self._loglikelihood_tokens([(None, c, k) for _, (c, k) in windows], disable_tqdm)
        totals = [0.0] * len(texts)
        for (t, _), (lp, _) in zip(windows, scores):
            totals[t] += lp
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = generate_until(self, [req.args for req in requests], disable_tqdm)
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The conversation in the tokenizer's chat template, as text (--apply_chat_template)."""
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    @property
    def tokenizer_name(self) -> str:
        return NAME

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}


def register() -> None:
    """Make `glassformer` a model name of the harness's registry (once; a placeholder the
    harness made from the entry point resolves to this same class)."""
    import lm_eval.models  # noqa: F401  (the harness's own names first: it fills an empty registry only)
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=GlassformerLM)


register()
