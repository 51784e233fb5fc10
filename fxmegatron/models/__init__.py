"""Models bundled with fxmegatron, written as a single-GPU user writes them (no fxmegatron
imports): the trainer's ``model.kind = "gpt"``."""
