"""Corpora of rows: parquet files, JSON-lines files and Hugging Face datasets named `hf:OWNER/NAME[:CONFIG][@REVISION]`.

Each row's text field is one document. Files are read a row group (parquet) or a line (JSONL) at
a time, never whole, so a corpus may be far larger than memory. A document goes to validation
when the first 8 bytes of the sha256 of its UTF-8 text, read as a number, fall below
val_fraction * 2**64: the split is fixed by the text alone, so copies of one text never straddle
the two splits. What is read, and how, with the errors: docs/data.md#corpora-parquet-jsonl-and-the-hub.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

from ..errors import UserError

ROW_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json.gz")  # .json.gz: JSON lines, gzipped (C4's, Dolma's shards)
TEXT_FIELD = "text"
BATCH_ROWS = 1024  # parquet rows decoded at once: a few MB of text, whatever the file's row groups hold
BYTES_PER_TOKEN = 4.0  # --max-tokens' estimate without a tokenizer: GPT-2's rate on English web text
SAMPLE_BYTES = 1 << 20  # --max-tokens with a tokenizer: its bytes per token measured on this much text
DATA_EXTRA = 'pip install "glassformer[data]"'
_TRUE = {"1", "on", "yes", "true"}


def row_kind(name: str) -> str | None:
    """'parquet' or 'jsonl' for a file name this module reads, else None."""
    low = name.lower()
    if low.endswith(".parquet"):
        return "parquet"
    return "jsonl" if low.endswith(ROW_SUFFIXES[1:]) else None


# -- reading one file ------------------------------------------------------------------------
@dataclass
class RowFile:
    """One parquet or JSONL file: `name` is what errors and meta.json say, `locate()` gives the local
    path (a Hub file is fetched into the Hugging Face cache when it is first read)."""

    name: str
    locate: Callable[[], Path]
    text_field: str = TEXT_FIELD
    pinned: bool = False  # a Hub file of a fixed commit: its name and size say what it holds
    _path: Path | None = field(default=None, repr=False, compare=False)

    def local(self) -> Path:
        """The local path, located (a Hub file fetched) once."""
        if self._path is None:
            self._path = self.locate()
        return self._path

    def fingerprint(self) -> list:
        """[name, size, mtime_ns] (a pinned file without the time, which a new download changes): cheap, and
        different when the file is replaced."""
        st = self.local().stat()
        return [self.name, st.st_size] + ([] if self.pinned else [st.st_mtime_ns])

    def rows(self) -> Iterator[bytes]:
        """Each row's text as UTF-8 bytes, in file order; null and empty texts are skipped."""
        path = self.local()
        if row_kind(self.name) == "parquet":
            return _parquet_rows(path, self.name, self.text_field)
        return _jsonl_rows(path, self.name, self.text_field)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UserError(f"reading parquet needs pyarrow: {DATA_EXTRA}") from None
    return pyarrow


def _parquet_rows(path: Path, name: str, field: str) -> Iterator[bytes]:
    pa = _pyarrow()
    try:
        pf = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{name} is not a parquet file pyarrow can read ({_first_line(e)}): fetch or write it again") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UserError(f"{name} has no column {field!r} (its columns: {', '.join(schema.names)}): "
                        f"give --text-field naming the column that holds the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise UserError(f"{name}: column {field!r} holds {kind}, not text: give --text-field naming a text column")
    return _row_groups(pa, pf, name, field)


def _row_groups(pa, pf, name: str, field: str) -> Iterator[bytes]:
    for group in range(pf.num_row_groups):
        try:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[field]):
                # The UTF-8 bytes as they are stored (a cast to binary copies nothing): no decode and encode again.
                for data in batch.column(0).cast(pa.large_binary()).to_pylist():
                    if data:
                        yield data
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{name}: row group {group} cannot be read ({_first_line(e)}): the file is damaged; "
                            f"fetch or write it again") from None


def _jsonl_rows(path: Path, name: str, field: str) -> Iterator[bytes]:
    opener = gzip.open if name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    data = _jsonl_text(line, name, lineno, field)
                    if data:
                        yield data
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise UserError(f"{name}: cannot be read past line {lineno} ({_first_line(e)}): the file is damaged or "
                            f"not gzip; fetch or write it again") from None


def _jsonl_text(line: bytes, name: str, lineno: int, field: str) -> bytes | None:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise UserError(f"{name}:{lineno}: not a line of UTF-8 JSON ({_first_line(e)}): fix or remove the line") from None
    if not isinstance(obj, dict) or field not in obj:
        has = f"its fields: {', '.join(map(str, obj))}" if isinstance(obj, dict) else f"a {type(obj).__name__}, not an object"
        raise UserError(f"{name}:{lineno}: no field {field!r} ({has}): give --text-field naming the field that holds the text")
    text = obj[field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise UserError(f"{name}:{lineno}: field {field!r} is a {type(text).__name__}, not a string: "
                        f"give --text-field naming the field that holds the text")
    # surrogatepass: a lone surrogate (\ud800 in JSON) becomes bytes that are not UTF-8, which reading then
    # replaces by U+FFFD and counts, as it does any invalid UTF-8 (corpus.iter_text).
    return text.encode("utf-8", "surrogatepass")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- many files as one corpus, split by hash -------------------------------------------------
def text_hash(data: bytes) -> int:
    """The number a document's split is decided by: the first 8 bytes of sha256(text), big-endian."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class RowSource:
    """The documents of a list of RowFiles in order, the first `max_docs` of them (or, with
    max_tokens, as many as are estimated to make that many tokens), split by text_hash.

    `scan()` reads the slice once: it checks every row, counts each split's documents and bytes
    and fixes the cut (the hash below which a document is held out); then `split(val)` reads the
    slice again for each pass prepare makes, holding one parquet batch or one JSON line at a time.
    """

    def __init__(self, description: str, files: list[RowFile], val_fraction: float = 0.1,
                 max_docs: int | None = None, max_tokens: int | None = None, tokenizer=None):
        if not 0 < val_fraction < 1:
            raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (e.g. 0.1)")
        for flag, value in (("--max-docs", max_docs), ("--max-tokens", max_tokens)):
            if value is not None and value < 1:
                raise UserError(f"{flag} {value} must be at least 1")
        self.description, self.files, self.val_fraction = description, files, val_fraction
        self.text_field = files[0].text_field if files else TEXT_FIELD
        self.max_docs, self.max_tokens, self.tokenizer = max_docs, max_tokens, tokenizer
        self.cut = min(round(val_fraction * 2 ** 64), 2 ** 64 - 1)
        self.limit = max_docs  # documents read; fixed by scan() when max_tokens is given
        self.docs = {False: 0, True: 0}  # split (is it validation) -> documents
        self.nbytes = {False: 0, True: 0}  # split -> UTF-8 bytes
        self.bytes_per_token = None
        self.opened = None  # fingerprints of the files scan() opened

    def documents(self, recording: bool = False) -> Iterator[tuple[str, bytes]]:
        """(name, UTF-8 text) of each document of the slice, in order; the name is FILE#ROW. recording:
        each file opened adds its fingerprint to self.opened."""
        n = 0
        for f in self.files:
            if self.limit is not None and n >= self.limit:
                return  # before the next file is opened (or fetched)
            rows = f.rows()
            if recording:
                self.opened.append(f.fingerprint())
            for row, data in enumerate(rows):
                if self.limit is not None and n >= self.limit:
                    return
                n += 1
                yield f"{f.name}#{row}", data

    def scan(self, show_progress: bool | None = None) -> "RowSource":
        """Read the slice once (see the class), so the splits' sizes are known before any is written.
        show_progress: a bar in documents (None: on a terminal only)."""
        import sys

        from tqdm import tqdm

        stop_bytes = self._stop_bytes()
        seen = 0
        lo = hi = None  # [hash, documents, bytes] of the smallest and largest hash seen
        self.opened = []
        with tqdm(self.documents(recording=True), unit="doc", unit_scale=True, desc="read", file=sys.stderr,
                  disable=None if show_progress is None else not show_progress) as bar:
            for _, data in bar:
                h, nb = text_hash(data), len(data)
                self.docs[h < self.cut] += 1
                self.nbytes[h < self.cut] += nb
                lo = _extreme(lo, h, nb, h < lo[0] if lo else True)
                hi = _extreme(hi, h, nb, h > hi[0] if hi else True)
                seen += 1
                if stop_bytes is not None and sum(self.nbytes.values()) + seen * self.bytes_per_token >= stop_bytes:
                    self.limit = seen  # the eot each document adds counts as one token
                    break
        if not seen:
            raise UserError(f"corpus {self.description} holds no text in its {self.text_field!r} fields: "
                            f"give --text-field naming the field that holds the text")
        if lo[0] == hi[0]:
            raise UserError(f"corpus {self.description} has {seen} document(s) but one distinct text: too few to hold "
                            f"some out; give more documents (or a larger --max-docs)")
        if not self.docs[True]:  # none fell below the cut: the smallest hash's documents are held out
            self._move(lo[0] + 1, lo[1:], True)
        elif not self.docs[False]:  # all did: the largest hash's documents train
            self._move(hi[0], hi[1:], False)
        return self

    def _move(self, cut: int, counts: list[int], val: bool) -> None:
        self.cut = cut
        self.docs[val], self.nbytes[val] = counts
        self.docs[not val] -= counts[0]
        self.nbytes[not val] -= counts[1]

    def _stop_bytes(self) -> float | None:
        """The bytes of text (plus bytes_per_token per document) at which --max-tokens stops reading."""
        if self.max_tokens is None:
            return None
        self.bytes_per_token = BYTES_PER_TOKEN if self.tokenizer is None else self._measure()
        return self.max_tokens * self.bytes_per_token

    def _measure(self) -> float:
        """The given tokenizer's bytes per token on the first SAMPLE_BYTES of text."""
        texts, nb = [], 0
        for _, data in self.documents():
            texts.append(data.decode("utf-8", "replace"))
            nb += len(data)
            if nb >= SAMPLE_BYTES:
                break
        n_tokens = sum(len(e.ids) for e in self.tokenizer.tk.encode_batch(texts, add_special_tokens=False))
        return nb / max(1, n_tokens)

    def fingerprint(self) -> dict:
        """What the slice's documents depend on, without reading them again: the files scan() opened
        (RowFile.fingerprint), the counts, the cut and the limit."""
        return {"files": self.opened, "docs": [self.docs[False], self.docs[True]],
                "bytes": [self.nbytes[False], self.nbytes[True]], "cut": self.cut, "limit": self.limit}

    def is_val(self, data: bytes) -> bool:
        return text_hash(data) < self.cut

    def split(self, val: bool, make_doc: Callable) -> "SplitDocuments":
        """The training (val False) or validation documents; make_doc is corpus.Document (passed in:
        corpus imports this module, not the other way)."""
        return SplitDocuments(self, val, make_doc)

    def meta(self) -> dict:
        """meta.json's record of what was read and how it was split."""
        return {"val_fraction": self.val_fraction, "text_field": self.text_field,
                "split": f"documents whose sha256(text)[:8] as a big-endian number is below {self.cut} "
                         f"(val_fraction * 2**64, or the smallest/largest hash when no document fell on one side)",
                "files": [f.name for f in self.files][:1000], "max_docs": self.max_docs, "max_tokens": self.max_tokens,
                "documents_read": self.docs[False] + self.docs[True],
                "bytes_per_token_estimate": self.bytes_per_token}


def _extreme(best: list | None, h: int, nb: int, better: bool) -> list:
    """[hash, documents, bytes] of the extreme hash so far, counting copies of it."""
    if better:
        return [h, 1, nb]
    if best[0] == h:
        best[1] += 1
        best[2] += nb
    return best


class SplitDocuments:
    """One split of a RowSource, read anew at each pass: iterable (corpus.Document each), len(), nbytes."""

    def __init__(self, source: RowSource, val: bool, make_doc: Callable):
        self.source, self.val, self.make_doc = source, val, make_doc

    def __len__(self) -> int:
        return self.source.docs[self.val]

    @property
    def nbytes(self) -> int:
        return self.source.nbytes[self.val]

    def fingerprint(self) -> list:
        """Stands for the list of (name, bytes) of the documents that prepare's resume compares, with no pass."""
        return [self.val, self.source.fingerprint()]

    def __iter__(self):
        for name, data in self.source.documents():
            if self.source.is_val(data) == self.val:
                yield self.make_doc(name=name, size=len(data), open_bytes=partial(io.BytesIO, data))


# -- local files and folders -----------------------------------------------------------------
def local_files(path: Path, text_field: str, text_suffixes: tuple[str, ...]) -> list[RowFile] | None:
    """The RowFiles of a parquet/JSONL file or of a folder holding such files (recursive, sorted);
    None when path is a text corpus (a text file, or a folder without them)."""
    if path.is_file():
        return [RowFile(str(path), partial(Path, path), text_field)] if row_kind(path.name) else None
    if not path.is_dir():
        return None
    found = sorted(p for p in path.rglob("*") if p.is_file() and (row_kind(p.name) or p.suffix.lower() in text_suffixes))
    rows = [p for p in found if row_kind(p.name)]
    if rows and len(rows) < len(found):
        text = next(p for p in found if not row_kind(p.name))
        raise UserError(f"corpus folder {path} holds both parquet/JSONL files ({rows[0]}) and text files ({text}): "
                        f"give a folder of one kind")
    return [RowFile(str(p), partial(Path, p), text_field) for p in rows] or None


# -- Hugging Face datasets -------------------------------------------------------------------
_HF = re.compile(r"hf:(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<config>[\w.-]+))?"
                 r"(?:@(?P<revision>\w[\w./-]*))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def parse_hf(text: str) -> tuple[str, str | None, str | None]:
    """(repo, config or None, revision or None) of `hf:OWNER/NAME[:CONFIG][@REVISION]`.

    >>> parse_hf("hf:HuggingFaceFW/fineweb-edu:sample-10BT"), parse_hf("hf:org/name@refs/convert/parquet")
    (('HuggingFaceFW/fineweb-edu', 'sample-10BT', None), ('org/name', None, 'refs/convert/parquet'))
    """
    m = _HF.fullmatch(text)
    if not m:
        raise UserError(f"{text!r} is not a Hugging Face dataset name: write hf:OWNER/NAME[:CONFIG][@REVISION], "
                        f"e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT")
    return m["repo"], m["config"], m["revision"]


def hub_settings() -> tuple[Path, bool]:
    """(cache folder, offline) from the environment as it is now (huggingface_hub reads it once, at
    import). Offline when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE says so."""
    from huggingface_hub import constants

    env = os.environ
    cache = env.get("HF_HUB_CACHE") or (os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else constants.HF_HUB_CACHE)
    flags = [env[k] for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if env.get(k) is not None]
    offline = any(f.strip().lower() in _TRUE for f in flags) if flags else bool(constants.HF_HUB_OFFLINE)
    return Path(cache), offline


def hub_files(text: str, text_field: str) -> tuple[list[RowFile], dict]:
    """The RowFiles of a Hub dataset's chosen files (each fetched into the cache when first read) and
    meta.json's record of the dataset ({"hf": {repo, config, revision, commit}})."""
    repo, config, revision = parse_hf(text)
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise UserError(f"reading {text} needs huggingface_hub: {DATA_EXTRA}") from None
    cache, offline = hub_settings()
    commit, listing = (_cached_listing if offline else _hub_listing)(text, repo, revision, cache)
    fetch = partial(_fetch, text, repo, commit, cache, offline)
    configs = _card_configs(fetch) if "README.md" in listing else None
    chosen = select_files(text, repo, revision, listing, configs, config)
    files = [RowFile(f"hf:{repo}/{name}", partial(fetch, name), text_field, pinned=True) for name in chosen]
    return files, {"hf": {"repo": repo, "config": config, "revision": revision, "commit": commit}}


def _cached_listing(text: str, repo: str, revision: str | None, cache: Path) -> tuple[str, list[str]]:
    """(commit, files) of the cached snapshot of repo@revision, laid out as huggingface_hub keeps it:
    datasets--OWNER--NAME/refs/<revision> holds the commit, snapshots/<commit>/ the files fetched so far."""
    storage = cache / ("datasets--" + repo.replace("/", "--"))
    commit = revision if revision and _COMMIT.fullmatch(revision) else None
    ref = storage / "refs" / (revision or "main")
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snap = storage / "snapshots" / commit if commit else None
    if snap is None or not snap.is_dir():
        raise UserError(f"{text} is not in the Hugging Face cache {cache} (offline: HF_HUB_OFFLINE or "
                        f"HF_DATASETS_OFFLINE is set): run the same command once with the network to fetch it")
    return commit, sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def _hub_listing(text: str, repo: str, revision: str | None, cache: Path) -> tuple[str, list[str]]:
    """(commit, files) of repo@revision as the Hub lists it now."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().dataset_info(repo, revision=revision)
    except Exception as e:  # huggingface_hub's errors and its HTTP client's, across versions
        raise UserError(_hub_failure(text, revision, False, e)) from None
    return info.sha, sorted(s.rfilename for s in info.siblings or [])


def _fetch(text: str, repo: str, commit: str, cache: Path, offline: bool, name: str) -> Path:
    """The local path of one file of the snapshot, fetched into the cache unless it is there (a commit
    hash as the revision: a cached file is returned without asking the Hub)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, name, repo_type="dataset", revision=commit, cache_dir=cache,
                                    local_files_only=offline))
    except Exception as e:
        raise UserError(_hub_failure(f"{text} (file {name})", commit, offline, e)) from None


def _hub_failure(what: str, revision: str | None, offline: bool, e: Exception) -> str:
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    if isinstance(e, GatedRepoError):
        return f"{what}: the dataset is gated: accept its terms on its page on the Hub, then set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return f"{what}: no such dataset on the Hugging Face Hub (if it is private, set HF_TOKEN or run `hf auth login`)"
    if isinstance(e, RevisionNotFoundError):
        return f"{what}: the dataset has no revision {revision!r} (a branch, tag or commit)"
    if isinstance(e, LocalEntryNotFoundError) and offline:
        return f"{what} is not in the Hugging Face cache (offline): run the same command once with the network"
    return (f"{what}: the Hugging Face Hub could not be reached or refused ({type(e).__name__}: {_first_line(e)}): "
            f"check the network, or set HF_HUB_OFFLINE=1 to read what the cache holds")


def _card_configs(fetch) -> list[dict] | None:
    """The `configs` of the dataset card's YAML header (README.md), or None if it has none."""
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(fetch("README.md")) or {}
    except UserError:
        raise
    except Exception:  # a card whose YAML does not parse reads as no card: every data file is read
        return None
    configs = meta.get("configs")
    configs = [c for c in configs if isinstance(c, dict) and "config_name" in c] if isinstance(configs, list) else []
    return configs or None


def select_files(text: str, repo: str, revision: str | None, listing: list[str], configs: list[dict] | None,
                 config: str | None) -> list[str]:
    """The files to read, in path order: those of the chosen configuration's train split when the
    card declares configurations, else every parquet/JSONL file (under a folder named CONFIG if given)."""
    data = [f for f in listing if row_kind(f)]
    if configs:
        chosen = _config(repo, revision, configs, config)
        patterns = _train_patterns(chosen.get("data_files"))
        picked = [f for f in data if any(fnmatch(f, p) for p in patterns)]
        where = f" for configuration {chosen['config_name']!r}"
    else:
        picked = data if config is None else [f for f in data if config in PurePosixPath(f).parts[:-1]]
        where = f" under a folder {config!r}" if config else ""
    if not picked:
        some = ", ".join(listing[:5]) + (", …" if len(listing) > 5 else "")
        raise UserError(f"{text} holds no parquet or JSONL files{where} (its files: {some or 'none'}); the Hub's own "
                        f"parquet conversion of a dataset is hf:{repo}@refs/convert/parquet")
    return picked


def _config(repo: str, revision: str | None, configs: list[dict], config: str | None) -> dict:
    names = [str(c["config_name"]) for c in configs]
    at = f"@{revision}" if revision else ""
    if config is not None:
        if config in names:
            return configs[names.index(config)]
        raise UserError(f"hf:{repo}{at} has no configuration {config!r}; it has: {', '.join(names[:20])}")
    default = ([c for c in configs if c.get("default")] or [c for c in configs if c["config_name"] == "default"]
               or (configs if len(configs) == 1 else []))
    if not default:
        raise UserError(f"hf:{repo}{at} has {len(names)} configurations and no default: name one, e.g. "
                        f"hf:{repo}:{names[0]}{at} (it has: {', '.join(names[:20])})")
    return default[0]


def _train_patterns(data_files) -> list[str]:
    """The path patterns of a card configuration's train split (all of its patterns if no split is named)."""
    def as_list(v):
        return [str(v)] if isinstance(v, str) else [str(x) for x in v] if isinstance(v, list) else []

    if isinstance(data_files, dict):  # {split: pattern(s)}
        return as_list(data_files.get("train", [p for v in data_files.values() for p in as_list(v)]))
    if isinstance(data_files, list) and any(isinstance(d, dict) for d in data_files):  # [{split, path}]
        entries = [d for d in data_files if isinstance(d, dict)]
        train = [d for d in entries if d.get("split") == "train"] or entries
        return [p for d in train for p in as_list(d.get("path"))]
    return as_list(data_files) or ["*"]
