"""The harness's generate_until on a generation Session: requests with the same generation
settings in batches, each row's text through a TextStream that holds back the stop strings and
ends the row when one appears (the project's stop-string rule, the one `generate` and `serve` use)."""

from __future__ import annotations

from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from ..errors import UserError
from ..generation.session import Session
from ..generation.streaming import TextStream

MAX_GEN_TOKS = 256  # the harness's default when a task names no max_gen_toks
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


def sampling_settings(kwargs: dict) -> dict:
    """Session.send's sampling arguments from the harness's normalized generation kwargs
    (do_sample false or temperature 0: greedy); settings we have no rule for are refused.

    >>> sampling_settings({"do_sample": False, "temperature": 0.0})
    {'greedy': True}
    """
    extra = sorted(set(kwargs) - set(SAMPLING_KEYS) - {"do_sample"})
    if extra:
        raise UserError(f"generation settings glassformer does not have: {', '.join(extra)} "
                        f"(it takes do_sample, {', '.join(SAMPLING_KEYS)}, until, max_gen_toks)")
    if not kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0)) == 0.0:
        return {"greedy": True}
    return {k: kwargs[k] for k in SAMPLING_KEYS if kwargs.get(k) is not None}


def _settings(lm, gen_kwargs: dict):
    """(stop strings, max new tokens, sampling settings, the context tokens kept) of one request kind."""
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS))
    until = handle_stop_sequences(kwargs.pop("until", None), eos=lm.tok_decode(lm.eot_token_id))
    n_new = kwargs.pop("max_gen_toks")
    kwargs.pop("max_length", None)
    keep = lm.max_length - n_new  # the harness keeps the context's last max_length - max_gen_toks tokens
    if keep < 1:
        raise UserError(f"max_gen_toks {n_new} leaves no room for a prompt in the model's context of "
                        f"{lm.max_length}: ask for fewer new tokens")
    return until, n_new, sampling_settings(kwargs), keep


def generate_rows(lm, prompts: list[list[int]], until: list[str], n_new: int, sampling: dict) -> list[str]:
    """Each prompt's continuation up to (not including) the first stop string or stop token."""
    session = Session(lm.model, len(prompts), max_len=lm.max_length)
    streams = [TextStream(lm.tokenizer, until) for _ in prompts]
    texts = [""] * len(prompts)
    stop_ids = set(lm.tokenizer.eos_ids) | {lm.eot_token_id}
    for step in session.send(prompts, max_new_tokens=n_new, stop=sorted(stop_ids), **sampling):
        for b, tok in enumerate(step):
            if tok is None or streams[b].done or tok in stop_ids:  # a stop token ends the row, unprinted
                continue
            texts[b] += streams[b].push(tok)
            if streams[b].done:  # a stop string came: this row is finished
                session.finish(b)
    return [t + s.flush() for t, s in zip(texts, streams)]


def generate_until(lm, requests: list[tuple[str, dict]], disable_tqdm: bool = False) -> list[str]:
    """requests: (context, generation kwargs) pairs; the continuation text of each, in order."""
    out: list[str | None] = [None] * len(requests)
    kinds: dict[str, list[int]] = {}
    for i, (_, kw) in enumerate(requests):
        kinds.setdefault(repr(sorted(kw.items())), []).append(i)
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="glassformer generate_until")
    for members in kinds.values():
        until, n_new, sampling, keep = _settings(lm, requests[members[0]][1])
        ids = {i: lm.tok_encode(requests[i][0])[-keep:] or [lm.prefix_token_id] for i in members}
        members = sorted(members, key=lambda i: -len(ids[i]))  # similar lengths together
        for lo in range(0, len(members), lm.batch_size):
            batch = members[lo:lo + lm.batch_size]
            for i, text in zip(batch, generate_rows(lm, [ids[i] for i in batch], until, n_new, sampling)):
                out[i] = text
            bar.update(len(batch))
    bar.close()
    return out
