"""A model factory for `fxmegatron compile` tests: (model, example_batch)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

ROWS, SEQ = 8, 16


def build():
    torch.manual_seed(1234)
    model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=64))
    tokens = torch.zeros(ROWS, SEQ, dtype=torch.long)
    return model, (tokens, tokens)
