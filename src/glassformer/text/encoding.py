"""What `prepare` encodes with and writes into: the encoders (this process's threads, or K worker
processes, results in document order either way), the sinks (one token file, or shards of N ids in
llm.c's format) and the progress file that makes a sharded prepare resumable.

The ids of a split are one stream: each batch of text chunks (text/data.py `_chunk_batches`) gives
its ids with end-of-text after each document, batch after batch. A position in the stream is
(copy, batch, offset): the copy of the training split (BPE-dropout writes several, docs/data.md#bpe-dropout),
the batch's number in it, the id within the batch. A shard ends at N ids wherever that falls, in
the middle of a document too; the progress file records, with each finished shard, the position
just past it, so a run that starts again re-encodes from there and nothing before.
docs/data.md#shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import sys
from collections import deque
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..files import fsync_dir
from .shards import MAX_IDS, header as shard_header, read_header, sha256 as shard_sha256, shard_name
from .encode_worker import flat_ids

IN_FLIGHT = 2  # batches queued per encoder, so none waits at a batch's end for the next
PROGRESS = "progress.json"  # in the temporary folder only; never in a finished one
PROGRESS_VERSION = 1
WORKERS_FROM_BYTES = 16 << 20  # --workers' default is the cores from this much text on (auto_workers)


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_workers(nbytes: int) -> int:
    """The cores for at least WORKERS_FROM_BYTES of text, else 1: starting a process costs about a second
    (Python, numpy, tokenizers and the tokenizer), more than it saves on a small corpus, which this
    process's tokenizers threads encode on every core anyway."""
    return default_workers() if nbytes >= WORKERS_FROM_BYTES else 1


def check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers} must be a whole number of at least 1 (default: the cores, {default_workers()})")
    return workers


def check_shard_tokens(n) -> int:
    """n if it is 0 (one token file a split) or a shard size a header can count."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_IDS:
        raise UserError(f"--shard-tokens {n} must be a whole number from 1 to {MAX_IDS:,} (ids per shard; "
                        f"a shard's header counts them in an int32), or 0 for one train.bin and val.bin")
    return n


# -- encoders -------------------------------------------------------------------------------
class Encoders:
    """Encode jobs (key, texts, ends) into (key, ids) in the order given.

    workers == 1 or `encode` given (BPE-dropout, Python code of the package): `encode(texts, ends, key)`
    (default flat_ids) in IN_FLIGHT threads of this process, tokenizers using its own threads too.
    workers > 1: that many spawned processes, one tokenizers thread each, job n to worker n mod K, so
    taking the results round the workers in turn gives them in order. A context manager: leaving it
    stops the workers."""

    def __init__(self, tk, eot: np.ndarray, workers: int = 1, encode=None):
        self.tk, self.eot, self.workers, self.encode = tk, eot, workers, encode
        self.procs: list = []
        self.queues: list = []
        self.torch_in_workers = False

    def __enter__(self) -> "Encoders":
        if self.workers > 1 and self.encode is None:
            try:
                self._start()
            except BaseException:
                self._stop(now=True)
                raise
        return self

    def __exit__(self, kind, *exc) -> None:
        self._stop(now=kind is not None)

    def ordered(self, jobs):
        if not self.procs:
            yield from self._threads(jobs)
            return
        pending: deque = deque()  # (key, job number), oldest first
        for n, (key, texts, ends) in enumerate(jobs):
            self.queues[n % self.workers][0].put((n, texts, ends))
            pending.append((key, n))
            if len(pending) >= IN_FLIGHT * self.workers:
                yield self._take(*pending.popleft())
        while pending:
            yield self._take(*pending.popleft())

    def _threads(self, jobs):
        from concurrent.futures import ThreadPoolExecutor

        encode = self.encode or (lambda texts, ends, key: flat_ids(self.tk, texts, ends, self.eot))
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            pending: deque = deque()  # (key, future of its ids), oldest first
            for key, texts, ends in jobs:
                pending.append((key, pool.submit(encode, texts, ends, key)))
                if len(pending) > IN_FLIGHT:
                    k, job = pending.popleft()
                    yield k, job.result()
            while pending:
                k, job = pending.popleft()
                yield k, job.result()

    def _start(self) -> None:
        import multiprocessing
        import runpy

        ctx = multiprocessing.get_context("spawn")
        self.queues = [(ctx.Queue(), ctx.Queue()) for _ in range(self.workers)]  # (jobs, results) a worker
        path = str(Path(__file__).with_name("encode_worker.py"))
        with _without_main_script():
            for i, (jobs, results) in enumerate(self.queues):
                args = {"ARGS": (jobs, results, self.tk.to_str(), self.eot)}
                p = ctx.Process(target=runpy.run_path, args=(path, args, "glassformer-encode-worker"),
                                name=f"glassformer-encode-{i}", daemon=True)
                p.start()
                self.procs.append(p)
        for i in range(self.workers):
            self.torch_in_workers |= bool(self._receive(i, -1))

    def _take(self, key, n: int):
        return key, self._receive(n % self.workers, n)

    def _receive(self, i: int, n: int):
        while True:
            try:
                number, out = self.queues[i][1].get(timeout=1.0)
                break
            except queue.Empty:
                if not self.procs[i].is_alive():
                    raise RuntimeError(f"encoding worker {i} exited (status {self.procs[i].exitcode}) "
                                       f"before it encoded batch {n}") from None
        if isinstance(out, str) and out.startswith("error: "):
            raise RuntimeError(f"encoding worker {i} failed on batch {number}: {out[7:]}")
        assert number == n, f"worker {i} answered batch {number} for {n}"
        return out

    def _stop(self, now: bool = False) -> None:
        """Let the workers finish (None: no more jobs), or, after a failure or Ctrl-C, end them at once
        and drop what the queues still hold (else exit would wait to flush it into a dead pipe)."""
        for (jobs, results), p in zip(self.queues if self.procs else [], self.procs):
            if now:
                p.terminate()
                jobs.cancel_join_thread()
                results.cancel_join_thread()
            elif p.is_alive():
                jobs.put(None)
        for p in self.procs:  # the ones started so far, if starting failed
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
        self.procs = []


@contextlib.contextmanager
def _without_main_script():
    """Hide the main script from spawn while workers start. Spawn runs the parent's main script again
    in each child (for functions defined there); the workers need none of it, and the `glassformer`
    command's script imports the package, so torch, for nothing (hundreds of MB and seconds a worker)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__.pop(k) for k in ("__file__",) if k in main.__dict__}
    spec = getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        main.__spec__ = spec


# -- sinks ----------------------------------------------------------------------------------
class FileSink:
    """One token file of raw ids (the layout before shards), appended to batch after batch."""

    def __init__(self, path: Path, append: bool = False):
        self.f = open(path, "ab" if append else "wb")
        self.tokens = 0

    def write(self, ids: np.ndarray, where: tuple) -> None:
        ids.tofile(self.f)
        self.tokens += len(ids)

    def close(self) -> None:
        self.f.close()


class ShardWriter:
    """A split's shards of `shard_tokens` ids in folder, numbered on from those progress has finished.
    write(ids, where): ids (n,) starting at stream position where = (copy, batch, offset); each shard
    that fills is closed (its header's count set), fsynced, hashed and recorded in progress before the
    next one opens."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int, progress: "Progress"):
        self.folder, self.split, self.dtype, self.size, self.progress = folder, split, dtype, shard_tokens, progress
        self.f, self.n = None, 0  # the open shard and the ids in it
        self.index = len(progress.shards(split))
        self.tokens = sum(r["tokens"] for r in progress.shards(split))

    def write(self, ids: np.ndarray, where: tuple) -> None:
        copy, batch, offset = where
        while len(ids):
            if self.f is None:
                self.path = self.folder / shard_name(self.split, self.index)
                self.f = open(self.path, "wb")
                self.f.write(shard_header(0, self.dtype).tobytes())  # its count is set once the shard is whole
            take = min(len(ids), self.size - self.n)
            self.f.write(np.ascontiguousarray(ids[:take]).tobytes())
            self.n, self.tokens, offset, ids = self.n + take, self.tokens + take, offset + take, ids[take:]
            if self.n == self.size:
                self._finish((copy, batch, offset))

    def _finish(self, after: tuple) -> None:
        self.f.seek(0)
        self.f.write(shard_header(self.n, self.dtype).tobytes())
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        record = {"file": self.path.name, "tokens": self.n, "sha256": shard_sha256(self.path), "next": list(after)}
        self.f, self.n, self.index = None, 0, self.index + 1  # whole: no longer abandon()'s to delete
        self.progress.add_shard(self.split, record)

    def close(self, end: tuple = (None, None, None)) -> None:
        """Finish the last shard (shorter than the others), if it holds any ids."""
        if self.f is not None:
            self._finish(end)

    def abandon(self) -> None:
        """Close and delete the shard being written (a failure): only whole shards stay."""
        if self.f is not None:
            self.f.close()
            self.path.unlink(missing_ok=True)
            self.f = None


# -- the progress file ----------------------------------------------------------------------
class Progress:
    """progress.json in the temporary folder of a sharded prepare: what it was asked (a digest of the
    inputs), its tokenizer's origin, and per split the finished shards (file, tokens, sha256, the
    stream position after it) and, once the split is whole, its byte and invalid-UTF-8 counts."""

    def __init__(self, folder: Path, inputs: str):
        self.path, self.inputs = folder / PROGRESS, inputs
        self.data = {"version": PROGRESS_VERSION, "inputs": inputs, "tokenizer": None,
                     "splits": {"train": {"shards": [], "done": None}, "val": {"shards": [], "done": None}}}

    @classmethod
    def resume(cls, folder: Path, inputs: str) -> "Progress":
        """The progress of an earlier run of the same inputs in folder, its shards checked against their
        sha256 (the first that fails, and all after it, are dropped) and any other .bin file deleted;
        a fresh one if there is none or it was of other inputs."""
        p = cls(folder, inputs)
        try:
            old = json.loads(p.path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get("version") == PROGRESS_VERSION and old.get("inputs") == inputs:
            p.data["tokenizer"] = old.get("tokenizer")
            for split in ("train", "val"):
                kept = _verified(folder, old["splits"][split]["shards"])
                whole = len(kept) == len(old["splits"][split]["shards"])
                p.data["splits"][split] = {"shards": kept, "done": old["splits"][split]["done"] if whole else None}
                if not whole:
                    break  # a later split was written after this one: its shards are redone too
        else:  # another run's folder: nothing in it (a tokenizer's template, say) may reach this one
            for f in folder.iterdir():
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        keep = {r["file"] for s in p.data["splits"].values() for r in s["shards"]}
        for f in folder.glob("*.bin"):
            if f.name not in keep:
                f.unlink()
        return p

    def shards(self, split: str) -> list[dict]:
        return self.data["splits"][split]["shards"]

    def done(self, split: str) -> dict | None:
        return self.data["splits"][split]["done"]

    def resume_at(self, split: str) -> tuple | None:
        """(copy, batch, offset) where the split's stream continues, None to start it."""
        finished = self.shards(split)
        return tuple(finished[-1]["next"]) if finished else None

    def add_shard(self, split: str, record: dict) -> None:
        self.shards(split).append(record)
        self.save()

    def finish(self, split: str, nbytes: int, stats_delta: dict) -> None:
        self.data["splits"][split]["done"] = {"bytes": nbytes, **stats_delta}
        self.save()

    def set_tokenizer(self, info: dict) -> None:
        self.data["tokenizer"] = info
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(self.data, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    def shard_list(self, split: str) -> list[dict]:
        """meta.json's list: file, tokens, sha256 of each shard."""
        return [{k: r[k] for k in ("file", "tokens", "sha256")} for r in self.shards(split)]


def _verified(folder: Path, records: list[dict]) -> list[dict]:
    """The leading records whose files are whole shards with their recorded count and sha256."""
    kept = []
    for r in records:
        path = folder / r["file"]
        try:
            ok = path.is_file() and read_header(path)[1] == r["tokens"] and shard_sha256(path) == r["sha256"]
        except UserError:
            ok = False
        if not ok:
            break
        kept.append(r)
    return kept


def digest(obj) -> str:
    """sha256 of obj as canonical JSON: the fingerprint of a prepare's inputs."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class EncodeBar:
    """prepare's progress bar: MB of text read and MB/s, with documents and tokens written so far."""

    def __init__(self, total_bytes: int, disable):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encode", disable=disable, file=sys.stderr)
        self.documents = self.tokens = 0

    def __enter__(self) -> "EncodeBar":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def update(self, nbytes: int) -> None:
        self.bar.update(nbytes)

    def add(self, documents: int, tokens: int) -> None:
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        self.bar.set_postfix_str(f"{self.documents:,} documents, {self.tokens:,} tokens", refresh=False)
