"""Each framework's model for a layout, as a ``Job`` the training loop runs: the plain model
(eager, torch.compile, torchao float8 + torch.compile), PyTorch-native DTensor tensor parallelism
(the bundled GPT here, HF
models in ``e2e.hf_builders``), fxmegatron. Also the plain model's reference losses for --check."""
from __future__ import annotations

import contextlib
import gc
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmegatron
from fxmegatron.passes.fp8 import FP8Policy
from fxmegatron.layout import Layout as FxLayout
from e2e.master_weights import full_tensor, local_tensor
from e2e.optimizers import make_optimizer


@dataclass
class Job:
    """What the training loop needs from a layout: ``fwd_bwd`` runs forward and backward of the
    global batch and returns the loss; ``norm`` returns the gradient norm of the whole model
    (unclipped, a plain tensor on the device); ``clip(norm)`` scales the gradients by the clip
    coefficient ``min(1, 1.0 / (norm + 1e-6))`` (--optimizer master; FusedAdamW folds it in)."""
    params: list
    fwd_bwd: Callable[[], torch.Tensor]
    norm: Callable[[], torch.Tensor]
    clip: Callable[[torch.Tensor], None]
    keep: list                             # objects to free after the layout
    adamw: Optional[Callable] = None       # the FusedAdamW to use (a ParallelModel's pm.adamw), if not over params


def accumulate(fn, spec, batch, m, context=None):
    """forward + backward of ``batch`` (the model's own loss, ``spec.loss``) over m microbatches;
    returns the mean loss."""
    chunks = spec.chunk(batch, m)

    def fwd_bwd():
        total = None
        with (context() if context else contextlib.nullcontext()):
            for mb in chunks:
                loss = spec.loss(fn, mb)
                (loss / m).backward()
                val = local_tensor(loss.detach()) / m
                total = val if total is None else total + val
        return total
    return fwd_bwd


def torch_job(params, fwd_bwd, keep) -> Job:
    """A Job whose gradient norm and clipping are torch's (``clip_grad_norm_`` in two halves:
    ``get_total_norm``, then ``clip_grads_with_norm_``), DTensor gradients included."""
    def norm():
        return full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0))
    return Job(params, fwd_bwd, norm, lambda n: torch.nn.utils.clip_grads_with_norm_(params, 1.0, n), keep)


FP8_ALIGN = 16     # torch._scaled_mm's alignment of every GEMM dim (fxmegatron.passes.fp8.ALIGN)


def fp8_linear_filter(model: nn.Module, tokens: Optional[int] = None) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn`` (called with each linear and its FQN; True: convert it to
    float8) that keeps in high precision exactly what fxmegatron's FP8 pass
    (``fxmegatron.passes.fp8``) keeps, so that compile-ao and fx-compile-fp8 quantise the same
    linears: the LM head (the module named ``lm_head``, as in the bundled GPT and in HF causal
    LMs, and any linear whose weight an embedding of ``model`` also reads: a tied head), and any
    linear whose in or out features are not multiples of 16. ``tokens``, the tokens a linear
    sees per microbatch, is the third GEMM dim the pass checks; unaligned, it keeps every linear.
    The pass also rewrites HF's Conv1D matmuls (GPT-2); torchao converts nn.Linear only."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def select(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or fqn.rsplit(".", 1)[-1] == "lm_head" or id(mod.weight) in embedded:
            return False
        dims = (mod.in_features, mod.out_features) + ((tokens,) if tokens is not None else ())
        return all(d % FP8_ALIGN == 0 for d in dims)
    return select


def build_eager(lay, spec, dev, dtype, batch, **_):
    model = spec.plain(dev, dtype)
    if lay.fp8:
        # imported here: torchao is optional (check_layout has refused these rows without it)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        tokens = spec.batch // lay.m * spec.seq
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(lay.fp8),
                                   module_filter_fn=fp8_linear_filter(model, tokens))
    if lay.liger:
        apply_liger(model, spec.model_type)
    if lay.per_layer:
        layers = decoder_layers(model)
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i])
        fn = model
    else:
        mode = lay.compile if isinstance(lay.compile, str) else None
        fn = torch.compile(model, mode=mode) if lay.kind == "compile" else model
    return torch_job(list(model.parameters()), accumulate(fn, spec, batch, lay.m), [model, fn])


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks a torchtitan user compiles one by one: the bundled GPT's ``blocks``, an
    HF causal LM's ``model.layers``."""
    if hasattr(model, "blocks"):
        return model.blocks
    return getattr(model, model.base_model_prefix).layers


def apply_liger(model: nn.Module, model_type: str) -> None:
    """Liger's RMSNorm, SwiGLU MLP and fused linear cross-entropy on this model instance, as its
    users run them (``apply_liger_kernel_to_<type>(model=...)``). Its rotary kernel is left out
    (the issue's baseline names these three). Liger also swaps the classes and the rotary function
    in transformers' modeling module for models built later; those are put back, so that the
    other rows of the run (built before or after) run transformers' own code."""
    import importlib

    import liger_kernel.transformers as liger
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved = dict(vars(modeling))
    getattr(liger, f"apply_liger_kernel_to_{model_type}")(rope=False, rms_norm=True, swiglu=True,
                                                           fused_linear_cross_entropy=True, model=model)
    for name, value in saved.items():
        if vars(modeling).get(name) is not value:
            setattr(modeling, name, value)


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


def enable_async_tp(mesh) -> None:
    """torchtitan's async tensor parallelism: symmetric memory for the tp group and inductor's
    micro-pipeline pass, which turns each all-gather + matmul and matmul + reduce-scatter of the
    compiled layers into torch's fused symmetric-memory ops. Both settings are process-wide, as
    they are for a torchtitan user: layouts compiled after this one see the inductor flag too."""
    import torch._inductor.config as inductor_config
    inductor_config._micro_pipeline_tp = True
    if mesh.device_type == "cuda":
        import warnings
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        with warnings.catch_warnings():     # deprecated (a no-op) in later torch; needed in 2.11
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(mesh.get_group().group_name)


def build_native(lay, spec, dev, dtype, batch, meshes, **_):
    if spec.kind == "hf":
        from e2e.hf_builders import build_hf_native
        return build_hf_native(lay, spec, dev, dtype, batch, meshes)
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)
    mesh = meshes(tp=lay.tp)
    cfg = spec.config
    model = spec.plain(dev, dtype)
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
    if lay.async_tp:
        enable_async_tp(mesh)
    for i in range(len(model.blocks)):
        model.blocks[i] = torch.compile(model.blocks[i])
    return torch_job(list(model.parameters()), accumulate(model, spec, batch, lay.m, context=loss_parallel),
                     [model])


def fx_layout(lay, ref_state=None) -> FxLayout:
    """An fx row (``e2e.layouts.Layout``, which names the row) as fxmegatron's ``Layout``: what
    ``parallelize`` is given, checked before a mesh is built."""
    return FxLayout(dp=lay.dp, pp=lay.pp, tp=lay.tp, sequence_parallel=lay.sp, recompute=lay.recompute,
                    microbatches=lay.m, virtual_stages=lay.v, schedule=lay.schedule, fuse=lay.fuse,
                    compile=lay.compile, tp_comm_overlap=lay.overlap, tp_comm_transport=lay.transport,
                    state_dict=ref_state, grad_accum_dtype=torch.float32 if lay.fp32_accum else None,
                    dp_shard="optimizer" if lay.zero1 else "full" if lay.zero3 else "none", dp_replicate=lay.rep,
                    ep=lay.ep, **({"precision": "fp8", "fp8_recipe": lay.fp8} if lay.fp8 else {}),
                    **({"fp8_policy": FP8Policy(lm_head=True, name="all + lm head")} if lay.fp8_head else {}))


def build_fx(lay, spec, dev, dtype, batch, meshes, ref_state=None, **_):
    from fxmegatron.optim import clip_coefficient
    from fxmegatron.runtime.grad_norm import scale_grads_
    mesh = meshes(dp=lay.dp, pp=lay.pp, tp=lay.tp)
    model = spec.meta(dtype)
    pm = fxmegatron.parallelize(model, mesh, batch, **fx_layout(lay, ref_state).options())
    params = list(pm.parameters())
    # pm.clip_grad_norm_(1.0) in two halves: the norm, then the scaling
    return Job(params, lambda: pm.train_step(batch), pm.grad_norm,
               lambda n: scale_grads_(params, clip_coefficient(n, 1.0)), [pm], pm.adamw)


def _fsdp2(*args, **kw):
    from e2e.fsdp_builders import build_fsdp2
    return build_fsdp2(*args, **kw)


BUILDERS = {"eager": build_eager, "compile": build_eager, "native": build_native, "fx": build_fx, "fsdp2": _fsdp2}


def initial_state(spec, dev, dtype):
    """The plain model's initial weights (on CPU). fxmegatron initialises a model built on the
    meta device itself (N(0, 0.02), ``lower/materialize.py``), which is not every HF model's
    own initialisation (GPT-2 scales its residual projections by 1/√(2·layers)): handed these,
    the fx rows start from the weights the other rows start from, and the loss columns compare."""
    model = spec.plain(dev, dtype)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    del model
    gc.collect()
    return state


def reference_losses(spec, args, dev, dtype, batch, steps=2):
    """The plain model's first losses and first gradient norm (the --check reference), trained
    with the run's optimizer, and its initial weights (on CPU)."""
    model = spec.plain(dev, dtype)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    job = torch_job(params, accumulate(model, spec, batch, 1), [model])
    opt, optim_step = make_optimizer(args.optimizer, job, args.lr, dev)
    losses, norms = [], []
    for _ in range(steps):
        loss = job.fwd_bwd()
        norm = job.norm()
        norms.append(norm.item())
        optim_step(norm)
        losses.append(loss.item())
    del model, opt, optim_step, job
    gc.collect()
    return losses, norms[0], state
