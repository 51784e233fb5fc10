"""Reference elementwise chains: each as (derived Chain, input kinds, the eager PyTorch it
stands for). Tests and benchmarks compare the generated kernels against the eager form."""
from __future__ import annotations

import sympy as sp
import torch.nn.functional as F

from .expr import Sigmoid, derive, gelu
from .triton_kernel import FULL, ROW

x0, x1 = sp.symbols("x0 x1", real=True)

REFERENCE_CHAINS = {
    "bias_gelu_tanh": (derive([x0, x1], [gelu(x0 + x1, "tanh")]), [FULL, ROW],
                       lambda a, b: F.gelu(a + b, approximate="tanh")),
    "bias_gelu_erf": (derive([x0, x1], [gelu(x0 + x1)]), [FULL, ROW], lambda a, b: F.gelu(a + b)),
    "swiglu": (derive([x0, x1], [x0 * Sigmoid(x0) * x1]), [FULL, FULL], lambda a, b: F.silu(a) * b),
}
