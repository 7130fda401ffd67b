"""A tokenizer.json as GGUF tokenizer metadata, so llama.cpp splits text exactly as glassformer does.

llama.cpp does not run tokenizer.json: it has a BPE of its own and a fixed set of named
pre-tokenizers (the regexes that cut text into words before merging). So the metadata names
the one that cuts as the tokenizer.json does, or the export is refused: tokenizers trained
here (GPT-2's ByteLevel regex) are "gpt-2", imported ones are matched by their pre-tokenizer
(Llama 3 "llama-bpe", Qwen2 "qwen2", SmolLM "smollm", GPT-2 "gpt-2"), and SentencePiece-style
vocabularies (byte fallback, '▁' for spaces) become llama.cpp's "llama" model with scores.
The exact tokenizer.json travels as `tokenizer.huggingface.json`: docs/convert.md#gguf.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import UserError

# The regexes of the Split pre-tokenizers of Llama 3's and Qwen2's tokenizer.json (they differ
# in the digits: Llama 3 groups up to three, Qwen2 takes one at a time).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's token types (gguf.TokenType).
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6


def _byte_level(node: Any, use_regex: bool) -> bool:
    return (isinstance(node, dict) and node.get("type") == "ByteLevel" and not node.get("add_prefix_space", False)
            and bool(node.get("use_regex", True)) == use_regex)


def _split(node: Any, regex: str) -> bool:
    return (isinstance(node, dict) and node.get("type") == "Split" and node.get("pattern", {}).get("Regex") == regex
            and node.get("behavior") == "Isolated" and not node.get("invert", False))


def _describe(node: Any) -> str:
    if not isinstance(node, dict):
        return repr(node)
    if node.get("type") == "Sequence":
        return "Sequence[" + ", ".join(_describe(n) for n in node.get("pretokenizers", [])) + "]"
    extra = {k: v for k, v in node.items() if k not in ("type", "trim_offsets")}
    return f"{node.get('type')}{json.dumps(extra, ensure_ascii=False)[:120]}"


def bpe_pre_name(spec: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.json, or a UserError naming it.

    >>> bpe_pre_name({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}})
    'gpt-2'
    """
    pre, norm = spec.get("pre_tokenizer"), spec.get("normalizer")
    seq = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    name = None
    if len(seq) == 1 and _byte_level(seq[0], True):
        name = "gpt-2"
    elif len(seq) == 2 and seq[0].get("type") == "Digits" and seq[0].get("individual_digits") and _byte_level(seq[1], True):
        name = "smollm"
    elif len(seq) == 2 and _split(seq[0], LLAMA3_REGEX) and _byte_level(seq[1], False):
        name = "llama-bpe"
    elif len(seq) == 2 and _split(seq[0], QWEN2_REGEX) and _byte_level(seq[1], False):
        name = "qwen2"
    if name is None:
        raise UserError(
            f"the tokenizer's pre-tokenizer {_describe(pre)} is none that llama.cpp implements "
            "(glassformer maps GPT-2's ByteLevel, SmolLM's, Llama 3's and Qwen2's), so llama.cpp would split "
            "text differently: export refused"
        )
    # Qwen2 normalises to NFC (llama.cpp's qwen2 does not; NFC text, the usual kind, splits the same).
    if norm is not None and not (name == "qwen2" and norm.get("type") == "NFC"):
        raise UserError(f"the tokenizer has a normalizer ({_describe(norm)}) that llama.cpp's {name!r} tokenizer does not apply: export refused")
    # llama.cpp takes a whole word found in the vocabulary as one token for Llama 3 only.
    ignore = bool((spec.get("model") or {}).get("ignore_merges", False))
    if ignore != (name == "llama-bpe"):
        raise UserError(f"the tokenizer has ignore_merges={ignore}, but llama.cpp's {name!r} tokenizer "
                        f"{'ignores' if name == 'llama-bpe' else 'applies'} merges for whole words: export refused")
    return name


def is_sentencepiece(spec: dict) -> bool:
    """A BPE with byte fallback whose spaces are '▁' (Llama 2, Mistral, TinyLlama): llama.cpp's 'llama' model."""
    model = spec.get("model") or {}
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer")], ensure_ascii=False)
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and "\u2581" in text


def _merge_text(m: Any) -> str:
    return m if isinstance(m, str) else " ".join(m)  # tokenizers >= 0.20 writes [a, b] pairs


def _tokens(spec: dict, n_vocab: int) -> tuple[list[str], list[int]]:
    """Every id's text and type, ids past the tokenizer's (a padded embedding) as unused."""
    tokens: list[str | None] = [None] * n_vocab
    types = [UNUSED] * n_vocab
    for text, i in spec["model"]["vocab"].items():
        if i >= n_vocab:
            raise UserError(f"tokenizer id {i} ({text!r}) is past the model's vocabulary of {n_vocab}: they do not belong together")
        tokens[i], types[i] = text, NORMAL
    for added in spec.get("added_tokens", []):
        i = added["id"]
        if i >= n_vocab:
            raise UserError(f"tokenizer id {i} ({added['content']!r}) is past the model's vocabulary of {n_vocab}")
        tokens[i], types[i] = added["content"], CONTROL if added.get("special") else USER_DEFINED
    return [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)], types


def _space_prefix(spec: dict) -> bool:
    """Whether the text gets a leading '▁' (a Prepend normalizer, or a Metaspace that prepends)."""
    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Prepend":
                return True
            if node.get("type") == "Metaspace":
                return node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never") != "never"
            return any(walk(v) for v in node.values())
        return any(walk(v) for v in node) if isinstance(node, list) else False

    return walk(spec.get("normalizer")) or walk(spec.get("pre_tokenizer"))


def _spm_fields(spec: dict, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """Scores for llama.cpp's SentencePiece merge loop (highest score merges first): a merged piece
    scores minus its merge's rank, so pieces merge in the order the BPE's merges list gives."""
    rank = {}
    for r, m in enumerate(spec["model"].get("merges", [])):
        rank.setdefault(_merge_text(m).replace(" ", ""), r)
    floor = -float(len(rank) + 1)
    scores, out_types = [], []
    for t, kind in zip(tokens, types):
        scores.append(-float(rank[t]) if t in rank else floor)
        out_types.append(BYTE if kind == NORMAL and len(t) == 6 and t.startswith("<0x") and t.endswith(">") else kind)
    unk = spec["model"].get("unk_token")
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.scores": scores,
              "tokenizer.ggml.token_type": out_types, "tokenizer.ggml.add_space_prefix": _space_prefix(spec)}
    if unk is not None and unk in tokens:
        fields["tokenizer.ggml.unknown_token_id"] = tokens.index(unk)
        out_types[tokens.index(unk)] = 2  # UNKNOWN
    return fields


def _specials(tok, spec: dict, pieces: list[str]) -> dict[str, Any]:
    """bos/eos/eot/pad ids and whether a BOS is added (as the tokenizer.json's post-processor does)."""
    def id_of(text):
        return pieces.index(text) if text in pieces else None

    out: dict[str, Any] = {}
    first = tok.tk.encode("", add_special_tokens=True).ids
    bos = id_of(tok.special_tokens.get("bos_token")) if tok.special_tokens.get("bos_token") else None
    if bos is None and first:
        bos = first[0]
    if bos is None:  # as GPT-2: the end-of-text token also begins a text
        bos = tok.eot_id
    eos = tok.eos_ids
    wrong = [i for i in [bos, *eos] if i is not None and not 0 <= i < len(pieces)]
    if wrong:
        raise UserError(f"the tokenizer's bos/eos ids {wrong} (tokenizer_config.json, generation_config.json) are not in "
                        f"its vocabulary of {len(pieces)}: correct them before exporting")
    if bos is not None:
        out["tokenizer.ggml.bos_token_id"] = bos
    if eos:
        out["tokenizer.ggml.eos_token_id"] = eos[0]
    if len(eos) > 1:
        out["tokenizer.ggml.eot_token_id"] = eos[1]
    pad = id_of(tok.special_tokens.get("pad_token")) if tok.special_tokens.get("pad_token") else None
    if pad is not None:
        out["tokenizer.ggml.padding_token_id"] = pad
    out["tokenizer.ggml.add_bos_token"] = bool(first) and first[0] == bos
    out["tokenizer.ggml.add_eos_token"] = False
    return out


def tokenizer_fields(tok, json_text: str, n_vocab: int) -> dict[str, Any]:
    """The tokenizer.* keys of a GGUF file for `tok` (a glassformer Tokenizer read from json_text,
    the exact tokenizer.json) and a model of n_vocab ids. Refuses what llama.cpp would split differently."""
    spec = json.loads(json_text)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"the tokenizer is a {model.get('type')} model; glassformer writes BPE tokenizers to GGUF only")
    tokens, types = _tokens(spec, n_vocab)
    if is_sentencepiece(spec):
        fields = _spm_fields(spec, tokens, types)
    else:
        fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": bpe_pre_name(spec),
                  "tokenizer.ggml.token_type": types,
                  "tokenizer.ggml.merges": [_merge_text(m) for m in model.get("merges", [])]}
    fields = {"tokenizer.ggml.model": fields.pop("tokenizer.ggml.model"), "tokenizer.ggml.pre": fields.pop("tokenizer.ggml.pre"),
              "tokenizer.ggml.tokens": tokens, **fields}
    fields.update(_specials(tok, spec, tokens))
    templates = dict(tok.chat_templates)
    if tok.chat_template is not None:
        fields["tokenizer.chat_template"] = tok.chat_template
    for name, text in templates.items():
        if text != tok.chat_template:
            fields[f"tokenizer.chat_template.{name}"] = text
    fields["tokenizer.huggingface.json"] = json_text
    return fields
