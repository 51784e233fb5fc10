"""End to end: one model trained by several frameworks side by side, one table.

Every layout trains the same model (the bundled GPT, or an unmodified Hugging Face causal LM)
on the same synthetic batch with the same optimizer, one layout after the other in one
process group:

    python benchmarks/end_to_end.py --model gpt1.3b --layouts eager,compile,fx,fx-fuse,fx-fuse-eager  # one GPU
    python benchmarks/end_to_end.py --model hf-llama1b --layouts eager,compile,fx,fx-compile
    torchrun --nproc-per-node 4 benchmarks/end_to_end.py --model gpt6.7b \\
        --layouts native-tp4,fx-tp4,fx-tp2-pp2-v2,fx-pp4-1f1b,fx-pp4-v2,fx-dp2-tp2
    torchrun --nproc-per-node 4 benchmarks/end_to_end.py --model hf-llama8b --layers 8 --layouts native-tp4,fx-tp4
    python benchmarks/end_to_end.py --hf-config path/to/config.json --layouts eager,compile,fx
    # CPU smoke runs (gloo), with the loss check against the plain model:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/end_to_end.py --tiny --device cpu \\
        --dtype float32 --check --steps 2 --warmup 1 \\
        --layouts native-tp4,fx-tp4,fx-tp2-pp2-v2,fx-pp4-1f1b,fx-pp4-v2,fx-dp2-tp2
    python benchmarks/end_to_end.py --tiny --device cpu --dtype float32 --check --layouts eager,compile,fx \\
        --steps 2 --warmup 1
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/end_to_end.py --model hf-llama1b \\
        --tiny --device cpu --check --steps 2 --warmup 1 --layouts native-tp2,fx-tp2

Models (--model, or --hf-config):
- The bundled GPT (examples/gpt.py: learned positions, LayerNorm, tanh-GeLU, untied
  embeddings, bias, dropout 0): gpt1.3b (24 layers, h 2048, 16 heads, s 2048, V 50304,
  global batch 8), gpt6.7b (32, 4096, 32, 2048, 50304, batch 16), gpt13b (40, 5120, 40, 2048,
  50304, batch 32); --layers/--hidden/--heads/--seq/--vocab/--global-batch override. --tiny: 8
  layers, h 64, 4 heads, s 64, V 512, batch 16 (8 layers: fx-pp4-v2 cuts the model into 8
  chunks of at least one block each; batch 16: with 8, pipeline microbatches hold one
  sequence, and fxmegatron's gloo-only reduce-scatter then returns a view of its input, which
  torch.library refuses).
- Hugging Face models, unmodified: ``AutoModelForCausalLM.from_config`` (random weights),
  ``attn_implementation="sdpa"``, ``use_cache=False`` (a training forward needs no KV cache;
  with one, each torch.compiled decoder layer of native-tpN recompiles on the cache's
  per-layer state and passes torch's limit of 8 recompilations, running the rest eagerly).
  ``hf-llama1b``: LlamaConfig with Llama-3.2-1B's shapes (16 layers, h 2048, 32 heads, 8 kv
  heads, SwiGLU ffn 8192, V 128256, rope theta 500000 (its llama3 rope scaling left out: no
  shape or cost changes), tied embeddings); ``hf-qwen1.5b``: Qwen2Config with Qwen2.5-1.5B's
  (28 layers, h 1536, 12 heads, 2 kv heads, ffn 8960, V 151936, q/k/v bias, tied);
  ``hf-llama8b``: Llama-3-8B's layers (h 4096, 32 heads, 8 kv heads, ffn 14336, V 128256,
  untied), 4 of its 32 by default; ``hf-mixtral``: Mixtral-8x7B's layers (8 experts of ffn
  14336, top-2, V 32000), 4 of 32; ``hf-moe64``: fine-grained experts on Qwen3-MoE's layers
  (h 2048, 16 heads, 4 kv heads, 64 experts of ffn 1408, top-8, V 151936), 8 layers; an MoE's
  FLOPs count the k of E experts a token uses (``-epN``: ``parallelize(ep=N)``, experts over N
  of the dp ranks). All: s 2048, global batch 4. ``--hf-config PATH_OR_JSON``:
  any config instead of --model: a config.json, a folder holding one, or the JSON text itself
  (with its model_type); s 2048, batch 4. --layers/--seq/--vocab/--global-batch override;
  --hidden/--heads shape GPT only (for an HF model they are refused: write a config).
  --tiny: the preset's family and tying at 4 layers, h 64, 8 heads, 4 kv heads, ffn 128,
  V 512, s 64, batch 16 (with --hf-config: s 64 and batch 16, the config as given).
  A batch is ``{"input_ids": ids, "labels": ids}``: the model shifts the labels, and its own
  loss (``ForCausalLMLoss``: fp32 logits, mean cross-entropy over the s - 1 predicted tokens
  of each sequence) is what every layout trains, fxmegatron included (as its trainer feeds HF
  models); tokens/s still counts B·s.

Layouts (--layouts, a comma list; the product of the parallel sizes must equal the
number of processes):
- ``eager``: the plain model. ``compile``: ``torch.compile(model)`` (``compile-autotune``: mode
  "max-autotune-no-cudagraphs", ``compile-cgraphs``: "reduce-overhead"): the whole model in one
  graph, a weak habit for HF models (traced whole, HF builds a materialised causal mask and
  repeats the kv heads). One process only.
- ``compile-layers``: the plain model with each decoder layer in ``torch.compile`` and the rest
  eager, as torchtitan compiles (HF then passes ``is_causal`` and ``enable_gqa`` to SDPA).
  ``compile-layers-liger``: the same after Liger's RMSNorm, SwiGLU MLP and fused linear
  cross-entropy (``liger_kernel.transformers.apply_liger_kernel_to_<type>(model=...)``, HF
  llama / qwen2 / mistral; liger-kernel 0.8.5, a pure-Python wheel, and a CUDA GPU).
  ``compile-layers-ao``: torchao float8 with per-layer compile.
- ``compile-ao``/``compile-aorow`` (with ``-cgraphs``/``-autotune`` too: ``compile-ao-cgraphs``):
  the FP8 baseline of a torch.compile user, torchao's float8 training (torchao 0.17:
  ``convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"``
  / ``"rowwise"), module_filter_fn=...)``), then ``torch.compile``: the counterpart of
  ``fx-compile-fp8``/``fx-compile-fp8row``. The filter (``e2e.builders.fp8_linear_filter``)
  keeps in high precision what fxmegatron's FP8 pass keeps: the LM head (``lm_head``, or a
  weight tied to the embedding) and linears with in/out features (or tokens) not multiples
  of 16. Needs torchao and an sm_89+ GPU (refused otherwise: torchao has no CPU float8).
- ``native-tpN``: PyTorch's own tensor parallelism on DTensor
  (``parallelize_module``), torchtitan's Llama plan: wte RowwiseParallel (output
  Shard(1)), LayerNorms SequenceParallel, attention/MLP inputs PrepareModuleInput
  Shard(1) -> Replicate, q/k/v/fc ColwiseParallel, attn.proj/mlp.proj RowwiseParallel
  (output Shard(1)), lm_head ColwiseParallel (input Shard(1), output Shard(-1)) with the
  loss under ``loss_parallel()`` (vocab-parallel cross-entropy: the full logits are never
  gathered, as fxmegatron does); the position embedding wpe stays replicated and its
  output is cut to the rank's sequence shard (Megatron's way); each Block is wrapped in
  ``torch.compile``. Attention runs on the local heads (a forward that views
  ``(B, T, -1, head_dim)``: the same math). HF models (model_type llama, qwen2 or mistral):
  the same plan on HF's names: embed_tokens RowwiseParallel (output Shard(1)),
  input_layernorm/post_attention_layernorm/norm SequenceParallel, self_attn/mlp
  PrepareModuleInput Shard(1) -> Replicate, q/k/v_proj and gate/up_proj ColwiseParallel,
  o_proj/down_proj RowwiseParallel (output Shard(1)), lm_head ColwiseParallel (input
  Shard(1), output Shard(-1)) and the model's own loss under ``loss_parallel()``; each
  decoder layer in ``torch.compile``; a tied LM head tied to the sharded embedding again.
  The hidden states between layers stay sequence-sharded DTensors (HF reads the sequence
  length, and so the rotary positions, off the embedding's output); HF's attention views
  ``(*input_shape, -1, head_dim)``, so the local heads need no change
  (benchmarks/e2e/hf_builders.py says more).
- ``native-tpN-async``: the same with torchtitan's async tensor parallelism: symmetric memory
  enabled for the tp group and inductor's ``_micro_pipeline_tp`` on, so the compiled layers'
  all-gather + matmul and matmul + reduce-scatter become torch's fused symmetric-memory ops.
  Both settings are process-wide (as for a torchtitan user): rows built after it compile
  with the flag on too. On torch 2.11 (two H100s, bf16) an fxmegatron row built after this one,
  or this row built after an fxmegatron row, trains wrong from its first gradient (docs/TRAINING.md,
  "Beside torch's async TP"): run it in a job of its own until that is understood.
- ``fx[-tpN][-ppN][-dpN][-vN][-mN][-1f1b|-gpipe|-interleaved][-fuse[-eager]][-compile|-cgraphs|-autotune][-nosp][-rsel|-rfull][-acc32][-zero1|-zero3[-repN]][-epN][-fp8|-fp8row][-ovN][-nccl|-ce]``:
  ``fxmegatron.parallelize`` on a ("dp", "pp", "tp") device mesh, the model built on the
  meta device (an HF model as fxmegatron's trainer builds it). tp > 1 turns sequence
  parallelism on (``-nosp``: off); ``-vN`` virtual stages (interleaved 1F1B); ``-mN``
  microbatches (default: --microbatches, 8, when pp > 1, else 1); ``-fuse``: "fxmegatron
  fuse=True + compile", the generated Triton kernels of the elementwise runs called from
  inside the compiled graph, inductor's kernels for the rest (``-fuse-eager``: fuse=True
  alone, the rest of the graph eager, as ``-fuse`` once meant); ``-compile``: each rank's
  graph (or pipeline chunk) through torch.compile
  (``-cgraphs``: its mode "reduce-overhead", CUDA graphs; ``-autotune``:
  "max-autotune-no-cudagraphs"); ``-rsel``/``-rfull``: recomputation; ``-acc32``: gradients
  summed over microbatches in fp32 (``grad_accum_dtype=torch.float32``); ``-zero1``: the
  optimizer's state sharded over dp (``dp_shard="optimizer"``, the optimizer ``pm.adamw``); ``-zero3``:
  parameters, gradients and state sharded (``dp_shard="full"``); ``-repN``: hybrid sharding, N replica
  groups each sharding over dp / N ranks (``dp_replicate=N``); ``-fp8``/``-fp8row``:
  linear layers' GEMMs in FP8 (``precision="fp8"``, tensorwise / rowwise scales); ``-ovN``: sequence
  parallelism's collectives overlapped with their matmuls, the batch cut in N pieces
  (``tp_comm_overlap=N``; over copy engines, the tp ranks' sequence slices, whatever N),
  moved by the copy engines where the group has symmetric memory
  (``-ce``: insist on it) or by NCCL (``-nccl``): ``tp_comm_transport``. ``-fadam`` (which
  once gave fxmegatron rows FusedAdamW alone) is still accepted and does nothing: every row
  now uses --optimizer's optimizer; with ``--optimizer master`` it is refused.
- ``fsdp2-dpN[-repN][-compile][-rfull]``: PyTorch's FSDP2 as torchtitan runs it (benchmarks/e2e/fsdp_builders.py);
  ``-repN``: HSDP, ``fully_shard`` on an (N, dp / N) mesh.
- ``-mN`` on eager/compile/native-tpN: gradient accumulation over N microbatches.
- ``-aN`` on any layout: the same row again under another name (``fx-compile,fx-compile-a2``: an
  A/A pair, whose paired ratio is the run's noise floor).

A step: the model phase, forward + backward of the global batch (``pm.train_step(batch)`` for
fxmegatron) and the gradient norm, unclipped (``torch.nn.utils.get_total_norm``, which takes
DTensor gradients, or ``pm.grad_norm()``); then the optimizer phase, the clip to norm 1.0 and
AdamW (lr 1e-4, torch's defaults otherwise) on fp32 master copies of the model's parameters
(bf16 by default): Megatron's mixed precision. The optimizer is the same for every row,
baselines included (--optimizer):
- ``fused`` (default): ``fxmegatron.optim.FusedAdamW``, AdamW on the masters in one pass
  (native-tpN's DTensor parameters through their local shards), the clip folded in:
  ``opt.step(clip_coefficient(norm, 1.0))``, the scale min(1, 1 / (norm + 1e-6)) that
  ``clip_grad_norm_`` applies.
- ``master``: ``MasterWeightAdamW`` (benchmarks/e2e/master_weights.py: torch.optim.AdamW,
  fused on CUDA, on the masters; the gradients copied in, the masters copied back) after the
  gradients are scaled by that coefficient (``torch.nn.utils.clip_grads_with_norm_``, the
  second half of ``clip_grad_norm_``; fxmegatron: ``pm.clip_grad_norm_``'s scaling).

Measured per layout: --warmup steps, then --steps timed steps (synchronised, a barrier
before each; a step's time is the slowest rank's), median step time; ``model ms`` and
``optim ms``: the medians of the two phases' times (a ``torch.cuda.Event`` before, between
and after them, no synchronisation inside the step; perf_counter on CPU), each step's the
slowest rank's, so they add up to about the step time, not exactly; tokens/s = B·s / step
time with B the global batch; model FLOPs per step (activation recomputation not counted)

    F = 6·B·s·P + 12·B·l·s²·(a·d)

P: the weights of the model's matmuls, every nn.Linear (and HF Conv1D) counted per module:
attention q, k, v (with GQA, k and v are kv_heads·d wide), o; the MLP's 2 (GPT) or 3
(SwiGLU: gate, up, down, h×ffn each); the LM head, counted when tied to the embedding too;
the embedding lookup and biases not counted. 6·B·s·P: 2 FLOPs a weight a token forward, 4
backward. 12·B·l·s²·(a·d), with a heads of dim d: the scores QKᵀ and their product with V,
2·B·s²·(a·d) FLOPs each in the forward, times 3 with the backward, the causal mask's
skipped half counted as if computed (as Korthikanti et al. 2022 count it). For GPT (P =
12·l·h² + V·h, a·d = h) this is Korthikanti's F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)). A
mixture of experts would count every expert (an upper bound).

TFLOP/s per GPU = F / step time / world size; MFU against a bf16 8192×8192×8192 matmul
timed at the start of the run (--peak-tflops overrides); peak memory (max over ranks of
torch.cuda.max_memory_allocated, reset after the layout's model is built, so the
fp32-then-cast build of eager/native GPT models is not counted); loss of the first and
last step. Then one more step under torch.profiler on rank 0, whose GPU kernels give:
compute (union of the non-communication kernels), exposed communication (a collective
NCCL kernel running and no compute kernel), pipeline bubble (an NCCL send/recv kernel
running and no compute kernel) and idle (the step's wall time minus the union of all
kernels), printed in ms and in % of the profiled step's wall time (which the profiler
makes somewhat longer than the median step). CPU runs profile too (--profile-dir writes
their traces) but have no kernels, so the breakdown is left empty. After the table a
``compile:`` line per row: torch.compile's graph breaks (the first 3 reasons), recompilations
and graphs compiled during the row's build and steps (dynamo's counters, the max over ranks,
the last round's; e2e/compile_stats.py), and the SDPA backend that the profiled step's op and
kernel names show (``not profiled`` with --no-profile or --interleave). --json writes every row (``optimizer``,
``model_ms``, ``optim_ms`` and their per-step lists, ``graph_breaks``, ``graph_break_reasons``,
``recompilations``, ``graphs_compiled``, ``sdpa_backend`` among its fields) and the model's
shapes, parameter counts and F.

``--check`` (float32) trains the plain model for the first two steps (with the run's
optimizer) and compares every layout's first two losses and first gradient norm (before
clipping) with it; more than 1e-4 relative anywhere, or a layout that fails, exits
non-zero. ``--check --dtype bfloat16`` (at the benchmarked shape): before timing, each row's
first gradients, parameter by parameter, against the plain model's in float32, a row failing
when one lands more than 2× as far off as the plain model's own bf16 step (+1e-3;
e2e/grad_check.py; at world > 1 every rank runs the plain model on its own GPU, so it must fit
one); the timed rows then start from the checked weights. fxmegatron layouts then get the plain model's weights (``state_dict=``);
otherwise they initialise their own shards (N(0, 0.02)), so their first loss differs
slightly from eager's. An HF config with dropout fails the check (fxmegatron draws its own
masks); the presets have none.

A layout that fails (an OOM, say) gives an "error" row and the run goes on: ranks agree
through an all-reduce of a failure flag after each layout. A rank that fails in the
middle of a collective, or a layout that deadlocks, still leaves the others waiting until
the backend's timeout; ``--hang-dump SECONDS`` prints every rank's Python stacks when a
layout runs longer than that.

Problems this benchmark found in fxmegatron on 4 H200s, fixed since: ``fx-dp2-*`` failed
at once (the dp all-reduce of the token counts was a CPU tensor), and ``fx-tp2-pp2-v2``
hung in its first step (every boundary relayed sequence parallelism's per-parameter
copies: 39 tensors per microbatch instead of 1).

This script parses the arguments and runs the rounds; the parts are in benchmarks/e2e/:
models (the model, its batch, loss and FLOPs), layouts (the names above), optimizers and
master_weights (--optimizer), builders and hf_builders (each framework's model), measure
(timing, memory), compile_stats (torch.compile's counts), interleave (--interleave: the layouts
alternated step by step), profiling (the breakdown), report (the table, the --check, --json).
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # benchmarks/: the e2e package

import e2e  # noqa: E402,F401  (puts examples/ and the repository root on sys.path)
from e2e.builders import initial_state, reference_losses  # noqa: E402
from e2e.grad_check import build_row, check_bf16  # noqa: E402
from e2e.layouts import check_layout, parse_layout  # noqa: E402
from e2e.measure import matmul_tflops, merge_rounds, run_guarded  # noqa: E402
from e2e.models import HF_MODELS, MODEL_NAMES, build_spec  # noqa: E402
from e2e.optimizers import OPTIMIZERS  # noqa: E402
from e2e.interleave import run_interleaved  # noqa: E402
from e2e.report import (CHECK_RTOL, check_rows, print_compile, print_header, print_paired,  # noqa: E402
                        print_round, print_rounds, print_table, write_json)

from fxmegatron.runtime.distributed import init_from_env, make_mesh, read_env  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt1.3b", choices=MODEL_NAMES)
    ap.add_argument("--hf-config", default="", metavar="PATH_OR_JSON",
                    help="any Hugging Face config (config.json, its folder, or the JSON text) instead of --model")
    ap.add_argument("--tiny", action="store_true",
                    help="GPT: 8 layers, h 64, 4 heads, s 64, V 512, batch 16; HF: 4 layers, h 64, 8 heads, 4 kv "
                         "heads, ffn 128, V 512, s 64, batch 16 (CPU smoke)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches of layouts with pp > 1 and no -mN")
    ap.add_argument("--layouts", default="eager,compile,fx",
                    help="a comma list of the layouts above; fx-fuse: fxmegatron fuse=True + compile, "
                         "fx-fuse-eager: fuse=True with the rest of the graph eager; compile-ao / compile-aorow: "
                         "torchao float8 training (tensorwise / rowwise) + torch.compile, the baseline of "
                         "fx-compile-fp8 / fx-compile-fp8row")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the layouts this many times, every other round in reverse order; a row's step "
                         "time is the median over all its rounds' timed steps")
    ap.add_argument("--interleave", action="store_true",
                    help="build every layout first, then alternate them step by step, every other pass reversed; "
                         "each row gets its step times paired with the first layout's (e2e/interleave.py); "
                         "no peak memory, no profile")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="fused",
                    help="every row's optimizer: fused (fxmegatron's FusedAdamW, the clip folded in) or master "
                         "(MasterWeightAdamW after clipping)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="model parameters (default bfloat16; float32 with --check)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="MFU reference instead of the measured bf16 matmul")
    ap.add_argument("--check", action="store_true",
                    help=f"compare every layout's first losses with the plain model's (float32, rel. {CHECK_RTOL}; "
                         "bfloat16: each gradient, e2e/grad_check.py)")
    ap.add_argument("--json", default="", help="write every row and the run's settings here (rank 0)")
    ap.add_argument("--profile-dir", default="", help="write a chrome trace per layout (rank 0)")
    ap.add_argument("--no-profile", action="store_true", help="no profiled step (no breakdown)")
    ap.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config KEY (dotted) to VALUE (a Python literal) before any "
                         "layout compiles, every row; repeatable")
    ap.add_argument("--hang-dump", type=float, default=0, metavar="SECONDS",
                    help="print every thread's Python stack (each rank) when a layout runs longer than this")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.check else "bfloat16"
    return args


def set_inductor_config(settings) -> list:
    """Apply ``--inductor-config KEY=VALUE`` settings; the problems with them, as messages."""
    import ast
    import torch._inductor.config as config
    problems = []
    for item in settings:
        key, eq, text = item.partition("=")
        owner, _, leaf = key.strip().rpartition(".")
        target = config
        for part in owner.split(".") if owner else []:
            target = getattr(target, part, None)
        if not eq or target is None or not hasattr(target, leaf):
            problems.append(f"--inductor-config {item!r}: torch {torch.__version__}'s inductor has no setting {key!r}")
            continue
        try:
            setattr(target, leaf, ast.literal_eval(text.strip()))
        except (ValueError, SyntaxError) as exc:
            problems.append(f"--inductor-config {item!r}: the value is not a Python literal ({exc})")
    return problems


def main(argv=None):
    args = parse_args(argv)
    env = read_env(one_process_port=0)     # plain `python end_to_end.py`: a one-process group
    if not env.launched:
        launcher = "python"
    else:
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])}"
    world, lead = env.world, env.lead

    problems, spec = [], None
    hf = bool(args.hf_config) or args.model in HF_MODELS
    if hf and (args.hidden is not None or args.heads is not None):
        problems.append("--hidden and --heads shape the bundled GPT; for an HF model write a config (--hf-config)")
    else:
        try:
            spec = build_spec(args)
        except (ValueError, TypeError, KeyError, OSError) as exc:
            problems.append(f"model: {type(exc).__name__}: {exc}")
    if spec is not None:    # the settings the run ended up with, for the header and --json
        args.layers, args.hidden, args.heads = spec.layers, spec.hidden, spec.heads
        args.seq, args.vocab, args.global_batch = spec.seq, spec.vocab, spec.batch
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        problems.append("--steps and --rounds must be >= 1 and --warmup >= 0")
    if args.interleave and args.rounds > 1:
        problems.append("--interleave alternates the layouts at every step: give --steps, not --rounds")
    if spec is not None and spec.kind == "gpt" and spec.hidden % spec.heads:
        problems.append(f"--hidden {spec.hidden} is not divisible by --heads {spec.heads}")
    layouts = []
    for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
        try:
            lay = parse_layout(name, args.microbatches)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        why = check_layout(lay, world, spec, args.optimizer, args.device) if spec is not None else None
        if why:
            problems.append(why)
        layouts.append(lay)
    if not layouts:
        problems.append("no layouts given (--layouts)")
    problems += set_inductor_config(args.inductor_config)
    if problems:
        # only rank 0 fails: torchrun ends the others as soon as one fails, maybe before rank 0 printed
        if lead:
            print("end_to_end.py: error:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
            return 2
        return 0

    env = init_from_env(args.device, env=env)
    rc = bench(args, spec, layouts, env, launcher)
    if rc:
        # A failed layout can leave sends/receives pending (a broken pipeline step); tearing the
        # process group down then may abort the process. Leave with the exit code instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    dist.destroy_process_group()
    return rc


def bench(args, spec, layouts, env, launcher):
    dev, lead, world = env.device, env.lead, env.world
    dtype = getattr(torch, args.dtype)

    @functools.lru_cache(maxsize=None)
    def meshes(**sizes):   # one mesh (and its process groups) per shape, shared by the layouts
        return make_mesh(env, **sizes)

    peak_tflops = args.peak_tflops
    if peak_tflops is None and dev.type == "cuda":
        t = torch.tensor([matmul_tflops(dev)], dtype=torch.float64, device=dev)
        dist.broadcast(t, src=0)
        peak_tflops = t.item()
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    batch = spec.make_batch(dev)
    command = f"{launcher} {' '.join(sys.argv)}"
    if lead:
        print_header(command, dev_name, world, dist.get_backend(), spec, args, peak_tflops)
        print("layouts: " + "; ".join(f"{lay.name}: {lay.label}" for lay in layouts), flush=True)

    ref_losses, ref_norm, ref_state = None, None, None
    if args.check and dtype is torch.bfloat16:
        # before timing: each row's first gradients against the plain model's, as exact as its bf16
        build = functools.partial(build_row, spec=spec, dev=dev, batch=batch, meshes=meshes)
        failed, ref_state = check_bf16(layouts, build, spec, dev, batch, lead)
        if failed:
            return 1
    elif args.check:
        ref_losses, ref_norm, ref_state = reference_losses(spec, args, dev, dtype, batch,
                                                           steps=min(2, args.warmup + args.steps))
        if lead:
            print(f"check: plain model's first losses {[round(x, 6) for x in ref_losses]}, first gradient norm "
                  f"{ref_norm:.6g}", flush=True)
    elif spec.kind != "gpt" and len({lay.kind in ("fx", "fsdp2") for lay in layouts}) == 2 or \
            any(lay.kind == "fsdp2" for lay in layouts):
        ref_state = initial_state(spec, dev, dtype)     # HF's own initialisation for the fx rows too

    if args.interleave:
        rows = run_interleaved(layouts, spec, args, dev, dtype, batch, meshes,
                               lambda lay: ref_state if lay.kind in ("fx", "fsdp2") else None, peak_tflops)
        rows = [dict(row, label=lay.label) for row, lay in zip(rows, layouts)]
        if lead:
            for row in rows:
                print_round(row, row["layout"], 0, 1)
    else:
        runs = {lay.name: [] for lay in layouts}
        for r in range(args.rounds):
            # every other round backwards: each layout runs early and late alike, so a drift of the
            # GPU's clock (it runs at its power limit) does not favour the layout that runs first
            for lay in (layouts if r % 2 == 0 else layouts[::-1]):
                row = run_guarded(lay, spec, args, dev, dtype, batch, meshes,
                                  ref_state if lay.kind in ("fx", "fsdp2") else None, peak_tflops,
                                  profile=r == args.rounds - 1)
                runs[lay.name].append(row)
                if lead:
                    print_round(row, lay.name, r, args.rounds)
        rows = [dict(merge_rounds(runs[lay.name], spec, world, peak_tflops), label=lay.label) for lay in layouts]

    failed_check = False
    if lead:
        print()
        print_table(rows)
        print_rounds(rows)
        print_paired(rows)
        print_compile(rows)
    if args.check and ref_losses is not None:
        failed_check = check_rows(rows, ref_losses, ref_norm, lead)
    if lead and args.json:
        write_json(args.json, command, dev_name, world, args, spec, peak_tflops, ref_losses, ref_norm, rows)
    if lead:
        sys.stdout.flush()
    dist.barrier()      # no rank leaves (torchrun would end the others) before rank 0 has printed
    if failed_check:
        return 1
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
