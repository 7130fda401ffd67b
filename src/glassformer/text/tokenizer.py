"""Byte-level BPE on the `tokenizers` library: train, save and load `tokenizer.json`. Every
string round-trips exactly, any tokenizer.json (GPT-2, Llama 3, SmolLM) encodes as `tokenizers`
does, `<|endoftext|>` (`eot_id`) separates documents: docs/data.md#the-tokenizer-glassformertexttokenizer.
Chat templates and the configs beside tokenizer.json (from_folder, save_folder): docs/chat.md#templates.
    >>> tok = Tokenizer.train(["to be or not to be"] * 50, vocab_size=300)
    >>> tok.decode(tok.encode("to be, or not?")) == "to be, or not?"
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ..errors import UserError

EOT = "<|endoftext|>"
# End-of-text names used by common tokenizer.json files, in the order we look for them.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
MIN_VOCAB = 256 + 1  # every byte, plus the end-of-text token
MAX_VOCAB = 1 << 20


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte -> a printable character, so byte-level pieces are strings.

    Printable Latin-1 bytes map to themselves; the rest (controls, space) to U+0100 onwards,
    e.g. the space byte 0x20 -> 'Ġ' and newline 0x0A -> 'Ċ'.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def resolve_tokenizer_path(path: str | Path) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one inside a prepared
    data folder, a checkpoint folder, or a training run folder (its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"tokenizer {path} does not exist: give a tokenizer.json, a prepared data folder or a checkpoint folder")
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    latest = path / "latest"
    if latest.is_file() and (path / latest.read_text().strip() / "tokenizer.json").is_file():
        return path / latest.read_text().strip() / "tokenizer.json"
    raise UserError(f"{path} holds no tokenizer.json: give a tokenizer.json, a prepared data folder or a checkpoint folder")


def check_vocab_size(vocab_size: int) -> int:
    if not MIN_VOCAB <= int(vocab_size) <= MAX_VOCAB:
        raise UserError(f"vocabulary size {vocab_size} is out of range: choose {MIN_VOCAB} (256 bytes + end-of-text) to {MAX_VOCAB}")
    return int(vocab_size)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the few things a language model needs from it."""

    def __init__(self, tk):
        self.tk = tk
        # The number of ids a model needs: one past the largest id (a vocabulary may have gaps).
        self.vocab_size: int = max(tk.get_vocab_size(with_added_tokens=True),
                                   max(tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        self.eot_id: int | None = next((tk.token_to_id(t) for t in EOT_CANDIDATES if tk.token_to_id(t) is not None), None)
        self.special_ids: set[int] = {i for i, a in tk.get_added_tokens_decoder().items() if a.special}
        self._byte_level = _uses_byte_level(tk)
        # What tokenizer_config.json / chat_template.jinja / generation_config.json add (from_folder).
        self.chat_templates: dict[str, str] = {}
        self.chat_template: str | None = None
        self.special_tokens: dict = {}  # bos_token / eos_token / pad_token / unk_token strings
        self.tokenizer_config: dict = {}  # the rest of tokenizer_config.json, written back as read
        self._eos_ids: list[int] | None = None  # generation_config.json's eos_token_id

    # -- building -----------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, length: int | None = None,
              show_progress: bool = False, special_tokens: tuple[str, ...] = (EOT,)) -> "Tokenizer":
        """Train byte-level BPE on an iterable of strings (streamed: only word counts are kept)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        vocab_size = check_vocab_size(vocab_size)
        tk = HFTokenizer(models.BPE())
        # No normaliser: any normalisation (NFC, lowercasing) would break the exact round trip.
        # add_prefix_space=False: a text's first word is encoded as written.
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=show_progress,
        )
        tk.train_from_iterator(texts, trainer=trainer, length=length)
        return cls(tk)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a tokenizer.json (ours or any Hugging Face one), or the one in a data/checkpoint folder."""
        from tokenizers import Tokenizer as HFTokenizer

        path = resolve_tokenizer_path(path)
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exception on malformed JSON
            raise UserError(f"{path} is not a valid tokenizer.json ({str(e).splitlines()[0][:120]})") from None

    @classmethod
    def from_str(cls, json_text: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(json_text))

    @classmethod
    def from_folder(cls, folder: str | Path, template_name: str | None = None) -> "Tokenizer":
        """tokenizer.json plus what a Hugging Face folder keeps beside it: tokenizer_config.json
        (chat_template, a string or a list of named ones, and bos/eos/pad), chat_template.jinja and
        additional_chat_templates/*.jinja (which win over the config's), generation_config.json."""
        path = resolve_tokenizer_path(folder)
        return cls.from_file(path).read_configs(path.parent, template_name)

    def read_configs(self, folder: str | Path, template_name: str | None = None) -> "Tokenizer":
        """Take the configs beside tokenizer.json in `folder` (see from_folder); returns self."""
        _read_configs(self, Path(folder))
        self.select_template(template_name)
        return self

    def select_template(self, name: str | None = None) -> None:
        """Use chat template `name` (None: 'default', or the only one there is)."""
        if name is not None and name not in self.chat_templates:
            have = ", ".join(sorted(self.chat_templates)) or "none"
            raise UserError(f"no chat template named {name!r} (this tokenizer has: {have}); choose one of them with --template-name")
        if name is None:
            only = list(self.chat_templates.values()) if len(self.chat_templates) == 1 else []
            self.chat_template = self.chat_templates.get("default", only[0] if only else None)
        else:
            self.chat_template = self.chat_templates[name]

    def save_folder(self, folder: str | Path) -> None:
        """tokenizer.json, and tokenizer_config.json + chat_template.jinja (+ generation_config.json
        with an eos list) when there is something to put in them, as transformers reads them."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.save(folder / "tokenizer.json")
        _write_configs(self, folder)

    def save(self, path: str | Path) -> None:
        self.tk.save(str(path))

    def to_str(self) -> str:
        return self.tk.to_str()

    # -- using ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any BOS/EOS a template would add (a language model's
        input is the text itself; documents are joined with eot_id by the data pipeline)."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() over many texts, in parallel threads inside `tokenizers`."""
        return [e.ids for e in self.tk.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are kept, so decode(encode(s)) == s for every s."""
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (a piece may be part of one UTF-8 character)."""
        i = int(i)
        piece = self.tk.id_to_token(i)
        if piece is None:
            raise UserError(f"token id {i} is out of range: this tokenizer has ids 0 to {self.vocab_size - 1}")
        if i in self.special_ids:
            return piece.encode("utf-8")
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        # SentencePiece-style vocabularies: '▁' is a space, '<0x0A>' a raw byte.
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def id_to_piece(self, i: int) -> str:
        """A printable form of token `i`: its text, with bytes that are not whole UTF-8
        characters written as \\xNN (e.g. the first byte of 'é' is '\\xc3')."""
        return self.id_to_bytes(i).decode("utf-8", errors="backslashreplace")

    def pieces(self, text: str) -> list[tuple[int, str]]:
        """(id, piece) for each token of `text`."""
        return [(i, self.id_to_piece(i)) for i in self.encode(text)]

    # -- chat --------------------------------------------------------------------------------
    @property
    def eos_ids(self) -> list[int]:
        """Ids that end a reply: generation_config.json's eos_token_id, else eos_token and the end-of-text id."""
        if self._eos_ids is not None:
            return list(self._eos_ids)
        ids = [self.tk.token_to_id(self.special_tokens["eos_token"])] if self.special_tokens.get("eos_token") else []
        return list(dict.fromkeys(i for i in ids + [self.eot_id] if i is not None))

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self._eos_ids = None if ids is None else [int(i) for i in ([ids] if isinstance(ids, int) else ids)]

    def add_chat_tokens(self) -> list[str]:
        """Add <|im_start|> and <|im_end|> as special tokens where missing (ids after the vocabulary);
        without an eos_token, <|im_end|> becomes it (a ChatML reply ends there). Returns those added."""
        from .chat_template import CHAT_TOKENS

        added = [t for t in CHAT_TOKENS if self.tk.token_to_id(t) is None]
        if added:
            from tokenizers import AddedToken

            self.tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
            self._refresh_vocab()
        self.special_tokens.setdefault("eos_token", CHAT_TOKENS[1])
        return added

    def _refresh_vocab(self) -> None:
        tk = self.tk
        self.vocab_size = max(tk.get_vocab_size(with_added_tokens=True),
                              max(tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        self.special_ids = {i for i, a in tk.get_added_tokens_decoder().items() if a.special}

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False,
                            return_assistant_mask: bool = False, tokenize: bool = True,
                            template: str | None = None, **template_kwargs):
        """list[int] of the rendered conversation; (ids, mask) with mask[i] == 1 on assistant tokens;
        or the text when tokenize=False. template: a name in chat_templates or a template's text
        (default: chat_template). How masks are found: docs/chat.md#templates."""
        from . import chat_template as ct

        source = self._template(template)
        special = {k: v for k, v in self.special_tokens.items() if v is not None}
        if not return_assistant_mask:
            text = ct.render(source, messages, add_generation_prompt=add_generation_prompt, special=special, **template_kwargs)
            return text if not tokenize else self.encode(text)
        if ct.has_generation_blocks(source):
            text, spans = ct.render_spans(source, messages, add_generation_prompt=add_generation_prompt,
                                          special=special, **template_kwargs)
        else:
            stop = tuple(self.tk.id_to_token(i) for i in self.eos_ids)
            text, spans = ct.prefix_spans(source, messages, add_generation_prompt=add_generation_prompt,
                                          special=special, stop=stop, **template_kwargs)
        if not tokenize:
            return text
        enc = self.tk.encode(text, add_special_tokens=False)
        return enc.ids, ct.token_mask(enc.offsets, spans)

    def _template(self, template: str | None) -> str:
        if template is None:
            if self.chat_template is None:
                raise UserError("this tokenizer has no chat template: give one with --template FILE "
                                "(or add_chat_tokens() and the default ChatML template, glassformer.text.chat_template.CHATML_TEMPLATE)")
            return self.chat_template
        return self.chat_templates.get(template, template)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


# ----------------------------------------------------------------------------- the configs beside tokenizer.json

SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def _token_text(value):
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_templates(config: dict, folder: Path) -> dict[str, str]:
    """Named templates: the config's chat_template (str, or [{"name", "template"}]); the .jinja files win."""
    raw = config.get("chat_template")
    where = folder / "tokenizer_config.json"
    if isinstance(raw, str):
        templates = {"default": raw}
    elif isinstance(raw, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in raw):
            raise UserError(f"{where}: chat_template must be a string or a list of {{\"name\": ..., \"template\": ...}}")
        templates = {t["name"]: t["template"] for t in raw}
    elif raw is None:
        templates = {}
    else:
        raise UserError(f"{where}: chat_template must be a string or a list of named templates, got {type(raw).__name__}")
    files = {"default": folder / CHAT_TEMPLATE_FILE} if (folder / CHAT_TEMPLATE_FILE).is_file() else {}
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        files.update({p.stem: p for p in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))})
    if files:  # as transformers does: template files replace the config's templates
        templates = {name: p.read_text(encoding="utf-8") for name, p in files.items()}
    return templates


def _add_config_tokens(tok: "Tokenizer", config: dict) -> None:
    """added_tokens_decoder entries tokenizer.json lacks (rare: a hand-edited config)."""
    from tokenizers import AddedToken

    missing = [a for a in (config.get("added_tokens_decoder") or {}).values()
               if isinstance(a, dict) and isinstance(a.get("content"), str) and tok.tk.token_to_id(a["content"]) is None]
    if missing:
        tok.tk.add_special_tokens([AddedToken(a["content"], special=bool(a.get("special", True)), normalized=False)
                                   for a in missing])
        tok._refresh_vocab()


def _read_configs(tok: "Tokenizer", folder: Path) -> None:
    from ..files import read_json

    config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if not isinstance(config, dict):
        raise UserError(f"{folder / 'tokenizer_config.json'} must hold a JSON object")
    _add_config_tokens(tok, config)
    tok.chat_templates = _read_templates(config, folder)
    tok.special_tokens = {k: _token_text(config[k]) for k in SPECIAL_NAMES if _token_text(config.get(k)) is not None}
    tok.tokenizer_config = {k: v for k, v in config.items() if k != "chat_template" and k not in SPECIAL_NAMES}
    gen = folder / "generation_config.json"
    eos = read_json(gen).get("eos_token_id") if gen.is_file() else None
    if eos is not None:
        if not (isinstance(eos, int) or (isinstance(eos, list) and eos and all(isinstance(i, int) for i in eos))):
            raise UserError(f"{gen}: eos_token_id must be an id or a list of ids, got {eos!r}")
        tok.eos_ids = eos


def _write_configs(tok: "Tokenizer", folder: Path) -> None:
    """tokenizer_config.json with the template(s) in it (every transformers version reads that),
    chat_template.jinja beside it when there is one template (as transformers >= 4.43 writes it)."""
    templates = dict(tok.chat_templates)
    if tok.chat_template is not None and tok.chat_template not in templates.values():
        templates["default"] = tok.chat_template
    config = {**tok.tokenizer_config, **{k: v for k, v in tok.special_tokens.items() if v is not None}}
    if len(templates) == 1:
        config["chat_template"] = next(iter(templates.values()))
        (folder / CHAT_TEMPLATE_FILE).write_text(config["chat_template"], encoding="utf-8")
    elif templates:
        config["chat_template"] = [{"name": n, "template": t} for n, t in templates.items()]
    if config:
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if tok._eos_ids is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tok._eos_ids}) + "\n")


def _uses_byte_level(tk) -> bool:
    """Whether the tokenizer maps bytes through GPT-2's table (a ByteLevel pre-tokenizer or decoder)."""
    spec = json.loads(tk.to_str())

    def has(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(spec.get("pre_tokenizer")) or has(spec.get("decoder"))

