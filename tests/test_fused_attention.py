"""``fxmegatron::attention`` (ops/fused_attention.py) and the pass that puts it in place of SDPA
on CUDA (passes/attention_kernel.py): the op equals SDPA in value and gradients (fp32 on the CPU,
the math path; bf16 on a GPU, the fused kernels); the pass takes exactly the nodes its
precondition names; on a GPU the op's gradients stay right after another caller has left a cuDNN
graph for another grad-output layout in the autograd thread's cache (the silent wrong result of
torch's own SDPA there)."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmegatron.ops.fused_attention import attention
from fxmegatron.passes.attention_kernel import fused_attention_kernel
from fxmegatron.passes.attention_rewrites import SDPA


def _qkv(b, h, hkv, s, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    # (b, s, heads, d) storage seen as (b, heads, s, d), as attention modules hand SDPA their heads
    q = torch.randn(b, s, h, d, dtype=dtype, device=device, generator=g).transpose(1, 2)
    k, v = (torch.randn(b, s, hkv, d, dtype=dtype, device=device, generator=g).transpose(1, 2) for _ in range(2))
    return [t.detach().requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])
def test_op_equals_sdpa_in_value_and_gradients(causal, hkv):
    q, k, v = _qkv(2, 4, hkv, 7, 8)
    out = attention(q, k, v, causal, None)[0]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attention(q, k, v, causal, 0.3)[0],
                               F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True))


def test_op_passes_torch_library_opcheck():
    q, k, v = _qkv(1, 4, 2, 5, 8)
    torch.library.opcheck(attention, (q, k, v, True, None))


def _graph(dtype):
    """Five SDPA nodes: eligible (causal, grouped heads), masked, with dropout, causal with fewer
    queries than keys, a head dim of 12 (no fused kernel takes it)."""
    g = fx.Graph()
    mk = lambda name, *shape, dt=dtype: _ph(g, name, torch.empty(shape, dtype=dt, device="meta"))  # noqa: E731
    q, k, k2, v2 = mk("q", 2, 4, 6, 8), mk("k", 2, 2, 6, 8), mk("k2", 2, 4, 6, 8), mk("v2", 2, 4, 6, 8)
    q3, k3 = mk("q3", 2, 4, 3, 8), mk("k3", 2, 4, 6, 8)
    q5 = mk("q5", 2, 4, 6, 12)
    mask = mk("mask", 6, 6, dt=torch.bool)
    outs = [g.call_function(SDPA, (q, k, k), {"is_causal": True, "enable_gqa": True}),
            g.call_function(SDPA, (q, k2, v2, mask)),
            g.call_function(SDPA, (q, k2, v2), {"dropout_p": 0.1}),
            g.call_function(SDPA, (q3, k3, k3), {"is_causal": True}),
            g.call_function(SDPA, (q5, q5, q5), {"is_causal": True})]
    for n in outs:
        args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args]
        n.meta["val"] = torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _ph(g, name, val):
    n = g.placeholder(name)
    n.meta["val"] = val
    return n


def test_the_pass_takes_exactly_the_nodes_its_precondition_names():
    gm = fused_attention_kernel(_graph(torch.bfloat16))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(attention) == 1, targets        # only the unmasked, dropout-free, aligned one
    assert targets.count(SDPA) == 4, targets
    gm32 = fused_attention_kernel(_graph(torch.float32))  # fp32: no fused kernel takes it, SDPA stays
    assert all(n.target is not attention for n in gm32.graph.nodes)


def test_the_rewritten_graph_computes_what_sdpa_did():
    gm = _graph(torch.bfloat16)
    torch.manual_seed(0)
    args = [torch.randn(n.meta["val"].shape).to(n.meta["val"].dtype) if n.meta["val"].dtype != torch.bool
            else torch.ones(n.meta["val"].shape, dtype=torch.bool).tril()
            for n in gm.graph.nodes if n.op == "placeholder"]
    want = gm(*args)
    got = fused_attention_kernel(gm)(*args)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's attention)")
def test_op_gradients_right_after_another_caller_left_a_cudnn_graph_for_another_layout():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _qkv(2, 8, 8, 1024, 128, torch.bfloat16, "cuda", seed=1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):    # another caller: its grad-output unlike its output
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(torch.randn(o.shape, device="cuda", dtype=o.dtype))      # contiguous (b, h, s, d)
    for t in (q, k, v):
        t.grad = None
    do = torch.randn_like(o)                                                # laid out as the output
    ref = torch.autograd.grad(F.scaled_dot_product_attention(*(t.float() for t in (q, k, v)), is_causal=True),
                              (q, k, v), do.float())
    ours = torch.autograd.grad(attention(q, k, v, True, None)[0], (q, k, v), do)
    assert max(_rel(a, b) for a, b in zip(ours, ref)) < 2e-2
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):     # what fxmegatron no longer does: torch's own backward
        theirs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
    print("torch's own SDPA after the other caller: relative error", max(_rel(a, b) for a, b in zip(theirs, ref)))
