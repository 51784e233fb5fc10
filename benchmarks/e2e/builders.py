"""Each framework's model for a layout, as a ``Job`` the training loop runs: the plain model
(eager, torch.compile), PyTorch-native DTensor tensor parallelism, fxmegatron. Also the
synthetic batch and the plain model's reference losses for --check."""
from __future__ import annotations

import contextlib
import gc
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig

import fxmegatron
from e2e.master_weights import MasterWeightAdamW, local_tensor


@dataclass
class Job:
    """What the training loop needs from a layout."""
    params: list
    fwd_bwd: Callable[[], torch.Tensor]    # forward + backward of the global batch; returns the loss
    clip: Callable[[], object]
    keep: list                             # objects to free after the layout
    norm: Optional[Callable[[], torch.Tensor]] = None   # the gradient norm without clipping (-fadam)


def plain_model(cfg: GPTConfig, dev, dtype) -> GPT:
    """The bundled GPT on ``dev`` in ``dtype``, seeded: every layout that builds it gets the same weights."""
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(cfg)
    return model.to(dtype)


def accumulate(fn, ids, labels, m, context=None):
    """forward + backward over m microbatches of (ids, labels); returns the mean loss."""
    id_chunks, label_chunks = ids.chunk(m), labels.chunk(m)

    def fwd_bwd():
        total = None
        with (context() if context else contextlib.nullcontext()):
            for x, y in zip(id_chunks, label_chunks):
                loss = fn(x, y)
                (loss / m).backward()
                val = local_tensor(loss.detach()) / m
                total = val if total is None else total + val
        return total
    return fwd_bwd


def build_eager(lay, cfg, dev, dtype, ids, labels, **_):
    model = plain_model(cfg, dev, dtype)
    mode = lay.compile if isinstance(lay.compile, str) else None
    fn = torch.compile(model, mode=mode) if lay.kind == "compile" else model
    params = list(model.parameters())
    return Job(params, accumulate(fn, ids, labels, lay.m),
               lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), [model, fn])


def _local_heads_forward(self, x):
    """examples/gpt.py's SelfAttention.forward with ``view(B, T, -1, hd)``: after a
    column-parallel q/k/v each rank holds n_head / tp heads. Same math otherwise."""
    B, T, C = x.shape
    hd = self.head_dim
    q = self.q(x).view(B, T, -1, hd).transpose(1, 2)
    k = self.k(x).view(B, T, -1, hd).transpose(1, 2)
    v = self.v(x).view(B, T, -1, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       dropout_p=self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(B, T, -1)
    return self.resid_drop(self.proj(y))


def build_native(lay, cfg, dev, dtype, ids, labels, meshes, **_):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)
    mesh = meshes(tp=lay.tp)
    model = plain_model(cfg, dev, dtype)
    block_plan = {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        block.attn.head_dim = cfg.n_embd // cfg.n_head
        block.attn.forward = types.MethodType(_local_heads_forward, block.attn)
        parallelize_module(block, mesh, block_plan)
    parallelize_module(model, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        # loss parallel: logits stay sharded over the vocabulary, cross-entropy runs on the shards
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    # wpe: replicated weight; its (T, C) output is cut to this rank's sequence shard (no communication;
    # the backward all-gathers the gradient), to add to wte's sequence-sharded output.
    distribute_module(
        model.wpe, mesh,
        input_fn=lambda mod, inputs, m: tuple(DTensor.from_local(t, m, [Replicate()], run_check=False)
                                              for t in inputs),
        output_fn=lambda mod, out, m: out.redistribute(m, [Shard(0)]).to_local())
    for i in range(len(model.blocks)):
        model.blocks[i] = torch.compile(model.blocks[i])
    params = list(model.parameters())
    return Job(params, accumulate(model, ids, labels, lay.m, context=loss_parallel),
               lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), [model])


def build_fx(lay, cfg, dev, dtype, ids, labels, meshes, ref_state=None, **_):
    mesh = meshes(dp=lay.dp, pp=lay.pp, tp=lay.tp)
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    pm = fxmegatron.parallelize(model, mesh, (ids, labels), sequence_parallel=lay.sp, recompute=lay.recompute,
                                microbatches=lay.m, virtual_stages=lay.v, schedule=lay.schedule, fuse=lay.fuse,
                                compile=lay.compile, tp_comm_overlap=lay.overlap,
                                tp_comm_transport=lay.transport, state_dict=ref_state,
                                grad_accum_dtype=torch.float32 if lay.fp32_accum else None)
    return Job(list(pm.parameters()), lambda: pm.train_step(ids, labels), lambda: pm.clip_grad_norm_(1.0), [pm],
               norm=pm.grad_norm)


BUILDERS = {"eager": build_eager, "compile": build_eager, "native": build_native, "fx": build_fx}


def reference_losses(cfg, args, dev, dtype, ids, labels, steps=2):
    """The plain model's first losses and first gradient norm (the --check reference) and its
    initial weights (on CPU)."""
    model = plain_model(cfg, dev, dtype)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    opt = MasterWeightAdamW(model.parameters(), lr=args.lr, fused=dev.type == "cuda")
    losses, norms = [], []
    for _ in range(steps):
        loss = model(ids, labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        losses.append(loss.item())
    del model, opt
    gc.collect()
    return losses, norms[0], state


def make_batch(cfg, batch, dev, seed=0):
    """The synthetic batch: random tokens, labels = the next token."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return seq[:, :-1].contiguous().to(dev), seq[:, 1:].contiguous().to(dev)


def count_params(cfg: GPTConfig) -> int:
    """The model's parameter count (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())
