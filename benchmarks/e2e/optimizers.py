"""The run's optimizer (--optimizer), the same for every layout: ``fused`` is fxmegatron's
``FusedAdamW`` (AdamW on fp32 masters in one pass, the clip's coefficient folded in), ``master``
is ``MasterWeightAdamW`` (torch's AdamW on fp32 masters) after torch-style clipping."""
from __future__ import annotations

from e2e.master_weights import MasterWeightAdamW

OPTIMIZERS = {"fused": "FusedAdamW", "master": "MasterWeightAdamW"}


def make_optimizer(kind: str, job, lr: float, dev):
    """``(optimizer, optim_step)`` for ``job``'s parameters; ``optim_step(norm)`` is the step's
    optimizer phase, given the gradient norm (unclipped) that the model phase computed: the clip
    to 1.0 and the AdamW update (lr ``lr``, torch.optim.AdamW's defaults otherwise)."""
    if kind == "fused":
        from fxmegatron.optim import FusedAdamW, clip_coefficient
        # DTensor parameters: through their local shards; a ParallelModel's own (sharded under dp_shard)
        opt = job.adamw(lr=lr) if job.adamw is not None else FusedAdamW(job.params, lr=lr)

        def optim_step(norm):
            opt.step(clip_coefficient(norm, 1.0))    # the clip inside the optimizer's pass
        return opt, optim_step
    if kind == "master":
        opt = MasterWeightAdamW(job.params, lr=lr, fused=dev.type == "cuda")

        def optim_step(norm):
            job.clip(norm)
            opt.step()
        return opt, optim_step
    raise ValueError(f"--optimizer {kind!r}: expected one of {', '.join(OPTIMIZERS)}")
