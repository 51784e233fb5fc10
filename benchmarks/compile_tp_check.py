"""Which part of ``parallelize(compile=True)`` with tensor parallelism changes the gradients?

A diagnostic, not a benchmark: one fp32 forward + backward of a small GPT, per variant, and
each parameter's gradient against the unmodified model's (gathered whole on every rank).
It found why compile with sequence parallelism once failed the fp32 check on NCCL: wpe's
gradient was zero (a collective's Function returned a view of its input). Variants
(``--variants``):

    sp-inductor     sequence parallel, torch.compile (inductor)
    nosp-inductor   no sequence parallelism
    sp-aot_eager    AOTAutograd without inductor: tracing/partitioning vs code generation
    sp-eager        dynamo only
    sp-off          not compiled (the control)

    torchrun --standalone --nproc-per-node 2 benchmarks/compile_tp_check.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/compile_tp_check.py --device cpu
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpt import GPT, GPTConfig  # noqa: E402

import fxmegatron  # noqa: E402
import fxmegatron.api as api  # noqa: E402
import fxmegatron.lower.torch_compile as inductor  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, make_mesh  # noqa: E402


def _compile_with(backend):
    def compile_graph(gm, mode=None):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is inductor.rng_key:
                n.target = inductor._outside_graph_rng_key()
        gm.recompile()
        gm.forward = torch.compile(gm.forward, dynamic=False, backend=backend)
        return gm
    return compile_graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--variants", default="sp-off,sp-inductor,nosp-inductor,sp-aot_eager,sp-eager")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--show", type=int, default=6, help="worst parameters printed per variant")
    args = ap.parse_args()

    env = init_from_env(args.device)
    rank, world, dev = env.rank, env.world, env.device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    mesh = make_mesh(env, tp=world)

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.hidden)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g)
    ids, labels = seq[:, :-1].contiguous().to(dev), seq[:, 1:].contiguous().to(dev)
    torch.manual_seed(0)
    ref = GPT(cfg).to(dev)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    loss_ref = ref(ids, labels)
    loss_ref.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    for variant in args.variants.split(","):
        sp_name, backend = variant.split("-", 1)
        api.compile_graph = _compile_with(backend)
        torch._dynamo.reset()
        with torch.device("meta"):
            model = GPT(cfg)
        pm = fxmegatron.parallelize(model, mesh, (ids, labels), sequence_parallel=sp_name == "sp",
                                    compile=backend != "off", state_dict=state)
        loss = pm(ids, labels)
        loss.backward()
        grads = pm.full_grads()
        errs = []
        for n, r in ref_grads.items():
            # a gradient that is zero in exact arithmetic (a key bias) is judged absolutely
            e = ((grads[n].float() - r).norm() / r.norm().clamp_min(1e-4)).item()
            errs.append((e, n))
        errs.sort(reverse=True)
        if rank == 0:
            print(f"{variant:16s} loss {loss.item():.7f} (ref {loss_ref.item():.7f})  worst grads: "
                  + ", ".join(f"{n} {e:.1e}" for e, n in errs[:args.show]), flush=True)
            e, n = errs[0]
            if e > 1e-3:    # how it is wrong: zero, scaled, or elsewhere
                got, want = grads[n].float().flatten(), ref_grads[n].flatten()
                cos = (got @ want / (got.norm() * want.norm()).clamp_min(1e-30)).item()
                print(f"{'':16s} {n}: |got| {got.norm().item():.4e} |want| {want.norm().item():.4e} cos {cos:.4f}",
                      flush=True)
        del pm, model, grads, loss
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
