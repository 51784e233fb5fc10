"""The forward behind ``ParallelModel.logits``: the rank's graph cut at the logits
(``passes.logits_output``), fed a batch in pieces of the size it was traced at, its
vocabulary shards gathered over tp when asked, and under context parallelism every cp rank's
chunks of the sequence gathered and put back in order."""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from fxmegatron.capture import batch_args
from fxmegatron.capture.inputs import check_batch
from fxmegatron.errors import BatchError, PassError
from fxmegatron.passes.context_parallel import sequence_length
from fxmegatron.passes.context_parallel.layout import is_split, join_sequence
from fxmegatron.passes.logits_output import logits_output, output_placement, used_inputs
from fxmegatron.passes.runner import Pass, PassRunner
from fxmegatron.placement import Partial, Shard, placed
from fxmegatron.program import RankProgram
from fxmegatron.runtime.gather import gather_tp
from fxmegatron.runtime.microbatches import split_batch


class LogitsForward:
    """One rank's logits program (made from a program without pipeline) and how to feed it."""

    def __init__(self, program: RankProgram):
        self.program = program
        self.gm = PassRunner([Pass("logits_output", logits_output)])(program.graph_module)
        self.used = used_inputs(self.gm)
        self.placement = output_placement(self.gm)
        if program.axes["tp"].size > 1 and (self.placement is None or isinstance(self.placement, Partial)):
            # a partial sum or an unknown split gathered as if it were a shard is a wrong tensor
            raise PassError(f"the logits node ({self._node_name()}) has no whole or split placement "
                            f"({self.placement}): its tp ranks' pieces cannot be put together")
        self.cp_placement, self.seq = None, 0
        if program.axes.get("cp") is not None and program.axes["cp"].size > 1:
            out = next(n for n in self.gm.graph.nodes if n.op == "output").args[0]
            self.cp_placement = placed(out, "cp") if isinstance(out, fx.Node) else None
            if not is_split(self.cp_placement):
                raise PassError(f"the logits node ({self._node_name()}) is not this rank's chunks of the sequence "
                                f"({self.cp_placement}) under cp={program.axes['cp'].size}: its cp ranks' pieces "
                                "cannot be put together")
            self.seq = sequence_length(program.graph_module)

    def _node_name(self) -> str:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        return str(out.args[0])

    def flat(self, args: tuple, kwargs: dict) -> List:
        """The graph's inputs from a call: the example batch's structure, or that structure
        without inputs the logits do not read (the labels), which become None."""
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list, dict)):
            args, kwargs = batch_args(args[0])
        leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
        example = self.program.in_spec
        if spec == example:
            return [x for _, x in leaves]
        dummy = pytree.tree_unflatten(list(range(example.num_leaves)), example)
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(dummy)[0]]
        given = {pytree.keystr(p): x for p, x in leaves}
        names = self.program.input_names
        unknown = sorted(set(given) - set(paths))
        missing = [names[i] for i, p in enumerate(paths) if self.used[i] and p not in given]
        if unknown or missing:
            raise TypeError(f"logits: batch structure {spec} is not the example batch's {example}"
                            + (f" (unknown inputs {unknown})" if unknown else "")
                            + (f" (missing inputs the logits read: {missing})" if missing else "")
                            + "; inputs the logits do not read (the labels) may be left out")
        return [given.get(p) for p in paths]

    def __call__(self, flat: Sequence, gather: bool) -> torch.Tensor:
        """The logits of the batch ``flat`` (run piece by piece at the traced size,
        concatenated along dim 0)."""
        names = list(self.program.input_names)
        example = list(self.program.example_inputs)
        pieces = split_batch(flat, self._pieces(flat, example, names), names)
        given = [i for i, x in enumerate(flat) if x is not None]
        outs = []
        for piece in pieces:
            check_batch([piece[i] for i in given], [example[i] for i in given], [names[i] for i in given],
                        "piece of the batch")
            outs.append(self._whole(self.gm(*piece), gather))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    @staticmethod
    def _pieces(flat: Sequence, example: Sequence, names: Sequence[str]) -> int:
        """How many pieces of the traced rows the batch holds."""
        for x, ex, name in zip(flat, example, names):
            if isinstance(x, torch.Tensor) and isinstance(ex, torch.Tensor) and x.dim() > 0 and ex.dim() > 0:
                n, b = x.shape[0], ex.shape[0]
                if n == 0 or n % b:
                    raise BatchError(f"logits: batch input {name!r} has {n} rows; the graph runs pieces of {b} "
                                     "rows (the example batch's rows over dp and microbatches): give a multiple")
                return n // b
        return 1

    def _whole(self, out: torch.Tensor, gather: bool) -> torch.Tensor:
        """This rank's logits made whole over tp (along the sequence, or any dim but the
        vocabulary, always; along the vocabulary when ``gather``), then over cp."""
        out = self._whole_tp(out, gather)
        if self.cp_placement is None:
            return out
        cp = self.program.axes["cp"]
        parts = [torch.empty_like(out) for _ in range(cp.size)]
        dist.all_gather(parts, out.detach().contiguous(), group=cp.group)
        return join_sequence(parts, self.cp_placement, self.seq)

    def _whole_tp(self, out: torch.Tensor, gather: bool) -> torch.Tensor:
        tp, plc = self.program.axes["tp"], self.placement
        if tp.size == 1 or not isinstance(plc, Shard):
            return out
        vocab = plc.dim % out.ndim == out.ndim - 1
        if vocab and not gather:
            if plc.blocks is not None:
                raise RuntimeError(f"logits: this rank's vocabulary is {len(plc.blocks)} blocks, not one slice: "
                                   "use gather=True")
            return out
        return gather_tp(out, plc, tp)

