"""A rank's pipeline stage, built: its chunks, with only their parameters materialised, the
shapes that cross their boundaries, and the token counter that weights microbatches.

The whole (tensor-parallel) graph is first built with meta parameters; after
``split_pipeline`` a rank materialises the parameters its own chunks use and
nothing else. Shapes of what crosses each boundary, at microbatch size, come from
propagating fake microbatch inputs through every chunk in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxmegatron.capture import Captured, retarget_device
from fxmegatron.lower.materialize import materialize_graph
from fxmegatron.ops.dropout import DropoutRng, rng_key
from fxmegatron.passes.pipeline_split import Chunk, param_holders
from fxmegatron.schedules.runtime import TensorSpec


def boundary_specs(chunks: Sequence[Chunk], placeholder_vals: Sequence) -> Dict[int, List[TensorSpec]]:
    """What each chunk sends to the next (fake propagation on meta; the graph is traced at
    microbatch size)."""
    # the dropout key keeps its name on every boundary that relays it; its shape with dropout
    # off is asked of DropoutRng itself, which alone decides it
    keys = {n.name for c in chunks for n in c.gm.graph.nodes if n.op == "call_function" and n.target is rng_key}
    key_off = tuple(DropoutRng().eval().next_key("meta").shape)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    micro = [torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
             for v in placeholder_vals]
    specs: Dict[int, List[TensorSpec]] = {}
    carried: List = []
    with mode:
        for c in chunks:
            args = list(carried) + [micro[i] for i in c.batch_inputs]
            out = FakeTensorProp(c.gm, mode).propagate(*args)
            if c.boundary_out:
                specs[c.index] = [TensorSpec(tuple(t.shape), t.dtype, g, key_off if name in keys else None)
                                  for t, g, name in zip(out, c.boundary_grad, c.boundary_out)]
                carried = list(out)
    return specs


@dataclass
class Stage:
    """This pipeline rank's chunks (materialised) and what the runtime needs to run them."""

    modules: Dict[int, fx.GraphModule]           # global chunk index -> module
    params: Dict[str, nn.Parameter]             # canonical name -> local shard, shared by the chunks
    shared: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = field(default_factory=dict)


def build_stage(chunks: Sequence[Chunk], p: int, pp_rank: int, cap: Captured, param_plc, tp_rank: int,
                tp: int, device, state_dict: Optional[Mapping], seed: int, meta_gm: fx.GraphModule,
                source: Optional[fx.GraphModule] = None, groups: Optional[Mapping[str, str]] = None,
                **shard_at) -> Stage:
    """Materialise the parameters of the chunks on ``pp_rank`` (chunk c lives on rank c % p);
    constants come from ``source`` (the graph before it went to meta). ``shard_at``:
    ``materialize_graph``'s data-parallel shard keywords (``dp_shard="full"``)."""
    params: Dict[str, nn.Parameter] = {}
    modules = {c.index: materialize_graph(c.gm, cap, param_plc, tp_rank, tp, device, state_dict, seed, source, params,
                                         groups, **shard_at)
               for c in chunks if c.index % p == pp_rank}
    # weights used on several pipeline ranks (tied embedding / LM head): gradients summed over pp
    shared = {}
    for name, ranks in sorted(param_holders(chunks, p).items()):
        if len(ranks) > 1 and name in cap.params:
            t = meta_gm.get_parameter(name)
            shared[name] = (tuple(t.shape), t.dtype)
    return Stage(modules, params, shared)


def token_counter(gm: fx.GraphModule, device="cpu"):
    """A function ``flat_microbatch -> number of tokens the loss averages over``, or None.

    The loss is the vocab-parallel cross-entropy with mean reduction; its target is
    computed from the batch alone (HF models shift their labels inside the model), so
    the ancestors of the target form a small graph that needs no parameters. Weighting
    each microbatch by its count (instead of 1/m) makes the step's loss the mean over
    all counted tokens of the batch, as the unmodified model computes it, also when
    microbatches hold different numbers of ignored labels. Under context parallelism the
    loss is this rank's sum over the count of every cp rank (``cp_count``); the count is
    then that of the whole sequence (``cp_take`` skipped: every cp rank gets the whole batch).
    """
    from fxmegatron.ops.context_parallel import cp_count, cp_take
    from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy

    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    counts = [n for n in calls if n.target is cp_count]
    # a loss tp left unsplit (replicated logits) stays ATen's, with ATen's argument order
    losses = [n for n in calls if n.target in (vocab_parallel_cross_entropy, torch.ops.aten.cross_entropy_loss.default)]
    if counts:
        if len(counts) != 1:
            return None
        target, ignore = counts[0].args[0], counts[0].args[1]
    else:
        if len(losses) != 1:
            return None
        ce = losses[0]
        if ce.target is vocab_parallel_cross_entropy:
            target, reduction, ignore = ce.args[1], ce.args[4], ce.args[5]
        else:
            def given(i, name, default):
                return ce.args[i] if len(ce.args) > i else ce.kwargs.get(name, default)
            target, reduction, ignore = ce.args[1], given(3, "reduction", 1), given(4, "ignore_index", -100)
            if given(2, "weight", None) is not None:
                return None      # a mean over class weights, not over a count
        if reduction != 1:
            return None

    def source(n):
        return source(n.args[0]) if n.op == "call_function" and n.target is cp_take else n

    target = source(target)
    keep, stack = [], [target]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        if n.op == "get_attr" or n.op == "call_module":
            return None          # depends on weights or submodules: not a function of the batch alone
        keep.append(n)
        stack.extend(source(a) for a in n.all_input_nodes)
    g = fx.Graph()
    env = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for p in placeholders:
        env[p] = g.placeholder(p.name)
    for n in gm.graph.nodes:
        if n in keep and n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[source(a)])
    g.output(env[target])
    sub = retarget_device(fx.GraphModule(torch.nn.Module(), g), device)

    return counter_of(sub, ignore)


def counter_of(sub: torch.nn.Module, ignore: int):
    """``flat_microbatch -> the labels of ``sub(*flat)`` that are not ``ignore``: the graph and
    the ignored value ride along (``graph``, ``ignore``), so that a compiled folder can write
    the counter as code (``io.stage_folder``)."""
    def count(flat) -> int:
        with torch.no_grad():
            t = sub(*flat)
        return int((t != ignore).sum())

    count.graph, count.ignore = sub, ignore
    return count
