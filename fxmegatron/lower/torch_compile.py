"""Hand a rank's transformed graph (or each of its pipeline chunks) to torch.compile.

fxmegatron's passes decide what runs where (shards, collectives, recomputation,
pipeline chunks); inductor then generates the kernels of each rank's graph, fusing
its elementwise and reduction runs around the matmuls. The graph's collectives are
torch.library ops with fake implementations, so they stay in the compiled graph as
calls, in the order the passes put them.

With ``fuse=True`` too, each fused elementwise group stays one call as well
(``fxmegatron::fused_forward``, and ``fused_backward`` in the backward graph:
``fxmegatron.codegen.fused_op``): its generated Triton kernels run inside the compiled
graph, and inductor generates the kernels of the rest (matmuls' neighbours, norms,
softmax, the groups fuse left alone).

Every collective's autograd Function returns a new tensor, never a view of its input:
under compile on CUDA, sequence parallelism's split (a narrow view) once gave its input a
zero gradient (``benchmarks/compile_tp_check.py`` finds such a parameter).

One thing cannot be traced: the dropout key. ``rng_key`` reads and advances the
step counter of ``DropoutRng`` (a Python int); traced, the step would be a constant
and every step a recompilation. It runs outside the compiled graph
(``torch._dynamo.disable``), and the graph takes the key as an input.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fxmegatron.errors import CompileError
from fxmegatron.ops.dropout import rng_key
from fxmegatron.lower.inductor_reinplace import loss_grad_over_donated_logits
from fxmegatron.lower.overlap_scheduler import scheduling_options



@functools.lru_cache(maxsize=None)
def _outside_graph_rng_key():
    # made on first use: importing torch._dynamo is not free, and plain runs never need it
    return torch._dynamo.disable(rng_key)


def compile_graph(gm: fx.GraphModule, mode=None, backend="inductor", schedule_collectives: bool = False
                  ) -> fx.GraphModule:
    """``gm`` with its forward compiled by torch.compile (static shapes: microbatches are all
    the same size). ``mode``: torch.compile's mode (None, "max-autotune-no-cudagraphs", ...);
    ``backend``: torch.compile's (the tests record the graphs with their own);
    ``schedule_collectives``: inductor's overlap scheduler moves the graph's functional
    collectives (see ``inductor_options``).
    The module keeps its parameters and names; only ``forward`` changes."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is rng_key:
            n.target = _outside_graph_rng_key()
    gm.recompile()
    if backend == "inductor":
        gm.forward = torch.compile(gm.forward, dynamic=False, options=inductor_options(mode, schedule_collectives))
    else:
        gm.forward = torch.compile(gm.forward, backend=backend, dynamic=False, mode=mode)
    return gm


def inductor_options(mode=None, schedule_collectives: bool = False) -> dict:
    """What ``mode`` sets in inductor, plus fxmegatron's post-grad pass
    (``lower.inductor_reinplace``). torch.compile takes a mode or options, not both, so
    the mode's options are spelled out.

    ``schedule_collectives``: inductor's overlap scheduler (``fx_passes.overlap_scheduling``,
    torchtitan's SimpleFSDP uses it) reorders the post-grad graphs so that each functional
    collective starts early enough for compute to hide it and is waited for late, within a
    memory budget: ``dp_shard="full"``'s prefetch of the next block's gather and its
    reduce-scatters under the backward. It only moves torch's functional collectives
    (``ops.dp_gather``'s ``functional``), never fxmegatron's own ops, so the tensor- and
    context-parallel collectives keep the order the passes gave them. Where the installed
    torch has no such scheduler the option is left out (the graph then runs in pass order).
    How it pins its order, and what that costs the loss: ``lower.overlap_scheduler``."""
    import torch._inductor
    options = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    options["post_grad_custom_post_pass"] = loss_grad_over_donated_logits()
    if schedule_collectives:
        options.update(scheduling_options())
    return options


def check_compile_options(compile, fuse: bool):
    """Refuse a ``compile`` that is neither a bool nor a mode string. (``fuse`` composes with
    it: see the module doc.)"""
    if compile not in (False, True, None) and not isinstance(compile, str):
        raise CompileError(f"parallelize(compile={compile!r}): expected a bool or a torch.compile mode string")
