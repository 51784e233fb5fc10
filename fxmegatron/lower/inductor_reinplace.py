"""Let inductor write the loss's gradient over the donated logits, with no copy first.

``passes.loss_grad_in_place`` proves that nothing but the loss reads the logits, and the
loss's backward then writes their gradient over them (``fxmegatron::vocab_ce_backward_``).
Under ``compile=True`` that call lands in the backward graph as a functional
``auto_functionalized_v2`` on the saved logits, a graph input. Inductor's reinplace pass
refuses to mutate a graph input that the graph does not copy back into, so it clones the
logits; its buffer planner then gives the clone the logits' own (donated) memory. What is
left is a kernel that reads and writes every logit unchanged: 1.09 ms a step on gpt1.3b
(16384 × 50304 bf16) on one H100, found in the profile.

AOT autograd marks a saved tensor *donated* when the backward holds its last reference
(``torch._functorch.config.donated_buffer``; a backward that keeps its graph,
``retain_graph=True``, is refused for such graphs). Writing over a donated input changes
nothing anyone reads after the graph. So this post-grad pass adds, for each
``vocab_ce_backward_`` whose logits are a donated input, the copy back into that input that
the reinplace pass asks for; it then runs the op on the input itself and drops the copy.
Logits that are not donated keep the clone (correct, one extra pass over memory).

The op runs only in the loss's backward, so it appears only in backward graphs, where
``get_donated_idxs`` names the backward's placeholders.
"""
from __future__ import annotations

import functools
import hashlib
import operator
from pathlib import Path
from typing import Optional

import torch

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def loss_grad_over_donated_logits():
    """The pass, as inductor's ``post_grad_custom_post_pass`` (made on first use: importing
    inductor is not free).

    Its ``uuid`` is part of the key of inductor's FX graph cache and of AOT autograd's cache,
    and it hashes every source file of fxmegatron (``package_hash``), not this file alone.
    fxmegatron's custom ops reach those caches as single calls, and their autograd formulas
    are not in the keys. Without this, a compiled backward made by an older fxmegatron, or
    before an edit, would be served for the new formula with no error. That happened once
    in a test (session 18's note)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class LossGradOverDonatedLogits(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            copy_back_donated_logits(graph)

        def uuid(self):
            return _installed_hash()

    return LossGradOverDonatedLogits()


@functools.lru_cache(maxsize=None)
def _installed_hash() -> str:
    # the installed sources do not change within a process: read them once, not per compile
    return package_hash()


def package_hash(root: Optional[Path] = None) -> str:
    """sha256 over the paths and contents of every ``.py`` file under ``root`` (default: the
    fxmegatron package)."""
    root = Path(root or Path(__file__).resolve().parents[1])
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def copy_back_donated_logits(graph: torch.fx.Graph, donated=None) -> int:
    """Add ``copy_(logits, new_logits)`` after each in-place loss backward whose logits are
    a donated graph input; returns how many. ``donated``: placeholder indices (default:
    inductor's, from the tracing context)."""
    import fxmegatron.kernels.cross_entropy  # noqa: F401  (registers the op)
    if donated is None:
        from torch._inductor.utils import get_donated_idxs
        donated = get_donated_idxs()
    donated = set(donated or ())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    wrapper = torch.ops.higher_order.auto_functionalized_v2
    done = 0
    for n in list(graph.nodes):
        if n.target is not wrapper or n.args[0] is not torch.ops.fxmegatron.vocab_ce_backward_.default:
            continue
        bases = n.kwargs.get("_all_bases", ())
        if len(bases) != 1 or bases[0].op != "placeholder" or placeholders.index(bases[0]) not in donated:
            continue
        # the wrapper returns (the op's result, each base as mutated): the logits are item 1
        new = [u for u in n.users if u.target is operator.getitem and u.args[1] == 1]
        if len(new) != 1:
            continue
        with graph.inserting_after(new[0]):
            graph.call_function(aten.copy_.default, (bases[0], new[0]))
        done += 1
    return done
