"""Reference elementwise chains: each a derived ``Chain``, its input kinds, the eager PyTorch it
stands for, and how to make inputs for an output shape. Tests and benchmarks compare the
generated kernels against the eager form."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import sympy as sp
import torch
import torch.nn.functional as F

from fxmegatron.codegen.chain_source import BCAST, FULL, KEY, ROW
from fxmegatron.codegen.expr import DropoutSite, Sigmoid, derive, gelu, rotate_half, rotate_symbol
from fxmegatron.ops.dropout import DropoutRng, counter_dropout

x0, x1, x2, x3 = sp.symbols("x0:4", real=True)
m0 = sp.Symbol("m0", real=True)
DROPOUT_P = 0.1
SCALE = 0.125
MASKED = -10000.0


@dataclass
class Reference:
    chain: object
    kinds: Sequence[str]
    eager: Callable
    shape: Callable[[int, int], Tuple[int, ...]] = lambda rows, cols: (rows, cols)
    bcast: Optional[Callable[[Tuple[int, ...]], Tuple[int, ...]]] = None   # a bcast input's shape
    bool_mask: bool = False      # the bcast input is a boolean mask

    def inputs(self, shape, dtype=torch.float32, device="cpu", generator=None):
        """Inputs for an output of ``shape``: floats ~ N(0, 3²), bool masks, a dropout key."""
        out = []
        for k in self.kinds:
            if k == KEY:
                out.append(DropoutRng(seed=7).next_key(device))
            elif k == ROW:
                out.append(torch.randn(shape[-1], generator=generator).to(device, dtype))
            elif k == BCAST and self.bool_mask:
                out.append(torch.rand(self.bcast(shape), generator=generator).to(device) > 0.3)
            elif k == BCAST:
                out.append(torch.randn(self.bcast(shape), generator=generator).to(device, dtype))
            else:
                out.append((3 * torch.randn(shape, generator=generator)).to(device, dtype))
        return out


def _bias_dropout_residual(x, b, r, key):
    return r + counter_dropout(x + b, DROPOUT_P, True, key, 0, tuple(x.shape))


def _rotary(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def _scale_mask_fill(s, mask):
    return torch.masked_fill(s * SCALE, mask, MASKED)


def _attention_4d(rows, cols):
    return (2, rows, 3, cols)


REFERENCE_CHAINS = {
    "bias_gelu_tanh": Reference(derive([x0, x1], [gelu(x0 + x1, "tanh")]), [FULL, ROW],
                                lambda a, b: F.gelu(a + b, approximate="tanh")),
    "bias_gelu_erf": Reference(derive([x0, x1], [gelu(x0 + x1)]), [FULL, ROW], lambda a, b: F.gelu(a + b)),
    "swiglu": Reference(derive([x0, x1], [x0 * Sigmoid(x0) * x1]), [FULL, FULL], lambda a, b: F.silu(a) * b),
    "bias_dropout_residual": Reference(
        derive([x0, x1, x2, x3], [x2 + (x0 + x1) * m0 * sp.Float(1 / (1 - DROPOUT_P))],
               [DropoutSite(m0, 3, 0, DROPOUT_P, ())]),
        [FULL, ROW, FULL, KEY], _bias_dropout_residual),
    "rotary": Reference(
        derive([x0, x1, x2], [x0 * x1 + rotate_symbol(0) * x2], rotated={0: rotate_symbol(0)}),
        [FULL, BCAST, BCAST], _rotary, shape=lambda rows, cols: (2, rows, 3, 2 * cols),
        bcast=lambda s: (s[0], 1, s[2], s[3])),
    "scale_mask_add": Reference(derive([x0, x1], [x0 * sp.Float(SCALE) + x1]), [FULL, BCAST],
                                lambda s, m: s * SCALE + m, shape=_attention_4d,
                                bcast=lambda s: (s[0], 1, s[2], s[3])),
    "scale_mask_fill": Reference(
        derive([x0, x1], [sp.Piecewise((sp.Float(MASKED), sp.StrictGreaterThan(x1, sp.Float(0.5))),
                                       (x0 * sp.Float(SCALE), True))]),
        [FULL, BCAST], _scale_mask_fill, shape=_attention_4d, bcast=lambda s: (1, 1, s[2], s[3]),
        bool_mask=True),
}
