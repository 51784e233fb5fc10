"""The GEMM-epilogue rewrite on a tensor-parallel program against the unmodified model."""
import copy

import torch

from tests import models
from tests.workers.common import side_by_side, tp_mesh


def epilogue_parity(rank, world, name, steps, parallel_kwargs):
    """``steps`` AdamW steps at tp=world with ``passes.gelu_formula`` and
    ``passes.gemm_epilogues`` applied to the rank's graph (fp32 let in: on CPU the op is the
    ATen ops, so this checks the rewrite of a column-parallel linear, or Conv1D, and its GeLU)
    and of the unmodified model."""
    import fxmegatron
    from fxmegatron.passes.gelu_formula import gelu_formula_to_op
    from fxmegatron.passes.gemm_epilogues import apply_gemm_epilogues

    model = models.build(name)
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(model, tp_mesh(world), models.batch(name), **parallel_kwargs)
    gelu_formula_to_op(pm.graph_module)
    rewritten = apply_gemm_epilogues(pm.graph_module, dtypes=(torch.float32,))
    r = side_by_side(pm, ref, lambda i: models.batch(name, seed=i), steps)
    return {**r, "rewritten": rewritten}
