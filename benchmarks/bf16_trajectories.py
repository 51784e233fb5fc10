"""bf16 training trajectories of an unmodified HF GPT-2 from the same weights, one GPU: fp32
eager (the reference), bf16 eager, torch.compile, fxmegatron and fxmegatron compiled, and
fxmegatron with one of its rewrites switched off at a time.

    PYTHONPATH=.:examples python benchmarks/bf16_trajectories.py [--steps 24]

What it is for: telling a bf16 rounding difference from an error. Every row trains the same
batch (random tokens, the first 16 labels of each row masked) with ``FusedAdamW`` (lr 1e-4)
from the weights of one seeded ``GPT2LMHeadModel``; a row prints every 4th loss, the last, and
its largest distance from the fp32 row. A rewrite that computed something else would move its
row away from the others (docs/history/PERFORMANCE-2026-11-26.md, the GPT-2 section: all within 0.003).
"""
import argparse
import copy

import torch
import transformers

import fxmegatron
import fxmegatron.compiler as compiler
from fxmegatron.optim import FusedAdamW

# rewrites switched off one at a time: compiler.py's names for them
OFF = [("fx-compile", "apply_gemm_epilogues"), ("fx-compile", "gelu_formula_to_op"),
       ("fx", "attention_rewrites"), ("fx", "loss_reads_logits_dtype")]


def _trajectory(base, batch, dtype, mode, steps, off=None):
    saved = getattr(compiler, off) if off else None
    if off:
        setattr(compiler, off, lambda gm, *a: 0)
    try:
        model = copy.deepcopy(base).to(batch["input_ids"].device, dtype)
        if mode in ("eager", "compile"):
            run = torch.compile(model) if mode == "compile" else model
            params, step = list(model.parameters()), (lambda: run(**batch).loss)
        else:
            pm = fxmegatron.parallelize(model, None, batch, compile=mode == "fx-compile")
            params, step = list(pm.parameters()), (lambda: pm(batch))
        opt = FusedAdamW(params, lr=1e-4)
        losses = []
        for _ in range(steps):
            for p in params:
                p.grad = None
            loss = step()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    finally:
        if off:
            setattr(compiler, off, saved)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = transformers.GPT2Config(n_embd=args.width, n_layer=args.layers, n_head=args.width // 64,
                                  n_positions=args.seq, vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :16] = -100
    batch = {"input_ids": ids.to(dev), "labels": labels.to(dev)}
    rows = {"fp32 eager": _trajectory(base, batch, torch.float32, "eager", args.steps)}
    for mode in ("eager", "compile", "fx", "fx-compile"):
        rows[f"bf16 {mode}"] = _trajectory(base, batch, torch.bfloat16, mode, args.steps)
    for mode, off in OFF:
        rows[f"bf16 {mode}, no {off}"] = _trajectory(base, batch, torch.bfloat16, mode, args.steps, off)
    ref = rows["fp32 eager"]
    for name, losses in rows.items():
        far = max(abs(a - b) for a, b in zip(losses, ref))
        print(f"{name:44s} " + " ".join(f"{x:.4f}" for x in losses[::4])
              + f"  last {losses[-1]:.4f}  max|Δ fp32| {far:.4f}")


if __name__ == "__main__":
    main()
