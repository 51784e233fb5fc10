"""parallelize(compile=True): each rank's graph through torch.compile (inductor on CPU here).
Equal losses and gradients to the uncompiled graph, dropout included (the key is made
outside the compiled graph, so a new step does not recompile); with fuse=True, each fused
group one opaque call in the compiled graphs, running fxmegatron's generated kernels."""
import copy

import pytest
import torch

import fxmegatron
from fxmegatron.codegen.fused_chain import FusedChain

from . import models

# the generated kernels run on the tests' CPU tensors in Triton's interpreter (conftest.py's
# triton_interpreter, offered on a machine without CUDA); elsewhere the fused groups run, and
# compile, as ATen ops
pytestmark = pytest.mark.usefixtures("triton_interpreter")
_KERNELS_RUN = not torch.cuda.is_available()


def test_compiled_graph_equals_the_uncompiled_one_and_compiles_once():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = models.build("gpt", dropout=0.1, n_layer=1)
    runs = []
    for compile in (False, True):
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"), compile=compile, seed=5)
        steps = []
        for s in range(3):      # three steps: three dropout keys
            loss = pm(models.batch("gpt", seed=s))
            loss.backward()
            steps.append((loss.item(), {k: g.clone() for k, g in pm.full_grads().items()}))
            for p in pm.parameters():
                p.grad = None
        runs.append(steps)
    for (l0, g0), (l1, g1) in zip(*runs):
        assert l1 == pytest.approx(l0, rel=1e-5)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6)
    assert runs[0][0][0] != runs[0][1][0]                 # the steps differ (dropout, batch)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _train(name, model, steps=3, **options):
    """(loss, full gradients) of ``steps`` steps on different batches (dropout: new masks)."""
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name), seed=5, **options)
    out = []
    for s in range(steps):
        loss = pm(models.batch(name, seed=s))
        loss.backward()
        out.append((loss.item(), {k: g.clone() for k, g in pm.full_grads().items()}))
        for p in pm.parameters():
            p.grad = None
    return out


def _count(method, calls):
    def counted(*args, **kwargs):
        calls.append(method.__name__)
        return method(*args, **kwargs)
    return counted


@pytest.mark.parametrize("name,recompute", [("gpt", "none"), ("gpt", "selective"), ("llama", "full")])
def test_fuse_and_compile_together_equal_the_plain_graph(name, recompute, monkeypatch):
    """fuse=True with compile=True: the fused groups run their generated kernels (the interpreter
    here) as calls inside the inductor-compiled graph; the losses and gradients are those of
    the plain graph (counter-based dropout: the kernels draw the unfused masks), one graph per
    compiled module and no graph break but the dropout key's (made outside the graph)."""
    from torch._dynamo.utils import counters
    model = models.build(name, dropout=0.1, n_layer=1)
    ref = _train(name, model, recompute=recompute)
    torch._dynamo.reset()
    counters.clear()
    ran = []
    for step in ("forward", "backward"):     # the generated kernels run, called from the compiled graph
        monkeypatch.setattr(FusedChain, step, _count(getattr(FusedChain, step), ran))
    got = _train(name, model, recompute=recompute, fuse=True, compile=True)
    assert {"forward", "backward"} <= set(ran) or not _KERNELS_RUN
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert l1 == pytest.approx(l0, rel=1e-5)
        assert g1.keys() == g0.keys()
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6)
    assert ref[0][0] != ref[1][0]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert all("rng_key" in why for why in counters["graph_break"]), dict(counters["graph_break"])


@pytest.mark.skipif(not _KERNELS_RUN, reason="CPU tensors run fused groups' ATen ops without the interpreter")
@pytest.mark.parametrize("name,recompute", [("gpt", "none"), ("llama", "full")])
def test_each_fused_group_is_one_call_in_the_compiled_graphs(name, recompute):
    """Dynamo's graph holds one ``fxmegatron::fused_forward`` per fused group (recomputed regions'
    included) and traces none of them; AOTAutograd's backward graph one ``fused_backward``
    per group, and the forward again for each recomputed one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from fxmegatron.passes.fuse import Fused
    from fxmegatron.passes.recompute import Recomputed
    from fxmegatron.lower.torch_compile import compile_graph

    torch._dynamo.reset()
    pm = fxmegatron.parallelize(models.build(name, dropout=0.1, n_layer=1), None, models.batch(name),
                                fuse=True, recompute=recompute)
    graphs = {"dynamo": [], "forward": [], "backward": []}

    def record(kind):
        def compiler(g, example_inputs):
            graphs[kind].append(g)
            return make_boxed_func(g.forward)
        return compiler
    aot = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))

    def backend(g, example_inputs):
        graphs["dynamo"].append(g)
        return aot(g, example_inputs)
    compile_graph(pm.graph_module, backend=backend)
    pm(models.batch(name, seed=1)).backward()

    def calls(kind, op):
        return sum(n.target is op for g in graphs[kind] for m in g.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes)
    fused = [m for m in pm.graph_module.modules() if isinstance(m, Fused)]
    recomputed = [f for r in pm.graph_module.modules() if isinstance(r, Recomputed) for f in r.body.modules()
                  if isinstance(f, Fused)]
    fwd, bwd = torch.ops.fxmegatron.fused_forward.default, torch.ops.fxmegatron.fused_backward.default
    assert len(fused) >= 3 and (recompute == "none" or recomputed)
    assert [len(graphs[k]) for k in graphs] == [1, 1, 1]
    assert calls("dynamo", fwd) == calls("forward", fwd) == len(fused)
    assert calls("backward", bwd) == len(fused) and calls("backward", fwd) == len(recomputed)
    # what the groups compute is not traced into the graph: no rsqrt (Llama's RMSNorm is fused)
    assert all(n.target is not torch.ops.aten.rsqrt.default for g in graphs["forward"] for n in g.graph.nodes)


@pytest.mark.skipif(not _KERNELS_RUN, reason="CPU tensors run the loss's torch form without the interpreter")
def test_the_fused_cross_entropy_stays_one_op_in_the_compiled_graph():
    # in the interpreter (conftest) as on a GPU: dynamo keeps fxmegatron::vocab_ce as a call
    # instead of tracing the unfused fp32 form
    pm = fxmegatron.parallelize(models.build("gpt", n_layer=1), None, models.batch("gpt"))
    graphs = []

    def record(g, example_inputs):
        graphs.append(g.code)
        return g.forward
    pm.graph_module.forward = torch.compile(pm.graph_module.forward, backend=record, dynamic=False)
    pm(models.batch("gpt")).backward()
    assert len(graphs) == 1 and "fxmegatron.vocab_ce" in graphs[0] and "amax" not in graphs[0]


@pytest.mark.parametrize("fn,args", [
    ("split_seq", (0, 0, 1, "")), ("all_gather_seq", (0, 0, 1, "")), ("gather_seq", (0, 1, "")),
    ("scatter_seq", (0, 1, "")), ("reduce_from_tp", ("",))])
def test_collective_functions_return_new_tensors(fn, args):
    """A view of the input from a collective's autograd Function got a zero gradient under
    compile on CUDA (sequence parallelism's split: wpe stayed frozen). Each returns its own
    storage; only f (copy_to_tp) is the identity, as in Megatron."""
    import fxmegatron.ops.collectives as C
    x = torch.randn(6, 4, requires_grad=True)
    y = getattr(C, fn)(x, *args)
    assert torch.equal(y, x) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_beside_inductor_only_the_chains_generated_kernels_win_are_fused():
    """compile=True: groups with GeLU, counter dropout or a rotation stay ours (measured faster
    than inductor's); the rest (SiLU·mul, a norm's adds) is left to inductor, which fuses it
    with its neighbours."""
    from fxmegatron.passes.fuse import Fused

    labels = {}
    for compile in (False, True):
        pm = fxmegatron.parallelize(models.build("llama", n_layer=1), None, models.batch("llama"), fuse=True,
                                    compile=compile)
        labels[compile] = [m.label for m in pm.modules() if isinstance(m, Fused)]
    assert any("silu" in lab for lab in labels[False])
    assert labels[True] and all("rotate_half" in lab for lab in labels[True]), labels[True]
    pm = fxmegatron.parallelize(models.build("gpt", n_layer=1, dropout=0.1), None, models.batch("gpt"), fuse=True,
                                compile=True)
    kept = [m.label for m in pm.modules() if isinstance(m, Fused)]
    assert kept and all("counter_dropout" in lab or "gelu" in lab for lab in kept), kept
    # GeLU alone is a group (its kernel beats inductor's: LONE_GROUPS), with the fc's bias
    assert "add -> gelu" in kept, kept
    fc = [n for n in pm.graph_module.graph.nodes if n.target is torch.ops.aten.linear.default
          and "mlp_fc" in str(n.args[1])]
    assert len(fc) == 1 and len(fc[0].args) == 2, fc       # the bias left the matmul for the group
