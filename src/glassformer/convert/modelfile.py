"""An Ollama Modelfile beside a GGUF file (`FILE.Modelfile`): FROM, the chat TEMPLATE in Go's
template syntax, `PARAMETER stop` for the template's end-of-turn tokens, `PARAMETER num_ctx`.

Ollama runs Go templates, not the Jinja ones tokenizers carry, so a template is recognised by
what it renders for a probe conversation and written in one of four known styles: glassformer's
own default (ChatML without a system prompt), ChatML (with the default system prompt the template
adds, if any), Llama 3 and Mistral. Any other template gets no TEMPLATE line: Ollama then reads
the GGUF file's own chat template (docs/convert.md#ollama).
"""

from __future__ import annotations

from ..text.chat_template import CHATML_TEMPLATE, render

# A conversation whose texts cannot be mistaken for template text.
_PROBE = [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

_CHATML = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
           "<|im_start|>assistant\n")
_CHATML_SYSTEM = ('{{- if ne (index .Messages 0).Role "system" }}<|im_start|>system\n%s<|im_end|>\n{{ end }}'
                  + _CHATML)
_LLAMA3 = ("{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
           "<|start_header_id|>assistant<|end_header_id|>\n\n")
_MISTRAL = ('{{- range $i, $m := .Messages }}{{ if eq $m.Role "user" }}[INST] '
            '{{ if and $.System (eq $i 0) }}{{ $.System }}\n\n{{ end }}{{ $m.Content }} [/INST]'
            '{{ else if eq $m.Role "assistant" }}{{ $m.Content }}</s>{{ end }}{{ end }}')

# style -> (Go template, the end-of-turn token a reply stops at)
STYLES = {"glassformer": (_CHATML, "<|im_end|>"), "chatml": (_CHATML, "<|im_end|>"),
          "llama3": (_LLAMA3, "<|eot_id|>"), "mistral": (_MISTRAL, "</s>")}


def _render(template: str, messages: list[dict]) -> str | None:
    from ..errors import UserError

    try:
        return render(template, messages, add_generation_prompt=True, special=_SPECIAL)
    except UserError:  # a template that refuses the probe (e.g. demands a system turn) is not a known style
        return None


def _chatml_system(template: str) -> str | None:
    """The system prompt a ChatML template puts in when the conversation has none (None: none)."""
    text = _render(template, _PROBE[:1]) or ""
    head = "<|im_start|>system\n"
    if not text.startswith(head):
        return None
    return text[len(head): text.index("<|im_end|>")]


def chat_style(template: str | None) -> str | None:
    """Which of STYLES the Jinja template renders like, or None.

    >>> chat_style(CHATML_TEMPLATE)
    'glassformer'
    """
    if template is None:
        return None
    if template == CHATML_TEMPLATE:
        return "glassformer"
    text = _render(template, _PROBE)
    if text is None:
        return None
    chatml = "<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
    if chatml in text and text.endswith("<|im_start|>assistant\n"):
        return "chatml"
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    llama3 = h.format("user") + "U1<|eot_id|>" + h.format("assistant") + "A1<|eot_id|>" + h.format("user") + "U2<|eot_id|>"
    if llama3 in text and text.endswith(h.format("assistant")):
        return "llama3"
    if "[INST] U1 [/INST]" in text and "A1</s>" in text and text.rstrip().endswith("[INST] U2 [/INST]"):
        return "mistral"
    return None


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile(gguf_name: str, num_ctx: int, template: str | None, eos_tokens: list[str]) -> tuple[str, str | None]:
    """(the Modelfile's text, a note or None) for the GGUF file `gguf_name` beside it.

    >>> print(modelfile("m.gguf", 256, None, ["<|endoftext|>"])[0], end="")
    FROM ./m.gguf
    PARAMETER stop "<|endoftext|>"
    PARAMETER num_ctx 256
    """
    style = chat_style(template)
    lines = [f"FROM ./{gguf_name}"]
    stops = []
    note = None
    if style is not None:
        go, end = STYLES[style]
        system = _chatml_system(template) if style == "chatml" else None
        if system:
            go = _CHATML_SYSTEM % system.replace("{{", "{{`{{`}}")
        lines.append(f'TEMPLATE """{go}"""')
        stops.append(end)
    elif template is not None:
        note = ("the chat template is none of the styles glassformer writes for Ollama (its own, ChatML, Llama 3, "
                "Mistral): the Modelfile has no TEMPLATE, so Ollama reads the GGUF file's own chat template")
    stops += [t for t in eos_tokens if t not in stops]
    lines += [f"PARAMETER stop {_quote(s)}" for s in stops]
    lines.append(f"PARAMETER num_ctx {num_ctx}")
    return "\n".join(lines) + "\n", note


# --dtype's spellings -> GGUF's type names
_GGUF_NAMES = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "bfloat16": "bf16"}


def export_with_modelfile(src, out, dtype: str | None = None, progress: bool = True) -> int:
    """`convert --to-gguf SRC --out FILE.gguf [--dtype]`: the GGUF file and FILE.Modelfile beside it,
    each written whole or not at all; prints what was written and any note."""
    from pathlib import Path

    from ..errors import UserError
    from ..files import atomic_text
    from .gguf import export_gguf

    out = Path(out)
    side = out.with_suffix(".Modelfile")
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new file name or remove it first")
    if side.exists():
        raise UserError(f"{side} already exists; choose a new --out name or remove it first")
    source, arch, dtype = export_gguf(src, out, _GGUF_NAMES.get(dtype, dtype), progress=progress)
    tok = source.tokenizer
    eos = [tok.tk.id_to_token(i) for i in tok.eos_ids] if tok is not None else []
    text, note = modelfile(out.name, source.config.max_seq_len, getattr(tok, "chat_template", None), eos)
    try:
        atomic_text(side, text)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    for line in source.notes + ([note] if note else []):
        print(f"note: {line}")
    print(f"wrote {out}: GGUF ({arch}, {dtype}), {source.config.vocab_size:,} tokens, {source.config.n_layers} layers; "
          f"and {side.name} (ollama create NAME -f {side})")
    return 0
