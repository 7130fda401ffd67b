"""What the GGUF tests share: tokenizers laid out as Llama 3's, Qwen2's and GPT-2's tokenizer.json
are (trained here on a few sentences, so nothing is downloaded), tiny random transformers models
over them, imported with `convert --from-hf`, and the 50 texts whose token ids llama.cpp must match.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch

from glassformer.cli import main
from glassformer.convert.gguf_tokenizer import LLAMA3_REGEX, QWEN2_REGEX
from glassformer.text.chat_template import CHATML_TEMPLATE

from ..support import synthetic_text

# Scripts, whitespace runs, digits, contractions, punctuation, code and special tokens.
TEXTS = [
    "Hello world", "hello  world", "  leading spaces", "trailing spaces   ", "tabs\tand\t\ttabs",
    "new\nline", "two\n\nlines", "mixed \n \t whitespace \n\n ", "\n", "   ",
    "1", "12", "123", "1234", "12345678", "3.14159", "1,234,567.89", "phone 555-0199 ext. 42", "x2 y22 z222", "2024-06-01",
    "it's", "IT'S", "we're they've I'm you'll he'd", "don't 'quote' \"double\"", "The king's sword.",
    "café naïve façade", "Ελληνικά γράμματα", "Русский текст", "العربية", "עברית",
    "हिन्दी", "ภาษาไทย", "中文字符测试", "日本語のひらがなとカタカナ", "한국어 텍스트",
    "emoji 😀🎉 and 👍🏽", "math ∑ ∫ √ ≤ ≥", "symbols @#$%^&*()_+-=[]{}|;:,.<>?/~`",
    "def f(x):\n    return x ** 2\n", "if (a && b) { c(); }",
    "<|endoftext|>", "before<|endoftext|>after", "two <|endoftext|> <|endoftext|> specials",
    "<|im_start|>user\nhi<|im_end|>\n", "a<|im_end|>b",
    "The old man sings of the sea and the stars above the hill.",
    "UPPER lower MiXeD", "a\u00a0non-breaking space", "zero\u200bwidth", "end.",
]

# Pieces random strings are drawn from: the characters the pre-tokenizers' regexes tell apart.
PIECES = (list("abcXYZ  \t\n\r0123456789'\".,;!?-_()[]{}<>/\\@#$%^&*+=~`éàüßñçÉΑβγДжЯ中文字日本한국")
          + ["😀", "👍🏽", "\u0301", "\u00a0", "\u2028", "\u0085", "\u3000", "\u200b", "'s", "'S", "'ll", "<|endoftext|>",
             "   ", "\n\n", " \n", "१२३", "٣"])


def random_texts(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30))) for _ in range(n)]


PROMPT = "The king and queen walk to the castle where"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


def _train_tokenizer(model, pre, specials, vocab_size=400, normalizer=None, post=None):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers

    tk = Tokenizer(model)
    tk.pre_tokenizer = pre
    tk.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tk.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([synthetic_text(300, 1), " ".join(TEXTS)], trainer=trainer)
    if post is not None:
        tk.post_processor = post
    return tk


def llama3_tokenizer():
    from tokenizers import Regex, models, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    post = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    tk = _train_tokenizer(models.BPE(ignore_merges=True), pre, specials, post=post)
    spec = json.loads(tk.to_str())
    spec["model"]["ignore_merges"] = True  # as Llama 3's tokenizer.json says
    return json.dumps(spec, ensure_ascii=False), {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                                  "chat_template": LLAMA3_CHAT}


def qwen2_tokenizer():
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk = _train_tokenizer(models.BPE(), pre, ["<|endoftext|>", *CHAT_TOKENS], normalizer=normalizers.NFC())
    return tk.to_str(), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN2_CHAT}


def gpt2_tokenizer():
    from tokenizers import models, pre_tokenizers

    tk = _train_tokenizer(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"])
    return tk.to_str(), {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


def smollm_tokenizer():
    from tokenizers import models, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return _train_tokenizer(models.BPE(), pre, ["<|endoftext|>", *CHAT_TOKENS]).to_str(), {}


def sentencepiece_tokenizer():
    """Llama 2 / Mistral / TinyLlama's layout: '▁' for spaces, byte fallback through <0xNN> pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>", *bytes_], show_progress=False)
    tk.train_from_iterator([synthetic_text(300, 1), " ".join(TEXTS[:30])], trainer=trainer)
    spec = json.loads(tk.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in bytes_]  # vocabulary pieces, as Llama 2's
    return json.dumps(spec, ensure_ascii=False), {"bos_token": "<s>", "eos_token": "</s>"}


# As Meta's Llama 3 Instruct and Qwen2 Instruct templates render (trimmed of their tool-calling parts).
LLAMA3_CHAT = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_CHAT = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _random_weights(hf, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name or "ln_" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return hf


def hf_fixture(root: Path, family: str) -> Path:
    """A tiny random transformers model of `family` with its family's tokenizer layout, imported
    with `convert --from-hf`: the glassformer checkpoint folder."""
    import transformers

    tok_json, tok_config = {"llama": llama3_tokenizer, "qwen2": qwen2_tokenizer, "gpt2": gpt2_tokenizer}[family]()
    vocab = json.loads(tok_json)
    n_vocab = max([*vocab["model"]["vocab"].values(), *(a["id"] for a in vocab["added_tokens"])]) + 1
    torch.manual_seed(0)
    if family == "gpt2":
        eot = vocab["model"]["vocab"]["<|endoftext|>"]
        cfg = transformers.GPT2Config(vocab_size=n_vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=eot, eos_token_id=eot)
        hf = transformers.GPT2LMHeadModel(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=True, rope_theta=1000000.0)
        hf = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       rope_theta=500000.0, tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(cfg)
    hf = _random_weights(hf.eval(), seed=1)
    folder = root / f"hf-{family}"
    hf.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False), encoding="utf-8")
    ckpt = root / f"ckpt-{family}"
    assert main(["convert", "--from-hf", str(folder), "--out", str(ckpt)]) == 0
    return ckpt


def trained_checkpoint(root: Path) -> Path:
    """The tiny preset trained here for a few seconds on synthetic sentences, with its own tokenizer
    (the ChatML tokens and template added, as `prepare --chat` does): the run's latest checkpoint."""
    from glassformer.checkpoint.folders import resolve
    from glassformer.text.tokenizer import Tokenizer

    from ..support import make_prepared

    data = make_prepared(root / "data")
    run = root / "run"
    assert main(["train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--max-steps", "150",
                 "--batch-size", "8", "--seq-len", "64", "--lr", "1e-2", "--eval-every", "0", "--no-progress",
                 "--threads", "1"]) == 0
    ckpt = resolve(run)
    tok = Tokenizer.from_folder(ckpt)
    tok.chat_templates = {"default": CHATML_TEMPLATE}
    tok.select_template()
    tok.special_tokens["eos_token"] = "<|endoftext|>"
    tok.save_folder(ckpt)  # the same tokenizer.json, now with its tokenizer_config.json
    return ckpt


def nfc(texts):
    return [unicodedata.normalize("NFC", t) for t in texts]


def exported_families(root: Path, families: dict, dtypes=("f32",)) -> dict:
    """family -> (our model, its tokenizer, {dtype: GGUF file}) for each entry (transformers config class,
    arguments over family_parity.tiny(), graph) of `families`: a tiny random transformers model over
    Qwen2's tokenizer layout, imported with `convert --from-hf`, exported with `convert --to-gguf`."""
    import transformers

    from glassformer.checkpoint.loading import load

    from .family_parity import hf_random, tiny

    tok_json, tok_config = qwen2_tokenizer()
    spec = json.loads(tok_json)
    n_vocab = max([*spec["model"]["vocab"].values(), *(a["id"] for a in spec["added_tokens"])]) + 1
    out = {}
    for family, (kind, kw, _) in families.items():
        hf = hf_random(getattr(transformers, kind)(**tiny(**{**kw, "vocab_size": n_vocab, "max_position_embeddings": 128})))
        folder = root / f"hf-{family}"
        hf.save_pretrained(folder)
        (folder / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config), encoding="utf-8")
        # Not named after the family: llama.cpp looks up Phi-3's <|end|> token in a model whose name says
        # phi3, and this vocabulary (Qwen2's layout) has none.
        ckpt = root / f"ckpt-{len(out)}"
        assert main(["convert", "--from-hf", str(folder), "--out", str(ckpt)]) == 0
        paths = {dtype: root / f"{len(out)}-{dtype}.gguf" for dtype in dtypes}
        for dtype, path in paths.items():
            assert main(["convert", "--to-gguf", str(ckpt), "--out", str(path), "--dtype", dtype]) == 0
        model, tok = load(ckpt)
        out[family] = (model, tok, paths)
    return out


def llama_f32(path, vocab_only: bool = False):
    """llama.cpp (llama-cpp-python) over a GGUF file, its KV cache in f32, every position's logits kept."""
    import llama_cpp

    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, n_threads=2, n_threads_batch=2, vocab_only=vocab_only,
                           logits_all=True, type_k=f32, type_v=f32, flash_attn=False, verbose=False, seed=0)


def llama_and_ours(model, path, ids: list[int], steps: int = 0):
    """llama.cpp's logits at every position of `ids` from the GGUF file at `path` and ours, as float64 arrays
    (T, V), then `steps` greedy tokens from each (llama.cpp's from its own cache, ours from greedy_cached)."""
    import numpy as np

    from ..support import greedy_cached

    llm = llama_f32(path)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    theirs = []
    for _ in range(steps):
        theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([theirs[-1]])
    llm.close()
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0][0].double().numpy()
        ours = greedy_cached(model, torch.tensor([ids]), steps) if steps else []
    return got, want, theirs, ours

