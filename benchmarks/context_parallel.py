"""Long context on two GPUs (issue 24): fxmegatron context parallelism against its tp2 + sp + full
recompute and against PyTorch's own context parallelism, on one unmodified HF Llama.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 benchmarks/context_parallel.py \\
        --seq 16384,32768,65536,131072 --layers 4 --rounds 2 --json cp.json
    python benchmarks/context_parallel.py --smoke      # CPU, gloo, spawns its 2 processes

(NVLink multicast off; the script also sets the three variables, before the group starts, where unset.)

Model: ``LlamaForCausalLM`` from a config (no download), Llama-3-8B's layer shapes (h 4096, 32
heads, 8 kv heads, ffn 14336, V 128256, rope theta 500000, untied), --layers of its 32 (4), bf16,
SDPA, ``use_cache=False``, global batch 1 of each --seq, labels = ids (the model's own shifted
loss). Every row starts from the same weights and trains with the same optimizer (--optimizer:
FusedAdamW, the clip to 1.0 folded in, as end_to_end.py's rows).

Rows (--layouts): ``fx-cp2-ring`` / ``fx-cp2-allgather``: ``fxmegatron.parallelize`` on a ("cp",)
mesh with that ``cp_attention`` (--cp-recompute, or a -none/-selective/-full part);
``fx-tp2-sp-full``: tp2 + sequence parallelism + recompute="full"; ``torch-cp``:
``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=, buffer_seq_dims=,
no_restore_buffers=)`` around forward and backward of the unmodified model, replicated on both
ranks (DDP, gradients summed). The context reorders its buffers head-tail (rank r keeps chunks
r and 2·cp−1−r of 2·cp, fxmegatron's cut), cuts them in place and sends SDPA's CUDA kernels
(flash, efficient, cuDNN) through its ring: on CPU the row says "needs CUDA". Its loss is cross
entropy over the model's bf16 logits, compiled (the upcast fused, as fxmegatron's loss rewrite
does; ``-hfloss``: HF's own loss, which copies the logits to fp32 first). ``-alltoall``: kv
passed around (``set_rotate_method``) instead of its default all-gather; ``-compile``: decoder
layers compiled; fx ``-zero1``: the optimizer's state sharded over the cp ranks
(``dp_shard="optimizer"``: gradients reduce-scattered, AdamW on each rank's half, parameters
all-gathered) instead of all-reduced gradients and a whole optimizer per rank; fx ``-zero3``:
``dp_shard="full"`` over the cp ranks (compiled on GPUs, its gathers and reduce-scatters are graph
nodes that inductor's overlap scheduler places under the compute). torch 2.11 and 2.13 share this API (2.13 falls back to an unbalanced cut when
2·cp does not divide s; 2.11 cannot: 2·cp must divide every --seq here).

Per row and --seq: step ms (median of the --steps timed steps, each the slowest rank's, rounds
pooled), tokens/s = B·s / step, TFLOP/s per GPU and MFU against a bf16 8192³ matmul timed here,
peak memory (torch.cuda.max_memory_allocated after the build, max over ranks), first loss, and a
profiled step on rank 0: compute, exposed communication (an NCCL kernel, collective or the ring's
P2P, and no compute) and idle. FLOPs of a step, causal attention counting half the scores:

    F = 6·B·s·P + 6·B·l·s²·a·d

(P matmul weights, a heads of dim d; QKᵀ and ·V take 2·B·s²·a·d each forward, ×3 with backward,
of which the causal mask skips half: HALF end_to_end.py's 12·B·l·s²·a·d, which counts the
skipped half as Korthikanti et al. do; recomputation not counted.) A failing row (OOM, refusal)
prints its error and the run goes on; --rounds 2 runs the layouts in order, then reversed;
--json is rewritten after each --seq. --check (float32): every row's first losses and gradient
norm against the plain model's (end_to_end.py's check, 1e-4). Exit 1 on a failed check or error
row. --smoke: CPU, gloo, tiny Llama (2 layers, h 64, 4 heads, 2 kv, ffn 128, V 256), s 64, 2
steps, float32, --check.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # benchmarks/: the e2e package

from e2e.builders import Job, reference_losses, torch_job  # noqa: E402  (e2e puts the repository on sys.path)
from e2e.measure import matmul_tflops, merge_rounds, run_guarded  # noqa: E402
from e2e.models import HF_MODELS, ModelSpec, hf_config  # noqa: E402
from e2e.optimizers import OPTIMIZERS  # noqa: E402
from e2e.report import CHECK_RTOL, check_rows, print_round  # noqa: E402

from fxmegatron.runtime.distributed import free_port, init_from_env, read_env  # noqa: E402

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LAYOUTS = "fx-cp2-ring,fx-cp2-allgather,fx-tp2-sp-full,torch-cp"
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)
FLOPS_TEXT = "F = 6·B·s·P + 6·B·l·s²·a·d (causal attention: half of end_to_end.py's 12·B·l·s²·a·d)"


class CausalSpec(ModelSpec):
    """end_to_end's model, its attention FLOPs counted for the causal half only."""

    def flops(self) -> float:
        b, s = self.batch, self.seq
        return 6 * b * s * self.matmul_params() + 6 * b * self.layers * s * s * self.heads * self.head_dim


def make_spec(args, seq: int) -> CausalSpec:
    cls, fields, _, _, _ = HF_MODELS["hf-llama8b"]
    fields = dict(fields, **TINY) if args.smoke else fields
    return CausalSpec("tiny-llama" if args.smoke else "hf-llama8b", "hf", hf_config(cls, fields, args.layers, seq),
                      seq, 1)


@dataclass
class Layout:
    name: str
    kind: str                   # "fx" or "torch"
    cp: int = 1
    tp: int = 1
    attention: str = "ring"     # fx: cp_attention; torch: its rotate method (allgather, alltoall)
    sp: bool = False
    recompute: str = "none"
    compile: bool = False
    m: int = 1                  # microbatches (run_layout records them)
    hf_loss: bool = False       # torch: HF's own loss (its fp32 copy of the logits) instead of the compiled one
    dp_shard: str = "none"      # fx -zero1 / -zero3: dp_shard "optimizer" / "full" over the cp ranks

    @property
    def label(self) -> str:
        tail = (", compiled" if self.compile else "") + {"none": "", "optimizer": ", optimizer sharded (ZeRO-1)",
                                                          "full": ", fully sharded (ZeRO-3)"}[self.dp_shard]
        if self.kind == "torch":
            return (f"torch context_parallel cp {self.cp}, kv by {self.attention}, model replicated (DDP)"
                    + (", decoder layers compiled" if self.compile else "")
                    + (", HF's loss (fp32 logits copy)" if self.hf_loss else ", compiled bf16-logits loss"))
        if self.cp > 1:
            return f"fxmegatron cp {self.cp}, {self.attention} attention, recompute {self.recompute}{tail}"
        return f"fxmegatron tp {self.tp}{' + sp' if self.sp else ''}, recompute {self.recompute}{tail}"


def parse_layout(name: str, cp_recompute: str, world: int) -> Layout:
    head, *toks = name.split("-")
    if head == "torch" and toks[:1] == ["cp"]:
        lay = Layout(name, "torch", cp=world, attention="allgather")
        for t in toks[1:]:
            if t not in ("alltoall", "compile", "hfloss"):
                raise ValueError(f"layout {name!r}: unknown part {t!r} (torch-cp[-alltoall][-compile][-hfloss])")
            if t == "hfloss":
                lay.hf_loss = True
            else:
                lay.attention, lay.compile = ("alltoall", lay.compile) if t == "alltoall" else (lay.attention, True)
        return lay
    if head != "fx":
        raise ValueError(f"layout {name!r}: expected fx-cpN-ring|allgather, fx-tpN[-sp][-full] or torch-cp")
    lay, recompute = Layout(name, "fx"), None
    for t in toks:
        num = re.fullmatch(r"(cp|tp)(\d+)", t)
        if num:
            setattr(lay, num.group(1), int(num.group(2)))
        elif t in ("ring", "allgather"):
            lay.attention = t
        elif t in ("none", "selective", "full"):
            recompute = t
        elif t in ("sp", "compile"):
            setattr(lay, t, True)
        elif t in ("zero1", "zero3"):
            lay.dp_shard = "optimizer" if t == "zero1" else "full"
        else:
            raise ValueError(f"layout {name!r}: unknown part {t!r}")
    if (lay.cp > 1) == (lay.tp > 1):
        raise ValueError(f"layout {name!r}: give one of cpN or tpN (N > 1)")
    lay.recompute = recompute or (cp_recompute if lay.cp > 1 else "none")
    return lay


def check_layout(lay: Layout, world: int, spec: ModelSpec):
    """Why ``lay`` cannot run here, or None."""
    if lay.cp * lay.tp != world:
        return f"{lay.name} needs {lay.cp * lay.tp} processes, the world has {world} (torchrun --nproc-per-node)"
    if lay.cp > 1 and spec.seq % (2 * lay.cp):
        return f"{lay.name}: 2·cp = {2 * lay.cp} must divide the sequence length {spec.seq} (head-tail cut)"
    if lay.tp > 1 and any(n % lay.tp for n in (spec.heads, spec.kv_heads, spec.vocab, spec.seq)):
        return f"{lay.name}: tp {lay.tp} must divide heads, kv heads, vocabulary and sequence length"
    return None


# ---- each row's model, as end_to_end's Job ----------------------------------------------------
def build_fx(lay, spec, dev, dtype, batch, meshes, ref_state=None, **_):
    import fxmegatron
    from fxmegatron.optim import clip_coefficient
    from fxmegatron.runtime.grad_norm import scale_grads_
    mesh = meshes(cp=lay.cp) if lay.cp > 1 else meshes(tp=lay.tp)
    pm = fxmegatron.parallelize(spec.meta(dtype), mesh, batch, sequence_parallel=lay.sp, recompute=lay.recompute,
                                compile=lay.compile, cp_attention=lay.attention, state_dict=ref_state,
                                dp_shard=lay.dp_shard)
    params = list(pm.parameters())
    return Job(params, lambda: pm.train_step(batch), pm.grad_norm,
               lambda n: scale_grads_(params, clip_coefficient(n, 1.0)), [pm], pm.adamw)


def _sum_hook(group, bucket):
    # each rank's loss is its share of the global mean: the gradient is the sum, not DDP's average
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _no_mask(module, args, kwargs):
    if kwargs.get("attention_mask") is not None:
        raise RuntimeError("torch-cp: HF built an attention mask; context_parallel's SDPA needs is_causal alone")


@functools.lru_cache(maxsize=None)
def _compiled_ce():
    """The fair loss for the torch rows: cross entropy summed over the tokens, compiled, so the
    upcast of the bf16 logits is fused into the loss kernels (no fp32 copy of the logits, as
    fxmegatron's loss rewrite), the usual habit of a user who compiles."""
    def ce(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                 ignore_index=-100, reduction="sum")
    return torch.compile(ce, dynamic=False)


def build_torch_cp(lay, spec, dev, dtype, batch, meshes, ref_state=None, **_):
    """The unmodified model under torch's context, and what it is fed: the labels shifted before the
    cut (``shift_labels``: the model's own shift of a rank's two chunks pairs wrong tokens);
    ``position_ids``, so that rotary sees global positions; an all-ones attention mask, without
    which HF reads the jump in the reordered positions as packed sequences and builds a block mask
    (SDPA loses is_causal; ``_no_mask`` checks); ``num_items_in_batch`` = B·(s−1), so each rank's
    loss is its sum over the global count and the summed gradients and losses are the batch mean."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method   # 2.7 on; a re-export in 2.13
    from torch.nn.parallel import DistributedDataParallel
    mesh = meshes(cp=lay.cp)
    model = spec.plain(dev, dtype)
    if ref_state is not None:
        model.load_state_dict(ref_state)
    for name, mod in model.named_modules():
        if name.endswith("self_attn"):
            mod.register_forward_pre_hook(_no_mask, with_kwargs=True)
    if lay.compile:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    group = mesh.get_group()
    ddp = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True, broadcast_buffers=False,
                                  device_ids=[dev.index] if dev.type == "cuda" else None)
    ddp.register_comm_hook(group, _sum_hook)
    ids = batch["input_ids"]
    b, s = ids.shape
    shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    whole = (ids, shifted, torch.arange(s, device=ids.device).expand(b, s).contiguous(), torch.ones_like(ids))
    count = torch.tensor(float(b * (s - 1)), device=dev)       # every label but the last: no -100 in the batch

    def fwd_bwd():
        set_rotate_method(lay.attention)
        ids_, labels, pos, mask = bufs = [t.clone() for t in whole]     # cut in place by the context
        failed = None
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1] * len(bufs), no_restore_buffers=set(bufs)):
            try:
                if lay.hf_loss:
                    loss = ddp(input_ids=ids_, labels=labels, shift_labels=labels, position_ids=pos,
                               attention_mask=mask, num_items_in_batch=count).loss
                else:
                    logits = ddp(input_ids=ids_, position_ids=pos, attention_mask=mask).logits
                    loss = _compiled_ce()(logits, labels) / count
                loss.backward()
            except Exception as exc:    # noqa: BLE001 -- re-raised below
                # torch 2.11's context has no try/finally: an error (an OOM) raised through it would
                # leave F.scaled_dot_product_attention patched for every later row
                failed = exc
        if failed is not None:
            raise failed
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
        return loss
    return torch_job(list(model.parameters()), fwd_bwd, [ddp, model])


BUILDERS = {"fx": build_fx, "torch": build_torch_cp}


# ---- the run ----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", help="comma list of sequence lengths (default 16384,32768,65536,131072; smoke 64)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 4; smoke 2)")
    ap.add_argument("--layouts", default=LAYOUTS, help=f"comma list (default {LAYOUTS})")
    ap.add_argument("--cp-recompute", choices=["none", "selective", "full"], default="none", help="fx-cpN's recompute")
    ap.add_argument("--steps", type=int, help="timed steps (default 3; smoke 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1; smoke 0)")
    ap.add_argument("--rounds", type=int, default=1, help="run the layouts this many times, every other round reversed")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="fused", help="every row's optimizer")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default bfloat16 (float32 with --check)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], help="default auto (smoke: cpu)")
    ap.add_argument("--peak-tflops", type=float, help="MFU reference instead of the measured bf16 matmul")
    ap.add_argument("--check", action="store_true", help=f"compare with the plain model's losses (rel. {CHECK_RTOL})")
    ap.add_argument("--json", default="", help="write every row and the settings here (rank 0)")
    ap.add_argument("--profile-dir", default="", help="write a chrome trace per row (rank 0)")
    ap.add_argument("--no-profile", action="store_true", help="no profiled step (no compute/communication split)")
    ap.add_argument("--hang-dump", type=float, default=0, metavar="S", help="print the stacks of a row past S seconds")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny Llama, s 64, 2 steps, --check")
    args = ap.parse_args(argv)
    smoke = args.smoke
    for key, full, tiny in (("seq", "16384,32768,65536,131072", "64"), ("layers", 4, 2), ("steps", 3, 2),
                            ("warmup", 1, 0), ("device", "auto", "cpu")):
        if getattr(args, key) is None:
            setattr(args, key, tiny if smoke else full)
    args.check = args.check or smoke
    args.dtype = args.dtype or ("float32" if args.check else "bfloat16")
    args.seqs = [int(x) for x in str(args.seq).split(",") if x.strip()]
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.smoke and "RANK" not in os.environ:
        return spawn_two(argv)
    for key, val in NVLS_OFF.items():
        os.environ.setdefault(key, val)         # read when NCCL / symmetric memory start: before the group
    env = read_env(one_process_port=0)
    launcher = (f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', env.world)}"
                if "TORCHELASTIC_RUN_ID" in os.environ else "python")       # or spawned by --smoke
    problems, layouts = [], []
    if args.check and args.dtype != "float32":
        problems.append(f"--check compares losses to {CHECK_RTOL} relative: use --dtype float32")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or not args.seqs:
        problems.append("--steps and --rounds must be >= 1, --warmup >= 0, --seq not empty")
    for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
        try:
            lay = parse_layout(name, args.cp_recompute, env.world)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        problems += [w for w in (check_layout(lay, env.world, make_spec(args, s)) for s in args.seqs) if w][:1]
        layouts.append(lay)
    if problems or not layouts:
        if env.lead:        # only rank 0 fails: torchrun ends the others as soon as one fails
            print("context_parallel.py: error:\n  " + "\n  ".join(problems or ["no layouts"]), file=sys.stderr)
            return 2
        return 0
    env = init_from_env(args.device, env=env)
    rc = bench(args, layouts, env, launcher, argv)
    sys.stdout.flush()
    if rc:
        os._exit(rc)        # a failed row may leave sends pending: tearing the group down could abort
    dist.destroy_process_group()
    return rc


def bench(args, layouts, env, launcher, argv):
    dev, lead, world = env.device, env.lead, env.world
    dtype = getattr(torch, args.dtype)

    @functools.lru_cache(maxsize=None)
    def meshes(**sizes):    # one mesh per shape, shared by the rows (cleared after a failed row)
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(dev.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))

    peak = args.peak_tflops
    if peak is None and dev.type == "cuda":
        t = torch.tensor([matmul_tflops(dev)], dtype=torch.float64, device=dev)
        dist.broadcast(t, src=0)
        peak = t.item()
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    info = {"command": f"{launcher} {os.path.relpath(os.path.abspath(__file__))} {' '.join(argv)}",
            "torch": torch.__version__, "device": dev_name, "world_size": world, "backend": dist.get_backend(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "flops": FLOPS_TEXT,
            "env": {k: os.environ.get(k) for k in NVLS_OFF}, "matmul_tflops": peak,
            "optimizer": OPTIMIZERS[args.optimizer],
            "args": dict(vars(args)), "rows": []}
    spec0 = make_spec(args, args.seqs[0])
    if lead:
        print(f"command: {info['command']}\ndate {info['date']}, torch {info['torch']}, device {dev_name}, world "
              f"size {world} ({info['backend']}), " + " ".join(f"{k}={v}" for k, v in info["env"].items()))
        print(f"{spec0.describe().split(' s=')[0]}, global batch 1; {args.dtype} parameters, every row's optimizer "
              f"{info['optimizer']} (lr {args.lr:g}, clip 1.0); {args.warmup} warm-up + {args.steps} timed steps; "
              f"{FLOPS_TEXT}")
        if peak:
            print(f"bf16 8192^3 matmul: {peak:.1f} TFLOP/s per GPU" + (" (--peak-tflops)" if args.peak_tflops else ""))
        print("layouts: " + "; ".join(f"{lay.name}: {lay.label}" for lay in layouts) + "\n", flush=True)
    state, failed = None, False
    for seq in args.seqs:
        spec = make_spec(args, seq)
        batch = spec.make_batch(dev)
        if args.check:
            ref_losses, ref_norm, state = reference_losses(spec, args, dev, dtype, batch,
                                                           steps=min(2, args.warmup + args.steps))
        elif state is None:     # every row from the same weights (they do not depend on s)
            model = spec.plain(dev, dtype)
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        runs = {lay.name: [] for lay in layouts}
        for r in range(args.rounds):
            for lay in (layouts if r % 2 == 0 else layouts[::-1]):
                if lay.kind == "torch" and dev.type != "cuda":
                    row = {"layout": lay.name, "skipped": True, "error": "needs CUDA (context_parallel routes only "
                           "SDPA's CUDA kernels: flash, efficient, cuDNN)"}
                else:
                    row = run_guarded(lay, spec, args, dev, dtype, batch, meshes, state, peak,
                                      profile=r == args.rounds - 1, builders=BUILDERS)
                runs[lay.name].append(row)
                if lead:
                    print_round(row, f"s={seq} {lay.name}", r, args.rounds)
        rows = [dict(merge_rounds(runs[lay.name], spec, world, peak), seq=seq, label=lay.label,
                     flops_per_step=spec.flops()) for lay in layouts]
        if lead:
            print_table(rows, spec)
        if args.check:
            failed |= check_rows([r for r in rows if not r.get("skipped")], ref_losses, ref_norm, lead)
        failed |= any("error" in r and not r.get("skipped") for r in rows)
        info["rows"] += rows
        if lead and args.json:      # after every --seq: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(dict(info, model=spec0.describe().split(" s=")[0], params=spec0.count_params(),
                               matmul_params=spec0.matmul_params(), config=spec0.config.to_dict()), f, indent=1)
    sys.stdout.flush()
    dist.barrier()      # no rank leaves before rank 0 has printed
    return 1 if failed else 0


def print_table(rows, spec):
    print(f"\ns={spec.seq}, B=1: {spec.flops():.4g} FLOP a step, {FLOPS_TEXT}")
    head = (f"{'layout':22} {'step ms':>9} {'model ms':>9} {'optim ms':>8} {'tokens/s':>9} {'TFLOP/s/GPU':>11} "
            f"{'MFU':>6} {'peak GiB':>8} {'loss first':>10} {'compute ms':>12} {'exp.comm ms':>12} {'idle ms':>12}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:22} {'skipped' if r.get('skipped') else 'error'}: {r['error']}")
            continue

        def part(key):
            v, ref = r.get(key), r.get("step_ms_profiled")
            return f"{'-':>12}" if v is None or not ref else f"{v:6.1f} ({100 * v / ref:2.0f}%)"
        mfu = f"{'-':>6}" if r.get("mfu") is None else f"{100 * r['mfu']:5.1f}%"
        mem = f"{'-':>8}" if r["peak_gib"] is None else f"{r['peak_gib']:8.2f}"
        print(f"{r['layout']:22} {r['step_ms']:9.1f} {r['model_ms']:9.1f} {r['optim_ms']:8.1f} "
              f"{r['tokens_per_s']:9.0f} {r['tflops_per_gpu']:11.2f} {mfu} {mem} {r['loss_first']:10.5f} "
              f"{part('compute_ms')} {part('exposed_any_comm_ms')} {part('idle_ms')}")
    ok = [r for r in rows if "error" not in r]
    if len(ok) > 1:
        first = [r["loss_first"] for r in ok]
        spread = (max(first) - min(first)) / abs(first[0])
        print(f"first losses (same weights, same batch): max relative spread {spread:.2e}")
    if any(r.get("work_ms") for r in ok):
        print("(split: one profiled step on rank 0, % of its wall time; exp.comm: an NCCL kernel, collective or P2P, "
              "and no compute kernel)\nwhere the kernel time goes (ms, by kernel name: e2e/profiling.WORK):")
        for r in ok:
            if r.get("work_ms"):
                print(f"  {r['layout']:22} " + ", ".join(f"{k} {v:.1f}" for k, v in r["work_ms"].items()))
    print(flush=True)


# ---- --smoke without torchrun: two processes, as tests/distributed.py starts them ---------------
def _child(rank, argv, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    rc = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc or 0)


def spawn_two(argv):
    import torch.multiprocessing as mp
    try:
        mp.start_processes(_child, args=(argv, free_port()), nprocs=2, join=True, start_method="spawn")
    except mp.ProcessExitedException as exc:
        return exc.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
