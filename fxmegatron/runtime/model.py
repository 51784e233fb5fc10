"""``ParallelModel``: runs one rank's ``RankProgram`` as an ``nn.Module`` (the train and
eval steps, their loss weights, gradient norm and clipping, whole state and dumps)."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.capture import batch_args
from fxmegatron.capture.inputs import check_batch, structure_difference
from fxmegatron.errors import BatchStructureError
from fxmegatron.io.dump import dump_program
from fxmegatron.placement import Placement, R
from fxmegatron.program import RankProgram
from fxmegatron.runtime.batch_check import check_same_batch
from fxmegatron.runtime.data_parallel import GradSync, check_same_weights
from fxmegatron.runtime.gather import sum_shared_grads
from fxmegatron.runtime.grad_accumulation import Fp32GradAccumulator, check_grad_accum_dtype
from fxmegatron.runtime.gradient_step import GradientStep
from fxmegatron.runtime.logits import LogitsForward
from fxmegatron.runtime.microbatches import loss_weights, split_batch
from fxmegatron.runtime.sharded_dp import SHARDED_OPTIMIZER, sum_shared_pieces
from fxmegatron.runtime.whole_tensors import WholeTensors
from fxmegatron.lower.materialize import DIGESTS
from fxmegatron.ops.dp_gather import regather_in_backward
from fxmegatron.schedules.runtime import StageRunner, add_weighted


class ParallelModel(WholeTensors, GradientStep, nn.Module):
    """One rank's piece of the parallel program.

    ``train_step(batch)`` runs forward and backward over the microbatches (the
    pipeline schedule when there is one) and returns the loss on every rank;
    ``eval_step(batch)`` the same loss, forward only, with dropout off; ``logits(batch)``
    the logits the loss is computed from (without pipeline parallelism).
    Without pipeline parallelism the model can also be called with a batch to get
    the loss. ``parameters()`` are this rank's local shards, under the original
    model's names (tied weights appear once per rank). ``program`` is the
    ``RankProgram`` it runs.
    """

    def __init__(self, program: RankProgram, grad_accum_dtype: Optional[torch.dtype] = None,
                 dp_shard: str = "none"):
        super().__init__()
        check_grad_accum_dtype(grad_accum_dtype)
        self.program = program
        ax = program.axes
        # shorthands of coords() / degrees() for the four axes every layout has
        c, n = self.coords(), self.degrees()
        self.tp_size, self.tp_rank = n["tp"], c["tp"]
        self.pp_size, self.pp_rank = n["pp"], c["pp"]
        self.dp_size, self.dp_rank = n["dp"], c["dp"]
        self.cp_size, self.cp_rank = n["cp"], c["cp"]
        self.microbatches = program.microbatches
        self.graph_module = program.graph_module
        # the first steps check that every tp and pp rank got the same batch (see check_same_batch)
        self.batch_checks = 3
        # ... and that their ids and labels lie inside the vocabulary (see runtime.id_check)
        self.id_checks = 3
        self.coverage = program.coverage         # how much tp splits
        self.notes: List[str] = list(program.notes)    # what capture changed
        self.timings = dict(program.timings)
        pipe = program.pipeline
        self._runner: Optional[StageRunner] = None
        self.gradient_setup(program)
        self._logits: Optional[LogitsForward] = None     # made on the first logits() call
        uses: Dict[int, int] = {}
        if pipe is not None:
            self.stages = nn.ModuleDict({str(k): m for k, m in pipe.stage.modules.items()})
            self._runner = StageRunner(pipe.schedule, self.pp_rank, pipe.stage.modules, pipe.batch_inputs,
                                       pipe.specs, ax["pp"].ranks, ax["pp"].group, program.device)
            uses = pipe.uses()
        # the fp32 accumulation (when asked for) first, then the data-parallel averaging: the
        # hooks run in that order, so a bucket reduced at a parameter's last accumulation
        # holds the rounded fp32 sum
        self._grad_accum: Optional[Fp32GradAccumulator] = None
        self._grad_sync: Optional[GradSync] = None
        self._expert_sync: Optional[GradSync] = None
        sync = ax.get("dp_cp", ax["dp"])        # dp, or dp × cp under context parallelism
        # dp_shard: the optimizer's state sharded over those ranks (runtime.sharded_dp); at one rank
        # there is nothing to shard
        self.dp_shard = dp_shard if sync.size > 1 else "none"
        # "gradients" sums the reduced pieces over microbatches itself, in grad_accum_dtype
        if grad_accum_dtype is not None and (self.microbatches > 1 or any(v > 1 for v in uses.values())) \
                and self.dp_shard != "gradients":
            self._grad_accum = Fp32GradAccumulator(list(self.parameters()), uses)
        # "full": the parameters are shards and autograd reduce-scatters their gradients (passes.dp_shard)
        experts = self._expert_params()
        replicas = ax.get("dp_replicate")       # hybrid sharding: the same pieces' holders in other groups
        replicas = replicas if replicas is not None and replicas.size > 1 else None
        if self.dp_shard == "full" and experts and ax["edp"].size == 1:
            # dp = ep (a replica group's dp), no cp: the experts are held whole (no rank of the group
            # holds the same ones to shard them over, rank_passes.expert_shards), their gradients
            # summed over their ep group's tokens already: summed over the replica groups' holders
            # of the same experts, and the / dp that unshard's reduce-scatter does for the rest
            whole = replicas or ax["edp"]
            self._expert_sync = GradSync([p for p in self.parameters() if id(p) in experts], uses, whole.group,
                                         whole.size, divisor=self.dp_size, sum_dtype=grad_accum_dtype)
        if sync.size > 1 and self.dp_shard != "full":
            shared = pipe.stage.shared if pipe is not None else {}
            alone = {id(p) for n, p in self.named_parameters() if n in shared}
            # expert parallelism: an expert weight's gradient holds the sum over its ep group's tokens
            # already; it is summed over the ranks holding the same experts (dp / ep of them, × cp: each
            # cp rank's over its part of the sequence), then / dp as the rest
            self._grad_sync = GradSync([p for p in self.parameters() if id(p) not in experts], uses, sync.group,
                                       sync.size, divisor=self.dp_size,
                                       shard=self.dp_shard != "none", rank=sync.rank, alone=alone,
                                       every_microbatch=self.dp_shard == "gradients", sum_dtype=grad_accum_dtype,
                                       replicas=replicas.group if replicas else None)
            if experts:
                # under a sharded optimizer the experts' state is sharded over the ranks holding
                # the same experts (Megatron's expert-data-parallel group), a group of one at dp = ep;
                # under hybrid sharding those of one replica group, the pieces summed over the groups
                edp = ax["edp"]
                self._expert_sync = GradSync([p for p in self.parameters() if id(p) in experts], uses, edp.group,
                                             edp.size, divisor=self.dp_size, shard=self.dp_shard != "none",
                                             rank=edp.rank, every_microbatch=self.dp_shard == "gradients",
                                             sum_dtype=grad_accum_dtype, replicas=replicas.group if replicas else None)
        if dist.is_initialized():
            check_same_weights(self.named_parameters(), ax, lambda n: self.placement(n) == R,
                               pipe.stage.shared if pipe is not None else (),
                               known={k: v for m in (pipe.stage.modules.values() if pipe else [self.graph_module])
                                      for k, v in getattr(m, "meta", {}).get(DIGESTS, {}).items()})

    # parameters keep the original model's names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        pipe = self.program.pipeline
        if pipe is None:
            yield from self.graph_module.named_parameters(prefix, recurse, remove_duplicate)
            return
        params = pipe.stage.params
        for name in self.program.param_order:
            if name in params:
                yield (prefix + "." + name if prefix else name), params[name]

    def _axes(self) -> Dict[str, Tuple[int, int]]:
        # every mesh axis, not the flattened dp × cp group of the gradient sum
        return {"dp": (0, 1), "pp": (0, 1), "cp": (0, 1), "tp": (0, 1),
                **{a: rn for a, rn in self.program.coords().items() if a not in ("dp_cp", "dp_replicate", "ep", "edp")}}

    def _expert_params(self) -> set:
        """ids of the parameters expert parallelism cuts along their experts dim (empty at ep 1)."""
        if self.program.axes.get("ep") is None or self.program.axes["ep"].size == 1:
            return set()
        return {id(p) for n, p in self.named_parameters() if n in self.program.experts}

    def coords(self) -> Dict[str, int]:
        """This rank's coordinate on every mesh axis: {"dp": .., "pp": .., "cp": .., "tp": ..}
        (an axis the mesh does not have: 0), and any further axis of the program."""
        return {a: r for a, (r, _) in self._axes().items()}

    def degrees(self) -> Dict[str, int]:
        """The size of every mesh axis, as ``coords()`` names them (absent: 1)."""
        return {a: n for a, (_, n) in self._axes().items()}

    def check_replicas(self, after: str = "") -> None:
        """Raise ``ReplicaError`` when ranks that hold copies of a parameter no longer hold the
        same bits (``runtime.replica_check``); collective over every rank of the job."""
        from fxmegatron.runtime.replica_check import check_replicas
        check_replicas(self, after)

    def placement(self, name: str) -> Placement:
        """How parameter ``name`` (original model's name) is split over tp."""
        return self.program.placement(name)

    @property
    def grad_sync(self) -> Optional[GradSync]:
        """The data-parallel gradient reduction (None at one dp·cp rank and under "full")."""
        return self._grad_sync

    @property
    def grad_syncs(self) -> List[GradSync]:
        """Every gradient reduction: ``grad_sync``, and under expert parallelism the experts' own
        (over the ranks holding the same experts)."""
        return [s for s in (self._grad_sync, self._expert_sync) if s is not None]

    @property
    def dp_group(self):
        """The data-parallel process group (None without a "dp" dim), e.g. for
        ``torch.distributed.optim.ZeroRedundancyOptimizer(..., process_group=pm.dp_group)``."""
        return self.program.axes["dp"].group

    def _flat(self, args, kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list, dict)):
            args, kwargs = batch_args(args[0])
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.program.in_spec:
            raise BatchStructureError(f"batch structure: {structure_difference(args, kwargs, self.program.in_spec)}")
        if self.batch_checks > 0:
            self.batch_checks -= 1
            check_same_batch(flat, list(self.program.input_names), self.program.axes)
        return flat

    def _check_micro(self, micro, what):
        check_batch(micro, list(self.program.example_inputs), list(self.program.input_names), what)

    def forward(self, *args, **kwargs):
        if self.program.pipeline is not None:
            raise RuntimeError("a pipelined model runs whole steps: call train_step(batch) (forward and backward "
                               "over the microbatches by the schedule), or eval_step(batch) for the loss alone")
        if self.dp_size > 1:
            raise RuntimeError("with data parallelism, call train_step(batch) with the global batch: it takes this "
                               "rank's share and averages gradients over dp (eval_step(batch): the loss alone)")
        flat = self._flat(args, kwargs)
        self._check_micro(flat, "batch")
        self._check_ids([flat])
        return self.graph_module(*flat)[0]

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one batch, split into ``microbatches``; gradients accumulate
        in ``.grad`` (the optimizer step is the caller's). Returns the batch's loss (detached),
        on every rank: each microbatch's mean cross-entropy is weighted by its share of the
        batch's counted labels (a microbatch with none adds 0), which makes it the unmodified
        model's mean over the whole batch (a loss that is not one alone is refused at
        ``parallelize`` when the batch is split: ``passes.loss_terms``)."""
        micro, weights = self._microbatches(args, kwargs)
        m = self.microbatches
        if self._grad_accum is not None:
            self._grad_accum.start(m)
        for sync in (self._grad_sync, self._expert_sync):
            if sync is not None:
                sync.start(m)
        if self._runner is None:
            total = None
            for mb, w in zip(micro, weights):
                with self._regather():
                    loss = self.graph_module(*mb)[0]
                (loss if w == 1.0 else loss * w).backward()
                total = add_weighted(total, loss, w)
        else:
            with self._regather():
                total = self._runner.run(micro, weights, dropout_off=not self.training)
        if self._grad_accum is not None:
            self._grad_accum.finish()
        for sync in (self._grad_sync, self._expert_sync):
            if sync is not None:
                sync.finish()
        if self._runner is not None:
            pipe, pp = self.program.pipeline, self.program.axes["pp"]
            if self.dp_shard in SHARDED_OPTIMIZER:
                sum_shared_pieces(pipe.stage.params, pipe.stage.shared, self._grad_sync.piece_of(),
                                  self._grad_sync.world, pp, self.program.device)
            else:
                sum_shared_grads(pipe.stage.params, pipe.stage.shared, pp, self.program.device)
        return self._global_loss(total)

    def _regather(self):
        """Under dp_shard="full", the whole parameters a forward saves are gathered again in the backward."""
        return regather_in_backward() if self.dp_shard == "full" else contextlib.nullcontext()

    def eval_step(self, *args, **kwargs) -> torch.Tensor:
        """The loss of one batch as ``train_step`` weighs it (the mean over every counted token
        of the global batch, on every rank), forward only: dropout off, no graph kept for a
        backward, the pipeline's forward-only schedule. Parameters, gradients, the gradient
        hooks' state, the dropout step and torch's RNG are left as they were, and so is each
        module's train/eval mode. Collective like ``train_step``: every rank calls it."""
        micro, weights = self._microbatches(args, kwargs)
        with self._forward_only():
            if self._runner is None:
                total = None
                for mb, w in zip(micro, weights):
                    total = add_weighted(total, self.graph_module(*mb)[0], w)
            else:
                total = self._runner.run_forward(micro, weights, dropout_off=True)
        return self._global_loss(total)

    @contextlib.contextmanager
    def _forward_only(self):
        """No grad, every module in eval mode (the dropout key goes to its eval form, and the
        step counter stays), each module's own mode back afterwards: per module, not
        ``self.train(flag)``, so a submodule the caller set apart stays so."""
        modes = [(mod, mod.training) for mod in self.modules()]
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for mod, training in modes:
                mod.training = training

    def fp8_report(self, *args, **kwargs) -> List[dict]:
        """Per FP8 linear (``precision="fp8"``), from one forward of a batch and one gradient of
        its loss (eval mode; no parameter's ``.grad`` changes): the amax of its input, weight and
        output gradient ``dy``, the share of each that FP8 flushes to zero or saturates, and the
        relative error of the dequantised operand (``runtime.fp8_report``; ``format_report``
        prints it). Collective over tp, like a training step. Not for a pipelined program."""
        from fxmegatron.runtime.fp8_report import fp8_report
        if self.program.pipeline is not None:
            raise RuntimeError("fp8_report() runs the whole graph on one rank; this program is split into pipeline "
                               f"stages (pp={self.pp_size})")
        flat = self._flat(args, kwargs)
        with self._forward_only():
            return fp8_report(self.graph_module, flat)

    def logits(self, *args, gather: bool = True, **kwargs) -> torch.Tensor:
        """The logits of a batch, forward only, as the unmodified model computes them: the
        tensor its loss reads, before the loss flattens, upcasts or shifts it (the LM head's
        [B, S, V] output; HF models return it as ``.logits``). The batch has the example
        batch's structure, labels included or left out (the logits do not read them), and any
        multiple of the rows the graph was traced at (the example batch's rows over dp and
        microbatches): it runs in pieces of that size, concatenated along dim 0. With
        dp > 1 each rank runs the batch it is given, as it is: no share is taken.

        With tp > 1 the LM head is vocab-parallel. ``gather=True`` all-gathers the whole
        vocabulary on every tp rank; ``gather=False`` returns this rank's shard: columns
        ``[tp_rank * n, (tp_rank + 1) * n)`` of the vocabulary, ``n = out.shape[-1]`` (the
        whole vocabulary when tp left the LM head unsplit). Under sequence parallelism and
        under context parallelism (each cp rank's chunks all-gathered and put back in order)
        the sequence is always whole. Collective over tp and cp: every rank of them calls it,
        with the same batch.

        Dropout is off and nothing is kept for a backward; parameters, gradients, the
        dropout step, torch's RNG and every module's train/eval mode stay as they were. The
        first call cuts the program's fx graph at the logits (``passes.logits_output``,
        cached): that graph runs as it is, fused groups included, but not through
        ``torch.compile`` when the program was compiled with ``compile=True``. Not for a
        pipelined program (a RuntimeError): the logits live on the last stage's rank. A graph
        without exactly one cross-entropy to find the logits from raises a ``PassError``."""
        if self.program.pipeline is not None:
            raise RuntimeError(f"logits() needs the whole model on each rank, but this program is split into "
                               f"pipeline stages (pp={self.pp_size}, {len(self.program.pipeline.chunks)} chunks): "
                               f"the logits live on the last stage; use eval_step(batch) for the loss")
        if self._logits is None:
            self._logits = LogitsForward(self.program)
        flat = self._logits.flat(args, kwargs)
        if self.batch_checks > 0:
            self.batch_checks -= 1
            check_same_batch(flat, list(self.program.input_names), self.program.axes)
        with self._forward_only():
            return self._logits(flat, gather)

    def _microbatches(self, args, kwargs) -> Tuple[List[List], List[float]]:
        """This rank's microbatches of the batch (its dp share, split in m) and their loss weights."""
        flat = self._flat(args, kwargs)
        m = self.microbatches
        names = [f"input {i}" for i in range(len(flat))]
        whole = flat
        if self.dp_size > 1:    # this data-parallel rank's share of the global batch
            flat = split_batch(flat, self.dp_size, names, f"dp={self.dp_size}")[self.dp_rank]
        micro = split_batch(flat, m, names)
        self._check_micro(micro[0], f"microbatch (the batch split over dp={self.dp_size} and m={m})"
                          if m * self.dp_size > 1 else "batch")
        if self.id_checks > 0 and self.program.check_ids is not None:
            # every piece of the global batch, on every rank: all raise together, none waits
            self._check_ids(split_batch(whole, m * self.dp_size, names) if self.dp_size > 1 else micro)
        return micro, self._loss_weights(micro)

    def _check_ids(self, pieces) -> None:
        if self.id_checks > 0 and self.program.check_ids is not None:
            self.id_checks -= 1
            for i, piece in enumerate(pieces):
                self.program.check_ids(piece, f" (microbatch {i} of the {len(pieces)} the batch is split into)"
                                       if len(pieces) > 1 else "")

    def _global_loss(self, total: Optional[torch.Tensor]) -> torch.Tensor:
        """The step's loss on every rank: from the last pipeline stage, averaged over dp."""
        if self._runner is not None:
            total = self._broadcast_loss(total)
        if self.dp_size > 1:
            total = total.detach().float().clone()
            dist.all_reduce(total, group=self.dp_group)
            total /= self.dp_size
        return total

    def _loss_weights(self, micro) -> List[float]:
        """Weight of each microbatch's (mean) loss so that the step's loss is the mean over
        every counted token of the global batch: count_i·dp / N (1/m without a counter)."""
        if self.program.count_tokens is None:
            return loss_weights(None, 0, self.dp_size, len(micro))
        counts = [float(self.program.count_tokens(mb)) for mb in micro]
        total = torch.tensor(sum(counts), dtype=torch.float64, device=self.program.device)
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
        return loss_weights(counts, total.item(), self.dp_size, len(micro))

    def _broadcast_loss(self, total: Optional[torch.Tensor]) -> torch.Tensor:
        if self.pp_size == 1:
            return total
        ax = self.program.axes["pp"]
        t = total.float().reshape(()) if total is not None else torch.zeros((), device=self.program.device)
        dist.broadcast(t, src=ax.ranks[-1], group=ax.group)
        return t

    def dump(self, directory: str) -> None:
        """Write this rank's transformed graph(s), placements, collectives and decisions."""
        dump_program(directory, self.program, dist.get_rank() if dist.is_initialized() else 0)
