"""``fxmegatron train CONFIG --dry-run``: the run's plan (``fxmegatron.train.plan``) from the config,
with no process group and no weights: parameters and memory per rank, the schedule, and what one
step costs in FLOPs."""
from __future__ import annotations

from fxmegatron.train.metrics import flops_per_token
from fxmegatron.train.plan import plan_run
from fxmegatron.train.setup import Prepared


def print_plan(prep: Prepared) -> None:
    cfg = prep.cfg
    batch = prep.batch(prep.train.windows(0), "cpu")
    device = "cpu" if cfg.run.device == "cpu" else "cuda"
    plan = plan_run(prep.source.model, batch, layout=prep.layout, param_dtype=prep.dtype,
                    optimizer="fused_adamw" if cfg.optim.fused else "adamw", device=device)
    print(f"config: {cfg.source}")
    print(plan.format())
    tokens = cfg.data.global_batch * cfg.data.seq_len
    f = flops_per_token(prep.source.model, cfg.data.seq_len, prep.layers, prep.hidden)
    print(f"step: {cfg.data.global_batch} x {cfg.data.seq_len} = {tokens:,} tokens, {f * tokens / 1e12:,.1f} TFLOP "
          f"(6 x matmul parameters + 6 x layers x seq x hidden per token: causal attention counted as half of "
          f"full); {cfg.run.steps} steps; data: {prep.tokens_train:,} training tokens, {prep.tokens_valid:,} held out",
          flush=True)
