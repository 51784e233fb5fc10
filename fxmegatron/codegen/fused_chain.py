"""``FusedChain``: an elementwise chain run as its generated forward and backward kernels.

A call picks the tiles (``tiles``), generates the source of the layout it meets
(``fxmegatron.codegen.chain_source``), compiles it (``fxmegatron.codegen.kernel_cache``)
and launches it; what a call works out is kept per input shapes, so the next call with
the same shapes is a dict look-up and a launch.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from fxmegatron.codegen.chain_source import BCAST, FULL, KEY, ROW, Layout, backward_source, forward_source
from fxmegatron.codegen.expr import Chain
from fxmegatron.codegen.kernel_cache import compile_source


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tiles(n: int, backward: bool, row_grad: bool = False, flat: bool = False,
          bcast: bool = False, rotated: bool = False) -> Tuple[int, int, int]:
    """(BM, BN, num_warps) for an [M, n] output, from sweeps on an H200
    (``benchmarks/fused_kernels.py --sweep``). ``flat``: a chain of full-shape inputs only,
    run as one row of all its elements. A forward with a row input (a bias) takes wide
    tiles (up to 1024 columns, 4 warps); one with a broadcast input (a mask) runs of up to
    1024 contiguous elements, both passes; rotary's, 128 columns by 16 rows (the partner
    load), both passes. A backward that sums
    a bias gradient takes tall narrow tiles (fewer row partials). Fixed, not timed at run
    time: every tp rank must sum a replicated bias's gradient in the same order. A flat
    forward takes 512 elements over 2 warps (SiLU·mul, Llama shapes, five rounds: 0.3246 ms
    against 0.3264 for 2048 over 4 warps and torch.compile's 0.3251)."""
    if flat:
        return (1, 2048, 4) if backward else (1, 512, 2)
    if backward and row_grad:
        bn = min(_pow2(n), 64)
        return max(1, 4096 // bn), bn, 4
    if bcast and not rotated:
        # contiguous runs of up to 1024 elements: scale+mask at gpt1.3b, 1024 columns of one row
        # (0.509 / 0.512 ms) against 32 rows of 128 (0.512 / 0.514), forward / backward
        bn = min(_pow2(n), 1024)
        return max(1, 1024 // bn), bn, 2 if backward else 4
    if backward or bcast:
        bn = min(_pow2(n), 128)
        return max(1, (2048 if rotated else 4096) // bn), bn, 8
    bn = min(_pow2(n), 1024)
    return (max(1, 4096 // bn), bn, 4) if bn >= 512 else (max(1, 2048 // bn), bn, 8)


class FusedChain:
    """Runs a ``Chain`` as two generated kernels; ``apply`` is differentiable.

    ``shapes`` (the inputs' shapes, optional) fixes the layout that ``fwd_src``/``bwd_src``
    show; calls generate (and cache) the source of the layout they meet."""

    def __init__(self, chain: Chain, kinds: Sequence[str], shapes: Optional[Sequence[Tuple[int, ...]]] = None):
        self.chain, self.kinds = chain, list(kinds)
        self.fwd_tiles: Optional[Tuple[int, int, int]] = None     # overrides of ``tiles`` (benchmarks)
        self.bwd_tiles: Optional[Tuple[int, int, int]] = None
        self.keep_reused = True       # False: no eviction hints (benchmarks compare)
        self._src: Dict[tuple, str] = {}
        self._kernel_plans: Dict[tuple, tuple] = {}
        # input i whose gradient is exactly incoming gradient j
        self._passed = {i: chain.grad_outputs.index(e) for i, e in enumerate(chain.grads)
                        if e in chain.grad_outputs and i not in chain.rotated}
        q4 = bool(chain.dropouts)     # the dump shows the common, aligned case
        self._example = self._layout(shapes, q4) if shapes is not None else None
        if self._example is None and BCAST not in self.kinds and not self._sharded_dropout():
            self._example = Layout((1,), tuple(None for _ in self.kinds), False, q4)

    def _sharded_dropout(self) -> bool:
        return any(d.shard_dim >= 0 for d in self.chain.dropouts)

    def _layout(self, shapes, q4: bool = False) -> Layout:
        full = next(tuple(s) for s, k in zip(shapes, self.kinds) if k == FULL)
        pad = tuple((1,) * (len(full) - len(s)) + tuple(s) if k == BCAST else None
                    for s, k in zip(shapes, self.kinds))
        # shape only matters to the source through broadcast offsets and sharded dropout
        shape = full if (BCAST in self.kinds or self._sharded_dropout()) else (1,)
        return Layout(shape, pad, math.prod(full) >= 2 ** 31, q4, self.keep_reused)

    @property
    def flat(self) -> bool:
        """Full-shape inputs only: the kernels see one row of all the elements."""
        return all(k in (FULL, KEY) for k in self.kinds) and not self.chain.rotated

    def _view(self, full: torch.Tensor) -> Tuple[int, int]:
        if self.flat:
            return 1, full.numel()
        n = full.shape[-1]
        return full.numel() // max(n, 1), n

    def _quarter(self, full: torch.Tensor, n: int, bn: int) -> bool:
        """Whether each aligned group of four columns holds four consecutive indices of every
        dropout's unsplit tensor, starting at a multiple of four (the random words' layout:
        ``fxmegatron.codegen.chain_source``)."""
        if not self.chain.dropouts or n % 4 or bn % 4:
            return False
        for d in self.chain.dropouts:
            if d.shard_dim >= 0:
                inner = math.prod(full.shape[d.shard_dim + 1:])
                if (full.shape[d.shard_dim] * inner) % 4 or (d.global_shape[d.shard_dim] * inner) % 4 \
                        or (d.start * inner) % 4:
                    return False
        return True

    def _launch_config(self, xs, backward: bool):
        """(m, n, layout, (BM, BN, warps), row blocks, column blocks) of a call."""
        import triton
        full = self._full(xs)
        m, n = self._view(full)
        cfg = (self.bwd_tiles if backward else self.fwd_tiles) or \
            tiles(n, backward, ROW in self.kinds, self.flat, BCAST in self.kinds, bool(self.chain.rotated))
        layout = self._layout([tuple(x.shape) for x in xs], self._quarter(full, n, cfg[1]))
        return m, n, layout, cfg, triton.cdiv(m, cfg[0]), triton.cdiv(n, cfg[1])

    def source(self, layout: Layout, backward: bool, needs: Optional[Tuple[bool, ...]] = None) -> str:
        key = (layout, backward, needs)
        if key not in self._src:
            self._src[key] = backward_source(self.chain, self.kinds, "bwd", layout, needs) if backward \
                else forward_source(self.chain, self.kinds, "fwd", layout)
        return self._src[key]

    @property
    def fwd_src(self) -> str:
        return self.source(self._example, False) if self._example else "# generated per call (broadcast inputs)"

    @property
    def bwd_src(self) -> str:
        return self.source(self._example, True) if self._example else "# generated per call (broadcast inputs)"

    def _full(self, xs):
        return next(x for x, k in zip(xs, self.kinds) if k == FULL)

    def _out_dtype(self, xs):
        fulls = [x for x, k in zip(xs, self.kinds) if k in (FULL, ROW, BCAST) and x.is_floating_point()]
        return fulls[0].dtype

    def _kernel_plan(self, xs, backward: bool, needs=None):
        """(kernel, grid, m, n, NB, tiles, row blocks) of a call, cached by the inputs' shapes
        and dtypes: a call then costs a dict look-up and a launch (these kernels run in tens
        of microseconds, so host time shows)."""
        key = (tuple((x.shape, x.dtype, x.device) for x in xs), backward, needs, self.fwd_tiles, self.bwd_tiles,
               self.keep_reused)
        plan = self._kernel_plans.get(key)
        if plan is None:
            m, n, layout, cfg, mb, nb = self._launch_config(xs, backward)
            kernel = compile_source(self.source(layout, backward, needs if backward else None),
                                    "bwd" if backward else "fwd")
            plan = self._kernel_plans[key] = (kernel, (mb * nb,), m, n, nb, cfg, mb)
        return plan

    def new_outputs(self, xs) -> List[torch.Tensor]:
        """Uninitialised tensors of the shape, dtype and device of the chain's outputs (the
        fake tensors of ``fxmegatron.codegen.fused_op`` under fake inputs)."""
        full = self._full(xs)
        return [torch.empty(full.shape, dtype=self._out_dtype(xs), device=full.device) for _ in self.chain.outputs]

    def passed(self, xs, gs, needs: Sequence[bool]) -> Dict[int, int]:
        """{input i: incoming gradient j} where input i's gradient is gradient j as it is (a
        residual add) and no kernel need write it."""
        full = self._full(xs)
        return {i: self._passed[i] for i in range(len(xs))
                if needs[i] and i in self._passed and xs[i].shape == full.shape
                and gs[self._passed[i]].dtype == xs[i].dtype}

    def forward(self, *xs: torch.Tensor) -> List[torch.Tensor]:
        kernel, grid, m, n, nb, (bm, bn, warps), _ = self._kernel_plan(xs, False)
        outs = self.new_outputs(xs)
        kernel[grid](*[x.contiguous() for x in xs], *outs, m, n, nb, BM=bm, BN=bn, num_warps=warps)
        return outs

    def backward(self, xs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
                 needs: Optional[Sequence[bool]] = None) -> List[Optional[torch.Tensor]]:
        full = self._full(xs)
        needs = tuple(bool(w) and k != KEY for w, k in zip(needs or [True] * len(xs), self.kinds))
        passed = self.passed(xs, gs, needs)     # such a gradient is that tensor
        needs = tuple(w and i not in passed for i, w in enumerate(needs))
        kernel, grid, m, n, nb, (bm, bn, warps), blocks = self._kernel_plan(xs, True, needs)
        dxs = {}
        for i, (x, k) in enumerate(zip(xs, self.kinds)):
            if k == KEY or not needs[i]:
                continue
            if k == FULL:
                dxs[i] = torch.empty(full.shape, dtype=x.dtype, device=full.device)
            elif k == ROW:      # one fp32 partial sum per row block
                dxs[i] = torch.empty((blocks, n), dtype=torch.float32, device=full.device)
            else:
                dxs[i] = torch.empty(full.shape, dtype=torch.float32, device=full.device)
        if any(needs):
            # inputs whose gradient is not asked for still take a (never written) pointer slot
            slots = [dxs.get(i, full) for i, k in enumerate(self.kinds) if k != KEY]
            kernel[grid](*[x.contiguous() for x in xs], *[g.contiguous() for g in gs],
                         *slots, m, n, nb, BM=bm, BN=bn, num_warps=warps)
        for i, j in passed.items():
            dxs[i] = gs[j]
        out: List[Optional[torch.Tensor]] = []
        for i, (x, k) in enumerate(zip(xs, self.kinds)):
            if i not in dxs:
                out.append(None)
            elif k == ROW:
                out.append(dxs[i].sum(0).reshape(x.shape).to(x.dtype))
            elif k == BCAST:
                out.append(dxs[i].sum_to_size(x.shape).to(x.dtype))
            else:
                out.append(dxs[i])
        return out

    def apply(self, *xs: torch.Tensor):
        return _FusedFn.apply(self, *xs)


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused: FusedChain, *xs):
        ctx.fused = fused
        ctx.save_for_backward(*xs)       # the chain's inputs only: the chain is recomputed in backward
        outs = fused.forward(*xs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        full = ctx.fused._full(ctx.saved_tensors)
        gs = [g if g is not None else torch.zeros(full.shape, dtype=full.dtype, device=full.device) for g in gs]
        return (None,) + tuple(ctx.fused.backward(ctx.saved_tensors, gs, ctx.needs_input_grad[1:]))
