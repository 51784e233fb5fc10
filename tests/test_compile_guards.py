"""``passes.compile_guards``: a compiled CUDA program whose loss reads logits rows that are not
a multiple of 128 bytes is refused, naming the loss node, its module and the way out; aligned
rows pass, and the check runs only for compiled CUDA programs."""
import pytest
import torch

import fxmegatron
from fxmegatron.errors import CompileError
from fxmegatron.passes.compile_guards import refuse_known_miscompiles
from tests.families import FAMILIES, make_batch


def _graph(vocab, dtype=torch.float32):
    fam = FAMILIES["gpt2"]
    pm = fxmegatron.parallelize(fam.build(n_layer=1, vocab_size=vocab).to(dtype), None, make_batch(fam, 0))
    return pm.graph_module


@pytest.mark.parametrize("vocab,dtype", [(2048, torch.float32), (2080, torch.float32), (2112, torch.bfloat16)])
def test_aligned_logits_rows_pass(vocab, dtype):
    assert refuse_known_miscompiles(_graph(vocab, dtype)) == 1


@pytest.mark.parametrize("vocab,dtype,multiple", [(2053, torch.float32, 32), (2080, torch.bfloat16, 64),
                                                  (50257, torch.bfloat16, 64)])
def test_unaligned_logits_rows_are_refused_by_name(vocab, dtype, multiple):
    with pytest.raises(CompileError) as err:
        refuse_known_miscompiles(_graph(vocab, dtype))
    msg = str(err.value)
    assert f"rows of {vocab} " in msg and f"pad_to_multiple_of={multiple}" in msg, msg
    assert "the loss cross_entropy" in msg and "logits of lm_head" in msg and "compile=False" in msg, msg


def test_under_tensor_parallelism_the_way_out_counts_every_rank():
    # each rank's V/t columns must be aligned: 32 fp32 columns a rank is 64 in all at tp=2
    with pytest.raises(CompileError, match="pad_to_multiple_of=64"):
        refuse_known_miscompiles(_graph(2053), tp=2)


def test_the_compiler_checks_compiled_cuda_programs_only():
    from fxmegatron.compiler import rank_passes
    from fxmegatron.config import ParallelConfig
    from fxmegatron.mesh import Axis
    axes = {"tp": Axis(), "pp": Axis(), "dp": Axis()}
    names = lambda cfg, device: [p.name for p in rank_passes(None, axes, cfg, device)]   # noqa: E731
    assert "refuse_known_miscompiles" in names(ParallelConfig(compile=True), "cuda")
    assert "refuse_known_miscompiles" not in names(ParallelConfig(compile=True), "cpu")
    assert "refuse_known_miscompiles" not in names(ParallelConfig(), "cuda")
