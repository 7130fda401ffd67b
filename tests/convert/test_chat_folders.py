"""A Hugging Face instruct folder's chat template, special tokens and eos list survive
`convert --from-hf` then `--to-hf`, and transformers renders the same ids from the export."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from glassformer.checkpoint.loading import load  # noqa: E402
from glassformer.cli import main  # noqa: E402

from ..text.test_chat_template import LLAMA3, STYLES, chat_tokenizer_json  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What say you, my lord? 東京 🙂"},
    {"role": "assistant", "content": "To be, or not to be."},
    {"role": "user", "content": ""},
]


def hf_instruct_folder(folder, tok_json: str):
    """A tiny random Llama saved by transformers, with the tokenizer files an instruct model ships."""
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tok_json)
    special = STYLES["llama3"][1]
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3, "model_max_length": 64, **special}))
    eos = [tok.tk.token_to_id("<|eot_id|>"), tok.tk.token_to_id("<|endoftext|>")]
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos, "temperature": 0.6}))
    return eos


def rendered_by_transformers(folder, prompt: bool) -> list[int]:
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    return list(hf.apply_chat_template(MESSAGES, add_generation_prompt=prompt, return_dict=True)["input_ids"])


def test_chat_template_and_eos_list_round_trip(tmp_path):
    tok_json = chat_tokenizer_json()
    src, ours, out = tmp_path / "hf", tmp_path / "ours", tmp_path / "export"
    eos = hf_instruct_folder(src, tok_json)
    assert main(["convert", "--from-hf", str(src), "--out", str(ours)]) == 0
    assert main(["convert", "--to-hf", str(ours), "--out", str(out)]) == 0

    for folder in (src, ours, out):
        _, tok = load(folder)
        assert tok.chat_template == LLAMA3 and tok.eos_ids == eos
        assert tok.special_tokens == STYLES["llama3"][1]
    # The checkpoint keeps the source's tokenizer files as they were (exact bytes).
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ours / name).read_bytes() == (src / name).read_bytes()
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == eos
    for prompt in (False, True):
        ref = rendered_by_transformers(src, prompt)
        assert rendered_by_transformers(out, prompt) == ref
        assert load(out)[1].apply_chat_template(MESSAGES, add_generation_prompt=prompt) == ref


def test_export_of_a_tokenizer_object_writes_its_configs(tmp_path):
    from glassformer.convert.hf import save_hf
    from glassformer.text.chat_template import CHATML_TEMPLATE
    from glassformer.text.tokenizer import Tokenizer

    from ..support import tiny_model
    from ..text.test_chat_template import TEXT

    tok = Tokenizer.train([TEXT], vocab_size=300)
    tok.add_chat_tokens()
    tok.chat_template = CHATML_TEMPLATE
    save_hf(tiny_model(vocab_size=tok.vocab_size), tmp_path / "hf", tok)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = MESSAGES[:3]
    ref = hf.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert tok.apply_chat_template(messages, return_assistant_mask=True) == (list(ref["input_ids"]), list(ref["assistant_masks"]))
    assert hf.eos_token == "<|im_end|>"
