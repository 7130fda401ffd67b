"""Generation with a KV cache: prefill and decode_step (one forward each), Session, generate.

Small free functions (gpt-fast's layout); a `Session` owns one preallocated cache and the tokens in
it, so a conversation goes on without recomputing them; `generate` is a session used once. Why a
right-padded batch gives what each prompt gives alone: docs/generation.md#the-cache-batches-and-sessions.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import torch

from ..probes import active as probes_active
from ..errors import UserError
from ..kv_cache import KVCache
from ..speed import install as install_speed
from .compiled import compile_step, step_key
from .sampling import apply_repetition_penalty, check_drawn, check_sampling, draw, logits_to_probs, sample

__all__ = ["check_sampling", "apply_repetition_penalty", "logits_to_probs", "sample", "prefill", "decode_step",
           "Session", "cache_length", "generate"]

POLICIES = ("error", "slide")

# ----------------------------------------------------------------------------- forward passes


def prefill(model, ids: torch.Tensor, cache: KVCache, pos=0, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Run ids (B, T) in one forward, writing their keys and values into the cache from `pos`.

    Returns the logits (B, V) of each row's last real token: index T-1, or lengths[b]-1
    for right-padded rows.
    """
    B, T = ids.shape
    last = torch.full((B,), T - 1, device=ids.device) if lengths is None else lengths.to(ids.device) - 1  # (B,)
    logits, _ = model(ids, cache=cache, pos=pos, logits_at=last)  # (B, 1, V): the head on those positions only
    return logits[:, 0]  # (B, V)


def decode_step(model, tok: torch.Tensor, cache: KVCache, pos) -> torch.Tensor:
    """One token per row, tok (B, 1) at position pos (int, or (B,) per row): logits (B, V)."""
    logits, _ = model(tok, cache=cache, pos=pos)  # (B, 1, V)
    return logits[:, -1]


# ----------------------------------------------------------------------------- sessions


def _as_rows(ids) -> tuple[list[list[int]], bool]:
    """(rows of ids, single): a 1-D tensor or flat list is one prompt, else a batch."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() not in (1, 2):
            raise UserError(f"ids must be 1-D (one prompt) or 2-D (a batch), got shape {tuple(ids.shape)}")
        return (ids.tolist(), False) if ids.dim() == 2 else ([ids.tolist()], True)
    ids = list(ids)
    if ids and all(isinstance(x, (list, tuple, torch.Tensor)) for x in ids):
        return [list(x.tolist() if isinstance(x, torch.Tensor) else x) for x in ids], False
    return [ids], True


def _ends_with_stop(made: list[int], stops) -> bool:
    """Whether the tokens made so far end with one of the stop sequences."""
    return any(len(made) >= len(s) and tuple(made[-len(s):]) == s for s in stops)


def _stops(stop) -> list[tuple[int, ...]]:
    """stop as a list of id sequences: None, an id, or a collection of ids and/or id sequences."""
    if stop is None:
        return []
    if isinstance(stop, int):
        return [(stop,)]
    return [tuple(s) if isinstance(s, (list, tuple)) else (int(s),) for s in stop]


class Session:
    """A KV cache and the tokens it holds, for `batch_size` rows: each `send` continues every row's
    text from where the last one stopped, feeding only the tokens not yet cached (each row's last
    token stays pending: the next forward needs its logits). context_policy 'error' refuses a text
    that outgrows the cache, 'slide' cuts it to its latest `slide_keep` tokens and re-prefills:
    docs/generation.md#context-policies."""

    def __init__(self, model, batch_size: int = 1, *, max_len: int | None = None,
                 context_policy: str = "error", slide_keep: int | None = None, speed: bool = True,
                 compile: bool = False, run_ahead: bool | None = None):
        if context_policy not in POLICIES:
            raise UserError(f"context policy must be one of {', '.join(POLICIES)}, got {context_policy!r}")
        S = model.config.max_seq_len
        self.max_len = S if max_len is None else int(max_len)
        if not 1 <= self.max_len <= S:
            raise UserError(f"the cache length must be in 1..{S} (the model's context), got {self.max_len}")
        self.keep = max(1, self.max_len // 2) if slide_keep is None else int(slide_keep)
        if not 1 <= self.keep <= self.max_len:
            raise UserError(f"slide_keep must be in 1..{self.max_len}, got {self.keep}")
        self.model, self.B, self.policy = model, batch_size, context_policy
        self.cache = KVCache.for_model(model, batch_size, self.max_len)
        self.device = next(model.parameters()).device
        self.texts: list[list[int]] = [[] for _ in range(batch_size)]
        self.starts = [0] * batch_size  # where each row's window begins in its text
        self.cached = [0] * batch_size  # how many tokens of each window are in the cache
        self.active = [True] * batch_size  # False once a row has stopped (within a send)
        self.seen: torch.Tensor | None = None  # (B, V) bool, built when a penalty asks for it
        self.generator: torch.Generator | None = None
        # One row on a GPU: queue each decode step before reading the token of the one before (_run_ahead).
        self.run_ahead = batch_size == 1 and self.device.type == "cuda" if run_ahead is None else bool(run_ahead)
        # Speed from outside the model (glassformer.speed): re-classed modules, the same objects and hooks;
        # what it changes is a compiled step's one-row products
        if speed:
            install_speed(model)
        self._compiled, self._step_key = None, None
        self.recompiles = 0  # how many times the compiled step was traced anew (hooks, kernels, threads changed)
        if compile:  # the decode step only: one token per row, the shape that repeats
            self._compiled = compile_step(self.device)
            for layer in self.cache.layers:  # written in place every step at fixed addresses: CUDA graphs may keep them
                torch._dynamo.mark_static_address(layer.k)
                torch._dynamo.mark_static_address(layer.v)
        self.slides = 0  # how many times a window was cut (for reports and tests)
        self.prefilled_tokens = 0  # every token fed from a prompt or a re-prefill, not a decode step's own
        self._fresh = False  # the next forward is a send's first: what it feeds is prompt, even one token

    # ---- bookkeeping on the host -------------------------------------------------------
    def _append(self, b: int, ids: Sequence[int]) -> None:
        self.texts[b].extend(ids)
        if self.seen is not None and ids:
            self.seen[b, torch.tensor(list(ids), device=self.device)] = True

    def _window(self, b: int) -> int:
        return len(self.texts[b]) - self.starts[b]

    def reset(self) -> None:
        """Forget every row's text: the next send starts new texts in the same cache (and, with
        compile, the same compiled step). Stale cache slots are rewritten before any query reads them."""
        self.texts = [[] for _ in range(self.B)]
        self.starts, self.cached = [0] * self.B, [0] * self.B
        self.seen = None

    def replace(self, ids: Sequence[int], b: int = 0) -> int:
        """Make row b's text `ids`, keeping the cached keys of its longest common prefix with the
        text cached now; the next send feeds only the rest. Returns how many cached tokens were kept
        (0 after a slide: the cache then holds a window, not the text's start)."""
        ids = [int(t) for t in ids]
        old, keep = self.texts[b], 0
        if self.starts[b] == 0:
            limit = min(self.cached[b], len(ids) - 1)  # the new text's last token stays pending
            while keep < limit and old[keep] == ids[keep]:
                keep += 1
        self.texts[b], self.starts[b], self.cached[b] = ids, 0, keep
        self.seen = None  # rebuilt from the new texts when a penalty asks for it
        return keep

    def finish(self, b: int) -> None:
        """Stop row b for the rest of this send (a caller's stop rule, e.g. a stop string)."""
        self.active[b] = False

    def _model(self, decode: bool = False):
        """The forward to run: the model itself, or for a decode step its compiled step. The model
        itself while probes listen or it trains (dropout): the compiled step was traced for neither."""
        if not decode or self._compiled is None or self.model.training or probes_active():
            return self.model
        key = step_key(self.model)  # checked before every step: the compiled code holds no guard on the model
        if self._step_key not in (None, key):  # a hook, a kernel, the weights' dtype or the threads changed
            self._compiled = compile_step(self.device)
            self.recompiles += 1
        self._step_key = key
        return functools.partial(self._compiled, self.model)

    def _positions_as_tensor(self) -> bool:
        """Whether compiled decode steps get their positions as a tensor (see _forward)."""
        return self._compiled is not None and self.device.type == "cuda"

    # ---- one forward over whatever is pending --------------------------------------------
    def _forward(self) -> torch.Tensor:
        """Feed every row's uncached tokens; logits (B, V) of each row's last token."""
        if any(self._window(b) > self.max_len for b in range(self.B)):
            assert self.policy == "slide"  # 'error' refused the send up front
            for b in range(self.B):
                if self._window(b) > self.max_len:
                    self.starts[b] = len(self.texts[b]) - self.keep
            self.cached = [0] * self.B  # one shared cache: re-prefill every row
            self.slides += 1
        pending = [self.texts[b][self.starts[b] + self.cached[b]:] for b in range(self.B)]
        n = [len(p) for p in pending]
        assert min(n) >= 1, "every row has its last token pending"
        T = max(n)
        if len(set(self.cached)) > 1 and max(self.cached) + T > self.max_len:
            self.cached = [0] * self.B  # ragged rows would overrun the cache: re-prefill them together
            return self._forward()
        ids = torch.tensor([p + [0] * (T - len(p)) for p in pending], device=self.device)  # (B, T) right-padded
        # A compiled decode step on a GPU gets its positions as a tensor: it then reads the whole cache,
        # masked, so every position has one shape (one CUDA graph, captured once); else an int while rows
        # agree (on the CPU a compiled step reads the filled slots only, the length a dynamic size).
        fixed = T == 1 and self._positions_as_tensor()
        pos = torch.tensor(self.cached, device=self.device) if fixed or len(set(self.cached)) > 1 else self.cached[0]
        lengths = None if len(set(n)) == 1 else torch.tensor(n, device=self.device)
        if T > 1 or self._fresh:
            self.prefilled_tokens += sum(n)
        self._fresh = False
        fwd = self._model(decode=T == 1)
        logits = prefill(fwd, ids, self.cache, pos, lengths) if T > 1 else decode_step(fwd, ids, self.cache, pos)
        # A stopped row re-feeds its last token at the same slot (same keys and values) and
        # stays put, so the batch keeps one shape and the row's cache stays exact.
        self.cached = [c + (k if a else k - 1) for c, k, a in zip(self.cached, n, self.active)]
        return logits

    # ---- the public step -------------------------------------------------------------------
    def send(self, ids=None, *, max_new_tokens: int, temperature=1.0, top_k=None, top_p=None, min_p=None,
             repetition_penalty=1.0, greedy=False, seed=None, stop=None) -> Iterator:
        """Append ids (one prompt, or one per row) to the text and generate up to max_new_tokens.

        Yields a token id per step for a 1-row session, else a list with one id per row
        (None for rows that have stopped). A row stops after yielding a stop sequence (an
        id, or a sequence of ids, from `stop`). Checks run now, generation when iterated.
        """
        check_sampling(temperature, top_k, top_p, min_p, repetition_penalty)
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
        rows, single = _as_rows([] if ids is None else ids)
        if single and self.B > 1:
            rows = rows * self.B  # one prompt for every row (several samples of it)
        if len(rows) != self.B:
            raise UserError(f"this session has {self.B} rows; got {len(rows)} prompts")
        V = self.model.config.vocab_size
        for b, r in enumerate(rows):
            if not r and not self.texts[b]:
                raise UserError("the prompt is empty: give at least one token")
            bad = [t for t in r if not (isinstance(t, int) and 0 <= t < V)]
            if bad:
                raise UserError(f"token id {bad[0]!r} is outside the vocabulary 0..{V - 1}")
            if self.policy == "error" and self._window(b) + len(r) + max_new_tokens > self.max_len:
                raise UserError(
                    f"prompt ({self._window(b) + len(r)} tokens) + {max_new_tokens} new tokens exceed the context of "
                    f"{self.max_len} tokens: shorten the prompt, ask for fewer tokens, or use --context-policy slide"
                )
        for b, r in enumerate(rows):
            self._append(b, r)
        self._fresh = True
        if seed is not None:
            self.generator = torch.Generator(self.device).manual_seed(int(seed))
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy)
        return self._run(int(max_new_tokens), sampling, float(repetition_penalty), _stops(stop), single and self.B == 1)

    def _run(self, max_new_tokens, sampling, penalty, stops, single) -> Iterator:
        self.active = [True] * self.B
        if penalty != 1.0 and self.seen is None:
            V = self.model.config.vocab_size
            self.seen = torch.zeros(self.B, V, dtype=torch.bool, device=self.device)
            for b, t in enumerate(self.texts):
                self.seen[b, torch.tensor(t, dtype=torch.long, device=self.device)] = True
        if self.run_ahead and self.B == 1:
            yield from self._run_ahead(max_new_tokens, sampling, penalty, stops, single)
            return
        made = [[] for _ in range(self.B)]
        for _ in range(max_new_tokens):
            with torch.inference_mode():
                toks = self._pick(self._forward(), penalty, sampling).tolist()
            check_drawn([t for t, a in zip(toks, self.active) if a])  # NaN or infinite logits: an error, not a token
            out = []
            for b, t in enumerate(toks):
                if not self.active[b]:
                    out.append(None)
                    continue
                self._append(b, [t])
                made[b].append(t)
                out.append(t)
                if _ends_with_stop(made[b], stops):
                    self.active[b] = False
            yield out[0] if single else out
            if not any(self.active):
                return

    def _pick(self, logits: torch.Tensor, penalty: float, sampling: dict) -> torch.Tensor:
        """The next token of each row (B,), on the device, from the logits (B, V); -1 for a row whose logits
        are not finite (`draw`: no wait for the device here; check_drawn where the tokens are read)."""
        if penalty != 1.0:
            logits = apply_repetition_penalty(logits, self.seen, penalty)
        return draw(logits, generator=self.generator, **sampling)

    def _run_ahead(self, n: int, sampling: dict, penalty: float, stops, single: bool) -> Iterator:
        """_run for one row, each decode step queued before the host reads the token of the step before
        (which stays on the device as the next step's input), so on a GPU the host's work for token t
        runs while the GPU computes step t+1. The same tokens and random draws as _run; a step queued
        past a stop is dropped (its slot uncached again, its random draw spent); slides and a full
        cache fall back to _forward. docs/generation.md#compiled-steps (runs ahead)."""
        if n == 0:
            return
        fixed = self._positions_as_tensor()
        made, pos = [], None
        try:
            with torch.inference_mode():
                tok = self._pick(self._forward(), penalty, sampling)  # (1,): token t, not yet in the text
            for i in range(n):
                read = _to_host_later(tok)
                queued = i + 1 < n and self.cached[0] < self.max_len  # token t fits the cache: queue its step
                if queued:
                    with torch.inference_mode():
                        tok = tok.clamp(min=0)  # a -1 (not finite, refused when read) must not index the embedding
                        if penalty != 1.0:
                            self.seen[0, tok] = True  # on the device: the host has not seen t yet
                        if fixed:  # kept on the device and stepped there: a host copy would wait for the GPU
                            pos = torch.tensor([self.cached[0]], device=self.device) if pos is None else pos + 1
                        logits = decode_step(self._model(decode=True), tok.view(1, 1), self.cache,
                                             pos if fixed else self.cached[0])  # (1, V)
                        self.cached[0] += 1
                        nxt = self._pick(logits, penalty, sampling)
                t = read()[0]  # waits for token t only; step t+1 is already queued behind it
                check_drawn([t])
                self._append(0, [t])
                made.append(t)
                yield t if single else [t]
                if _ends_with_stop(made, stops) or not self.active[0]:
                    self.active[0] = False
                    return
                if i + 1 < n:
                    if not queued:  # a slide or a full cache: the ordinary forward
                        pos = None
                        with torch.inference_mode():
                            nxt = self._pick(self._forward(), penalty, sampling)
                    tok = nxt
        finally:  # the last token stays pending, as _forward expects (a queued step cached it already)
            self.cached[0] = min(self.cached[0], self._window(0) - 1)


def _to_host_later(tok: torch.Tensor):
    """Start copying tok to the host; return a function that waits for the copy and gives the
    list. On a GPU the copy and its wait stay behind the work queued before them only."""
    if tok.device.type != "cuda":
        return tok.tolist
    host = tok.to("cpu", non_blocking=True)  # into pinned memory, asynchronously
    done = torch.cuda.Event()
    done.record()
    return lambda: (done.synchronize(), host.tolist())[1]


def cache_length(model, rows: Sequence[Sequence[int]], max_new_tokens: int, context_policy: str = "error") -> int:
    """The cache a call needs, sized once: its longest prompt plus the new tokens (within the
    model's context), or the whole context for the slide policy. A compiled step on a GPU
    reads the whole cache every step, so a larger one than this costs every step."""
    S = model.config.max_seq_len
    need = max(len(r) for r in rows) + int(max(max_new_tokens, 0))
    return S if context_policy == "slide" else min(S, max(need, 1))


def generate(model, ids, *, max_new_tokens: int, temperature=1.0, top_k=None, top_p=None, min_p=None,
             repetition_penalty=1.0, greedy=False, seed=None, stop=None, context_policy: str = "error",
             slide_keep: int | None = None) -> Iterator:
    """Generate from one prompt (a list of ids or a 1-D tensor: yields one id per step) or a
    batch (a list of id lists of any lengths, or a 2-D tensor: yields a list per step, None
    for rows that have stopped). greedy=True or temperature=0 takes the argmax; `seed` fixes
    the random draws; `stop` is an id or a collection of ids / id sequences (the stop
    tokens are yielded, then that row ends). See `Session` for the context policies.
    """
    rows, _ = _as_rows(ids)
    max_len = cache_length(model, rows, max_new_tokens, context_policy)
    session = Session(model, len(rows), max_len=max_len, context_policy=context_policy, slide_keep=slide_keep)
    return session.send(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, repetition_penalty=repetition_penalty, greedy=greedy, seed=seed, stop=stop)
