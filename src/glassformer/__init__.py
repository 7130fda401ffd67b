"""glassformer: a decoder-only transformer you can train, run, price and see inside."""

__version__ = "0.1.0"

from .config import PRESETS, ModelConfig  # noqa: E402
from .kv_cache import KVCache  # noqa: E402
from .model import Transformer  # noqa: E402
from .tracing.trace import trace  # noqa: E402
from .explaining.explain import explain  # noqa: E402
from .generation import generate  # noqa: E402  (the function; the module is glassformer.generation)
from .generation.chat import chat, chat_stream  # noqa: E402
from .checkpoint.loading import load  # noqa: E402
from .text.tokenizer import Tokenizer  # noqa: E402

__all__ = ["ModelConfig", "PRESETS", "Transformer", "KVCache", "trace", "explain", "generate", "chat", "chat_stream",
           "load", "Tokenizer",
           "__version__"]
