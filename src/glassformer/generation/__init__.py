"""Generation: sampling rules, a session over one KV cache, and `generate`.

    sampling.py   logits -> probabilities -> a token (temperature, top-k, top-p, min-p, penalty)
    sampling_stages.py  what each of those stages keeps at one position (the explorer's sampling view)
    session.py    prefill, decode_step, Session (a cache and the tokens in it), generate
    compiled.py   how a session compiles its decode step (torch.compile options and guards)
    batching.py   continuous batching: an Engine serving many requests over one cache, one forward a step
    logprobs.py   log-probabilities of the raw distribution (new tokens, prompts)
"""

from .sampling import apply_repetition_penalty, check_sampling, logits_to_probs, sample
from .session import Session, cache_length, decode_step, generate, prefill

__all__ = ["check_sampling", "apply_repetition_penalty", "logits_to_probs", "sample", "prefill", "decode_step",
           "Session", "cache_length", "generate"]
