"""fxmegatron's torch.library ops against their fake implementations (``torch.library.opcheck``).

Under ``torch.compile`` inductor plans every buffer from an op's fake implementation: an output
whose real strides differ from the fake's is read as if laid out otherwise, a silent wrong
number. opcheck runs each op on real and on fake tensors and compares shapes, dtypes and strides
(``test_faketensor``), checks the schema (mutations declared) and the autograd registration.
Inputs come dense and as transposed views, as the graphs hand them over (q as a transpose of
[B, S, H, D], a weight read through ``.t()``). The ops that need process groups, CUDA or
generated kernels (collectives, FP8, overlapped linears, fused groups) are not here; the cp
attention op has its own test in ``test_context_attention.py``.
"""
import pytest
import torch

import fxmegatron.kernels.cross_entropy  # noqa: F401  (registers the ops)
import fxmegatron.ops.computed_once  # noqa: F401
import fxmegatron.ops.fused_attention  # noqa: F401
import fxmegatron.ops.gemm_epilogue  # noqa: F401
import fxmegatron.ops.moe_capacity  # noqa: F401

ops = torch.ops.fxmegatron
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _bshd(b, s, h, d):
    """[B, H, S, D] as a transpose of a dense [B, S, H, D]."""
    return torch.randn(b, s, h, d).transpose(1, 2)


def _attention_cases():
    torch.manual_seed(0)
    for q, k, v in ((_bshd(1, 8, 4, 16), _bshd(1, 8, 2, 16), _bshd(1, 8, 2, 16)),
                    (torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))):
        out, lse = ops.attention(q, k, v, True, None)
        yield "attention", ops.attention.default, (q, k, v, True, None)
        yield "attention_backward", ops.attention_backward.default, (torch.randn_like(out), q, k, v, out, lse, True,
                                                                     None)


def _cases():
    yield from _attention_cases()
    pre = torch.randn(16, 8)
    yield "gelu_backward_bias", ops.gelu_backward_bias.default, (torch.randn(16, 8), pre)
    yield "gelu_backward_bias (transposed)", ops.gelu_backward_bias.default, (torch.randn(8, 16).t(),
                                                                               torch.randn(8, 16).t())
    yield "linear_gelu", ops.linear_gelu.default, (torch.randn(2, 4, 8), torch.randn(12, 8), torch.randn(12))
    yield "linear_gelu (weight transposed)", ops.linear_gelu.default, (torch.randn(2, 4, 8), torch.randn(8, 12).t(),
                                                                        torch.randn(12))
    ids = torch.randint(0, 4, (6, 2))
    yield "moe_capacity_keep", ops.moe_capacity_keep.default, (ids, torch.rand(6, 2), 4, 2)
    yield "moe_capacity_keep (transposed weights)", ops.moe_capacity_keep.default, (ids, torch.rand(2, 6).t(), 4, 2)
    yield "computed_once", ops.computed_once.default, (torch.randn(4, 6).t(),)


CASES = list(_cases())


@pytest.mark.parametrize("name,op,args", CASES, ids=[c[0] for c in CASES])
def test_each_op_computes_what_its_fake_says(name, op, args):
    torch.library.opcheck(op, args, test_utils=CHECKS)


@pytest.mark.parametrize("logits", [torch.randn(5, 7), torch.randn(7, 5).t()], ids=["dense", "transposed"])
def test_the_loss_kernels_compute_what_their_fakes_say(logits, triton_interpreter):
    target, valid = torch.randint(0, 7, (5,)), torch.ones(5, dtype=torch.bool)
    torch.library.opcheck(ops.vocab_ce.default, (logits, target, valid, ""), test_utils=CHECKS)
    _, lse = ops.vocab_ce(logits, target, valid, "")
    torch.library.opcheck(ops.vocab_ce_backward.default, (logits, target, lse, torch.rand(5)), test_utils=CHECKS)


def test_opcheck_catches_a_fake_with_other_strides():
    # the check can fail: an op whose fake says dense while the real output is a transpose
    lib = torch.library.Library("fxmegatron_test_fakes", "FRAGMENT")
    lib.define("tr(Tensor x) -> Tensor")
    lib.impl("tr", lambda x: x.t().contiguous().t(), "CompositeExplicitAutograd")
    torch.library.register_fake("fxmegatron_test_fakes::tr", lambda x: x.new_empty(x.shape), lib=lib)
    with pytest.raises(Exception, match="[Ss]tride"):
        torch.library.opcheck(torch.ops.fxmegatron_test_fakes.tr.default, (torch.randn(3, 4),), test_utils=CHECKS)
