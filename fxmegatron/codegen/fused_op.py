"""``FusedChain`` as torch.library ops: under torch.compile a fused group stays one call.

With ``parallelize(fuse=True, compile=True)`` dynamo would otherwise trace through a
``Fused`` group (its ATen fallback), and inductor would generate its own kernels for it.
``fused_forward`` and ``fused_backward`` are custom ops with fake implementations:
dynamo and AOTAutograd see only their output shapes, so each group is one opaque call in
the compiled forward graph and one in the compiled backward graph, and both launch the
chain's generated kernels. The backward recomputes the chain from its inputs, as
``FusedChain.apply`` does in eager.

A custom op's schema carries tensors, numbers and strings, not Python objects, so the
chain travels as a name that ``chain_id`` hands out and ``_CHAINS`` maps back. (torch's
opaque-object arguments would carry the chain itself, but their registration API differs
between the torch versions we run on, 2.11 and 2.13.) The map is a cache of weak
references: it never keeps a chain alive, so a dropped model frees its chains, and a
name is never reused for another chain in a process.

A name is a serial number and a digest of what the chain computes and of the code here.
AOTAutograd's on-disk cache keys on dynamo's graph, where a group is only this call, yet
the backward it stores was traced through ``_backward`` and the fakes (which gradients
pass through, what they are like): the digest makes an entry written by another process
serve only the same chains under the same code.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import weakref
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from fxmegatron.codegen.chain_source import KEY
from fxmegatron.codegen import fused_chain
from fxmegatron.codegen.fused_chain import FusedChain

_CHAINS: "weakref.WeakValueDictionary[str, FusedChain]" = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


@functools.lru_cache(maxsize=None)
def _code() -> bytes:
    """This module's and ``FusedChain``'s source: what the compiled backward was traced through."""
    try:
        return b"".join(open(f, "rb").read() for f in (__file__, fused_chain.__file__))
    except OSError:         # not installed as source files: nobody edits it in place
        return b""


def chain_id(chain: FusedChain) -> str:
    """A name for ``chain`` in ``fused_forward``'s calls (a new one at every call of this)."""
    c = chain.chain
    what = repr((c.inputs, c.outputs, c.dropouts, sorted(c.rotated.items()), chain.kinds)).encode()
    name = f"{next(_SERIAL)}:{hashlib.sha1(what + _code()).hexdigest()[:16]}"
    _CHAINS[name] = chain
    return name


def _chain(name: str) -> FusedChain:
    chain = _CHAINS.get(name)
    if chain is None:
        raise RuntimeError(f"fxmegatron::fused_forward: fused chain {name} no longer exists (its module was freed)")
    return chain


@torch.library.custom_op("fxmegatron::fused_forward", mutates_args=())
def fused_forward(xs: List[Tensor], chain: str) -> List[Tensor]:
    """The outputs of fused chain ``chain`` on inputs ``xs`` (in its kinds' order)."""
    return _chain(chain).forward(*xs)


@fused_forward.register_fake
def _(xs, chain):
    return _chain(chain).new_outputs(xs)


@torch.library.custom_op("fxmegatron::fused_backward", mutates_args=())
def fused_backward(xs: List[Tensor], grads: List[Tensor], chain: str, needs: List[bool]) -> List[Tensor]:
    """The gradients of the inputs ``xs[i]`` with ``needs[i]``, in order (each of ``xs[i]``'s
    shape and dtype), from the gradients of the chain's outputs."""
    dxs = _chain(chain).backward(xs, grads, needs)
    # an input's gradient may not be an incoming gradient itself (an op's output never
    # aliases its input): ``_backward`` passes those on outside this op
    return [d if all(d is not g for g in grads) else d.clone() for w, d in zip(needs, dxs) if w]


@fused_backward.register_fake
def _(xs, grads, chain, needs):
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x, w in zip(xs, needs) if w]


def _setup(ctx, inputs, output):
    xs, chain = inputs
    ctx.chain = chain
    ctx.save_for_backward(*xs)        # the chain's inputs only: the backward recomputes it


def _backward(ctx, grads: Sequence[Optional[Tensor]]):
    xs = ctx.saved_tensors
    chain = _chain(ctx.chain)
    if any(g is None for g in grads):
        zeros = [torch.zeros_like(o) for o in chain.new_outputs(xs)]
        grads = [g if g is not None else z for g, z in zip(grads, zeros)]
    needs = [bool(w) and k != KEY for w, k in zip(ctx.needs_input_grad[0], chain.kinds)]
    # a gradient that is an incoming gradient as it is (a residual add) is that tensor, no copy
    passed = chain.passed(xs, grads, needs)
    needs = [w and i not in passed for i, w in enumerate(needs)]
    dxs = iter(fused_backward(list(xs), list(grads), ctx.chain, needs) if any(needs) else ())
    return [grads[passed[i]] if i in passed else next(dxs) if w else None for i, w in enumerate(needs)], None


fused_forward.register_autograd(_backward, setup_context=_setup)

