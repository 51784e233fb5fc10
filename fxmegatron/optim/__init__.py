"""Optimizers: FusedAdamW (mixed-precision AdamW in one multi-tensor kernel per group)."""
from fxmegatron.optim.fused_adamw import FusedAdamW, clip_coefficient

__all__ = ["FusedAdamW", "clip_coefficient"]
