"""What a run reads its batches from, beyond the batch rule (text/data.py `get_batch`): the data
folder's fingerprint, recorded in every checkpoint and compared on --resume, the position the
checkpoint records, --align-docs's document starts, and the batches read one step ahead
(`Prefetch`). docs/data.md#batches-from-shards.

The batches are a function of (seed, step) alone, so the position to resume from is the step;
what a resume must also have is the same ids, which the fingerprint stands for: a sharded
folder's shard list with each shard's sha256 (from meta.json, written by prepare), a single-file
folder's file sizes and sha256s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..text.data import document_starts, get_batch
from ..text.shards import sha256

if TYPE_CHECKING:
    from .runstate import RunState

# A single train.bin/val.bin up to this size is hashed whole at each start (0.3 s at 256 MiB here);
# a larger one by its size and its first and last MiB, so a start does not read gigabytes.
HASH_WHOLE = 1 << 28
ENDS = 1 << 20


def data_fingerprint(folder: Path, meta: dict) -> dict:
    """{"shards": {"train": [{"file", "tokens", "sha256"}...], "val": [...]}} of a sharded folder (its
    meta.json's list), or {"files": [{"file", "bytes", "sha256"}...]} of a single-file one ("sha256"
    of the whole file, or "ends_sha256" of its first and last MiB when it is larger than HASH_WHOLE)."""
    if "shards" in meta:
        return {"shards": {split: [{k: e[k] for k in ("file", "tokens", "sha256")} for e in meta["shards"][split]]
                           for split in ("train", "val")}}
    files = []
    for name in ("train.bin", "val.bin"):
        path, entry = folder / name, {"file": name}
        entry["bytes"] = size = path.stat().st_size
        if size <= HASH_WHOLE:
            entry["sha256"] = sha256(path)
        else:
            entry["ends_sha256"] = _ends_sha256(path, size)
        files.append(entry)
    return {"files": files}


def _ends_sha256(path: Path, size: int) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(ENDS))
        f.seek(max(0, size - ENDS))
        h.update(f.read(ENDS))
    return h.hexdigest()


def check_same_data(state: dict | None, now: dict, data: Path) -> None:
    """One line, unless the fingerprint recorded in a resumed run's train state (None: a fresh run; a
    run saved before fingerprints has none, and nothing is compared) is the data folder's now: other
    ids would give other batches from the resumed step on."""
    recorded = state.get("data") if isinstance(state, dict) else None
    saved = recorded.get("fingerprint") if isinstance(recorded, dict) else None
    if not isinstance(saved, dict) or saved == now:
        return
    raise UserError(f"--resume: the data folder {data} is not the one the run began with ({_change(saved, now)}), so "
                    f"its batches would differ from the run's: resume with the folder the run trained on, or start "
                    f"a new run with another --out")


def _change(saved: dict, now: dict) -> str:
    """What differs between two fingerprints, in a few words: the first file that changed."""
    if saved.keys() != now.keys():
        return "it was prepared again " + ("in shards" if "shards" in now else "as single files")
    if "files" in now:
        old, new = saved["files"], now["files"]
    else:
        old = [dict(e, split=s) for s in ("train", "val") for e in saved["shards"].get(s, [])]
        new = [dict(e, split=s) for s in ("train", "val") for e in now["shards"][s]]
    for a, b in zip(old, new):
        if a == b:
            continue
        if a.get("file") != b["file"]:
            return f"{b['file']} stands where {a.get('file')} stood"
        key = next(k for k in ("tokens", "bytes", "sha256", "ends_sha256", "split") if a.get(k) != b.get(k))
        return f"{b['file']}'s {key} is {str(b.get(key))[:16]}, not {str(a.get(key))[:16]}"
    n_old, n_new = len(old), len(new)
    return f"{n_new} files now, {n_old} when it began"


def data_state(run: RunState) -> dict:
    """What a checkpoint records of the data: the fingerprint that --resume compares, and the position
    reached, for reading: the batches are a function of (seed, step), so the step is the position."""
    return {"fingerprint": run.data_fingerprint, "align_docs": run.cfg.align_docs,
            "windows_read": run.step * run.cfg.batch_size}


def attach_docs(run: RunState, meta: dict) -> None:
    """With --align-docs: the training split's document starts (one scan for eot_id), which every window
    begins at; a UserError for data without documents to align to."""
    if not run.cfg.align_docs:
        return
    if run.block is not None:
        raise UserError(f"--align-docs: {run.data} holds conversations, whose windows already begin at a "
                        f"conversation: leave --align-docs out")
    if meta.get("eot_id") is None:
        raise UserError(f"--align-docs: {run.data / 'meta.json'} has no eot_id, so its documents cannot be found: "
                        f"prepare the folder again, or leave --align-docs out")
    # (D,) int64; 0 is always among them, and start_run checked the split holds a window, so one fits.
    run.doc_starts = document_starts(run.train_tokens, meta["eot_id"])


class Prefetch:
    """Batches one step ahead: get(step) returns step's batch (the one read ahead, or read now) and
    hands step+1's to a reader thread, so reading it overlaps this step's compute. On a GPU the CPU
    mostly waits for the device, and a batch of 64 x 1024 ids took 0.55 ms to read on a busy CPU, 3%
    of the reference shape's estimated H100 step (docs/benchmarks-log.md#the-loaders-share-of-a-step).
    A batch is a function of the step alone, so reading ahead changes no batch; an error reading one
    is raised when that batch is asked for. One thread, kept: starting one per step cost more than
    the read on a busy machine."""

    def __init__(self, read):
        from concurrent.futures import ThreadPoolExecutor

        self.read = read  # step -> (x, y)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="batches")
        self.ahead = None  # (step, future of its batch)

    def get(self, step: int):
        if self.ahead is not None and self.ahead[0] == step:
            batch = self.ahead[1].result()  # raises what reading it raised
        else:
            batch = self.read(step)
        self.ahead = (step + 1, self.pool.submit(self.read, step + 1))
        return batch


def next_batch(run: RunState):
    """(x, y) (B/W, T) of this rank's rows of step run.step's global batch, read one step ahead."""
    if run.prefetch is None:
        cfg, d = run.cfg, run.d
        run.prefetch = Prefetch(lambda step: get_batch(
            run.train_tokens, cfg.batch_size, run.seq_len, cfg.seed, step, d.rank, d.world_size, mask=run.train_mask,
            block=run.block, sampling=cfg.sampling, doc_starts=run.doc_starts))  # ys -1 where the mask says no loss
    return run.prefetch.get(run.step)
