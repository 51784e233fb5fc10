"""The bundled GPT (``fxmegatron.models.gpt``), importable from the examples folder as ``gpt``."""
from fxmegatron.models.gpt import GPT, GPTConfig, MLP, Block, SelfAttention  # noqa: F401
