"""Hugging Face Hub names wherever a checkpoint is accepted: `org/name` or `org/name@revision`
(a branch, tag or commit) that is not an existing path names a model on the Hub, read from the
Hugging Face cache and fetched into it when missing (docs/convert.md#hugging-face-hub).

`huggingface_hub.snapshot_download` does the work: the cache layout, HF_HUB_OFFLINE, the token
(HF_TOKEN or `hf auth login`), its progress bars. Only the files glassformer reads are fetched:
safetensors weights, configs and tokenizer files, and pickled `.bin` weights with allow_pickle.
huggingface_hub is imported only when a Hub name is used (it comes with `glassformer[hf]`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import UserError

# Hub repository ids are `owner/name` of letters, digits, `-`, `_` and `.`; a revision may hold `/` (refs/pr/1).
_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w][\w./-]*))?")

# What loading reads from a Hugging Face or glassformer folder (convert/hf.py open_weights, text/tokenizer.py,
# checkpoint/loading.py and adapters.py), and no more: the root's weights only, so a repository's other copies
# (consolidated.safetensors, onnx/, original/) stay on the Hub.
CONFIG_FILES = ["config.json"]
FILES = CONFIG_FILES + ["generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "chat_template.jinja", "additional_chat_templates/*.jinja",
         "model*.safetensors", "model.safetensors.index.json", "adapter.safetensors", "COMPLETE"]
PICKLE_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
_TRUE = {"1", "on", "yes", "true"}


def parse_name(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) if text reads as a Hub name, else None.

    >>> parse_name("HuggingFaceTB/SmolLM2-135M"), parse_name("org/name@v1.0")
    (('HuggingFaceTB/SmolLM2-135M', None), ('org/name', 'v1.0'))
    >>> parse_name("runs/demo/step-000100"), parse_name("./org/name"), parse_name("model")
    (None, None, None)
    """
    m = _NAME.fullmatch(str(text))
    return (m["repo"], m["revision"]) if m else None


def find(path: str | Path, allow_pickle: bool = False, weights: bool = True) -> Path:
    """The local folder `path` names: the path itself when it exists or is no Hub name (a path
    always wins), else the Hub model's snapshot folder in the Hugging Face cache (with
    weights=False, only its config.json is fetched)."""
    name = parse_name(str(path)) if not Path(path).exists() else None
    if name is None:
        return Path(path)
    return snapshot(str(path), *name, allow_pickle=allow_pickle, weights=weights)


def _settings() -> tuple[str | None, bool]:
    """(cache folder, offline) from the environment as it is now: huggingface_hub reads HF_HOME,
    HF_HUB_CACHE and HF_HUB_OFFLINE once, at import, so a later change would go unseen in-process.
    None leaves huggingface_hub's own default cache."""
    from huggingface_hub import constants

    env = os.environ
    cache = env.get("HF_HUB_CACHE") or (os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else None)
    flag = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE")
    offline = flag.strip().lower() in _TRUE if flag is not None else bool(constants.HF_HUB_OFFLINE)
    return cache, offline


def snapshot(text: str, repo: str, revision: str | None, allow_pickle: bool = False, weights: bool = True) -> Path:
    """The snapshot folder of repo@revision, fetched into the cache when missing; every failure a UserError
    that names both readings of `text` (a folder here, a model on the Hub)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"no folder {text} here; to read it as a Hugging Face Hub name, install huggingface_hub: "
                        'pip install "glassformer[hf]"') from None
    cache, offline = _settings()
    patterns = (FILES + (PICKLE_FILES if allow_pickle else [])) if weights else CONFIG_FILES
    try:
        folder = snapshot_download(repo, revision=revision, allow_patterns=patterns, cache_dir=cache,
                                   local_files_only=offline)
    except Exception as e:  # huggingface_hub's own errors, its HTTP client's and OSError, across versions
        raise UserError(_failure(text, repo, revision, offline, e)) from None
    folder = Path(folder)
    found = [*folder.glob("model*.safetensors"), *folder.glob("adapter.safetensors"),
             *(folder.glob("pytorch_model*.bin") if allow_pickle else [])]
    if weights and not found:
        what = f"{repo}@{revision}" if revision else repo
        extra = "" if allow_pickle else "; if it holds pickled pytorch_model.bin files, convert it with --allow-pickle"
        raise UserError(f"{what} on the Hugging Face Hub has no weights glassformer reads (model.safetensors or "
                        f"its shards){extra}")
    return folder


def _failure(text: str, repo: str, revision: str | None, offline: bool, e: Exception) -> str:
    """What went wrong, in words, with what to do."""
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    here = f"no folder {text} here, and"
    what = f"{repo}@{revision}" if revision else repo
    if type(e).__name__ == "IncompleteSnapshotError":  # newer huggingface_hub: the snapshot lacks some files
        why = "offline: HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        return f"{here} {what} is only partly in the Hugging Face cache ({why}); fetch it again with the network"
    if isinstance(e, LocalEntryNotFoundError) and offline:
        return (f"{here} {what} is not in the Hugging Face cache (offline: HF_HUB_OFFLINE is set); "
                "fetch it once with the network, or give a local folder")
    if isinstance(e, LocalEntryNotFoundError):
        return (f"{here} the Hugging Face Hub could not be reached to fetch {what}, which is not in the cache: "
                "check the network connection (or a proxy), then try again")
    if isinstance(e, GatedRepoError):
        return f"{here} {repo} on the Hugging Face Hub is gated: accept its terms on its page, then set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return (f"{here} {repo} is not a model on the Hugging Face Hub (if it is private, set HF_TOKEN "
                "or run `hf auth login`)")
    if isinstance(e, RevisionNotFoundError):
        return f"{here} {repo} on the Hugging Face Hub has no revision {revision!r} (a branch, tag or commit)"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{here} fetching {what} from the Hugging Face Hub failed ({type(e).__name__}: {first})"
