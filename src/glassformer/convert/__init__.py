"""Import and export of Hugging Face checkpoints (Llama family, GPT-2)."""

from .keymap import LLAMA_KEYS, config_from_hf, config_from_hf_llama, llama_state_from_hf

__all__ = ["LLAMA_KEYS", "config_from_hf", "config_from_hf_llama", "llama_state_from_hf"]

from .heads import convert_kv_heads, pool_heads  # noqa: E402

__all__ += ["convert_kv_heads", "pool_heads"]

from .families import FAMILIES, family_for  # noqa: E402
from .hf import load_hf, save_hf, to_transformers  # noqa: E402

__all__ += ["FAMILIES", "family_for", "load_hf", "save_hf", "to_transformers"]
