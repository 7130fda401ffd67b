"""One batch of text chunks -> its ids, with end-of-text after each document's last chunk; and the
loop an encoding process of `prepare --workers K` runs.

This file imports nothing of glassformer, so a worker can run it by path (`runpy.run_path`, see
text/encoding.py) without importing the package, whose `__init__` imports torch: a worker holds
numpy, tokenizers and the tokenizer alone.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def flat_ids(tk, texts: list[str], ends: list[bool], eot: np.ndarray) -> np.ndarray:
    """(n,) ids of the chunks `texts` one after another, `eot` (0 or 1 id, the output's dtype) after
    each chunk whose `ends` is true. tk: a tokenizers.Tokenizer; encode_batch_fast is its fastest batch
    encoder (no offsets)."""
    parts = []
    for enc, last in zip(tk.encode_batch_fast(texts, add_special_tokens=False), ends):
        parts.append(np.asarray(enc.ids, dtype=eot.dtype))
        if last:
            parts.append(eot)
    return np.concatenate(parts) if parts else eot[:0]


def serve(jobs, results, tokenizer_json: str, eot: np.ndarray) -> None:
    """Take (number, texts, ends) from `jobs` until None; put (number, ids) on `results` in the order
    taken, or (number, "error: ...") once and stop."""
    import signal

    # One encoding thread per process: K processes on K cores, not K thread pools fighting over them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    from tokenizers import Tokenizer

    number = -1
    try:
        tk = Tokenizer.from_str(tokenizer_json)
        results.put((-1, "torch" in sys.modules))  # ready; says whether torch came in (it must not: tests)
        while (job := jobs.get()) is not None:
            number, texts, ends = job
            results.put((number, flat_ids(tk, texts, ends, eot)))
    except Exception as e:  # the parent raises it: a worker's traceback would be lost on its stderr
        results.put((number, f"error: {type(e).__name__}: {e}"))


if __name__ == "glassformer-encode-worker":  # run by runpy.run_path with init_globals ARGS
    serve(*ARGS)  # noqa: F821
