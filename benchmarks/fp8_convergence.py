"""FP8 against bf16 over 1000 training steps: do the loss curves end within 1.5%?

The bundled GPT (12 layers, h 1024, 16 heads, seq 1024, batch 16: 16,384 tokens a step, 152.5M
parameters) is trained once per precision, from the same initial weights on the same batches,
in one process (``parallelize(model, None, ...)``): ``bf16`` (the model's own dtypes),
``fp8-tensorwise`` and ``fp8-rowwise`` (``precision="fp8"``, that ``fp8_recipe``). On CUDA: bf16
parameters, ``compile=True``, ``FusedAdamW`` (fp32 masters, the clip folded into its step); on
CPU: fp32 parameters, FP8 emulated, ``torch.optim.AdamW``. AdamW betas 0.9/0.95, weight decay
0.1 on matrices, lr 3e-4 after 50 warmup steps, cosine to 3e-5, clip 1.0, dropout 0.

Data: tiny.txt (152 KB) would be read ~100 times over in 1000 steps, and the end losses would
compare memorisation. The text is generated instead: an order-5 byte Markov chain fitted on
tiny.txt, sampled with a fixed seed (numpy PCG64) to 32 MiB in ~1 s, every run, and written to
``--data-cache``; the same order, seed and size give the same bytes anywhere (summary.json has
the sha256). 1% is held out; 1000 steps read 16.4M of the 33.2M training tokens, no window
twice. The chain's entropy rate (``entropy_floor``, 0.3695 nats/byte) is the lowest loss any
model can reach on it.

``--out DIR`` gets ``convergence.csv`` (step, precision, train_loss: the batch's loss as
``train_step`` returns it, bf16 on CUDA; val_loss: mean over ``--val-batches`` held-out batches
in fp32 from ``pm.logits``, after every ``--val-every``-th step and the last, else empty) and
``summary.json``: per precision the mean training loss of the last ``--tail`` steps and the
final validation loss; per FP8 run |fp8 - bf16| / bf16 of both, and whether within 1.5%.

The H200 run (5 minutes for the three; measured 2026-11-24, torch 2.11; at the end fp8 above
bf16 by 0.27% (train) and 0.34% (val) tensorwise, 0.22% and 0.12% rowwise; bf16's val 0.393;
speed at this size is not what this run measures: docs/PERFORMANCE.md has it):

    python benchmarks/fp8_convergence.py --out runs/fp8_convergence

The plot (no GPU; matplotlib):

    .venv/bin/python benchmarks/fp8_convergence.py --plot runs/fp8_convergence/convergence.csv \\
        --png docs/img/fp8_convergence.png

CPU smoke run: ``--tiny`` (2 layers, h 64, seq 64, batch 4, 20 steps, 1 MiB of text).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import gc
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:    # a plain `python benchmarks/...` on a machine without the package installed
    sys.path.insert(0, ROOT)

from fxmegatron.passes.fp8 import FP8Policy  # noqa: E402  (after the path above)

SOURCE = os.path.join(ROOT, "examples", "data", "tiny.txt")
PRECISIONS = {"bf16": {},
              "fp8-tensorwise": {"precision": "fp8", "fp8_recipe": "tensorwise"},
              "fp8-rowwise": {"precision": "fp8", "fp8_recipe": "rowwise"},
              # tensorwise with the LM head in FP8 too (the default keeps it in bf16)
              "fp8-tensorwise-head": {"precision": "fp8", "fp8_recipe": "tensorwise",
                                      "fp8_policy": FP8Policy(lm_head=True, name="all + lm head")}}
FULL = dict(layers=12, hidden=1024, heads=16, seq=1024, batch=16, steps=1000, warmup=50, data_mb=32,
            val_every=50, val_batches=8, log_every=50, tail=50)
TINY = dict(layers=2, hidden=64, heads=4, seq=64, batch=4, steps=20, warmup=5, data_mb=1,
            val_every=5, val_batches=2, log_every=5, tail=5)


# ---------------------------------------------------------------------------------------------
# data: an order-k Markov chain over bytes, fitted on tiny.txt

def _contexts(src: np.ndarray, order: int):
    """The source read cyclically (so every context has a successor and the empirical k-gram
    frequencies are the chain's stationary distribution): each position's context code (its
    k bytes packed into an int64) and the byte that follows."""
    n = len(src)
    cyc = np.concatenate([src, src[:order]]).astype(np.int64)
    code = np.zeros(n, np.int64)
    for j in range(order):
        code = (code << 8) | cyc[j:j + n]
    return code, cyc[order:order + n]


def markov_bytes(src: np.ndarray, order: int, n_bytes: int, seed: int, chains: int = 4096) -> np.ndarray:
    """``n_bytes`` sampled from the order-``order`` chain: ``chains`` walks in lock step, each
    started at a random context of the source, laid end to end."""
    if not 1 <= order <= 6:
        raise ValueError(f"--markov-order {order}: 1 to 6 (a context and its next byte are packed into an int64)")
    code, nxt = _contexts(src, order)
    by_ctx = np.argsort(code, kind="stable")
    uniq, first, count = np.unique(code[by_ctx], return_index=True, return_counts=True)
    # Sampling the next byte = picking one occurrence of the context uniformly; the context
    # after it is that occurrence's successor's, so the walk carries context ids, no lookups.
    emit = nxt[by_ctx].astype(np.uint8)
    then = np.searchsorted(uniq, code[(by_ctx + 1) % len(src)])
    rng = np.random.Generator(np.random.PCG64(seed))
    length = -(-n_bytes // chains)
    ctx = np.searchsorted(uniq, code[rng.integers(0, len(src), chains)])
    out = np.empty((length, chains), np.uint8)
    for t in range(length):
        pick = first[ctx] + rng.integers(0, count[ctx])
        out[t] = emit[pick]
        ctx = then[pick]
    return np.ascontiguousarray(out.T).reshape(-1)[:n_bytes]


def entropy_rate(src: np.ndarray, order: int) -> float:
    """The chain's entropy rate in nats per byte: the lowest mean loss on its samples."""
    code, nxt = _contexts(src, order)
    _, ctx_of, ctx_count = np.unique(code, return_inverse=True, return_counts=True)
    _, pair_of, pair_count = np.unique(code * 256 + nxt, return_inverse=True, return_counts=True)
    return float(-np.mean(np.log(pair_count[pair_of] / ctx_count[ctx_of])))


def corpus(args) -> tuple[str, dict]:
    """The text generated afresh (it takes about a second: no stale cache to trust), written to
    ``--data-cache`` for the trainer's byte tokenizer to memory-map; and its recipe."""
    size = args.data_mb << 20
    path = args.data_cache or f"/tmp/fxmegatron_markov_o{args.markov_order}_s{args.data_seed}_{args.data_mb}MiB.txt"
    src = np.fromfile(SOURCE, np.uint8)
    t = time.perf_counter()
    data = markov_bytes(src, args.markov_order, size, args.data_seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"     # a concurrent run never reads half a file
    data.tofile(tmp)
    os.replace(tmp, path)
    print(f"data: {size / 2**20:.0f} MiB from an order-{args.markov_order} Markov chain in "
          f"{time.perf_counter() - t:.1f} s -> {path}", flush=True)
    return path, {"source": "examples/data/tiny.txt", "source_sha256": hashlib.sha256(src.tobytes()).hexdigest(),
                  "markov_order": args.markov_order, "seed": args.data_seed, "bytes": size,
                  "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
                  "entropy_floor": entropy_rate(src, args.markov_order)}


# ---------------------------------------------------------------------------------------------
# training

def datasets(args, path: str):
    """The training batches (``Batches``: step k's is the same for every run) and the fixed
    validation batches, from the held-out end of the text: the bundled trainer's own sampler."""
    from fxmegatron.train.data import Batches, eval_windows
    from fxmegatron.train.documents import text_tokens
    from fxmegatron.train.tokens import TokenStream, split_stream
    stream = text_tokens([path], "bytes")
    if args.token_bytes == 2:   # each pair of bytes one token: a 65,536-token vocabulary, Zipf-like frequencies
        stream = TokenStream(np.memmap(path, dtype=">u2", mode="r"), name=f"{path} (byte pairs)")
    train_tokens, valid_tokens = split_stream(stream, args.valid_fraction)
    return (Batches(train_tokens, args.seq, args.batch, args.seed),
            eval_windows(valid_tokens, args.seq, args.batch, args.val_batches))


def model_config(args):
    from fxmegatron.models.gpt import GPTConfig
    return GPTConfig(vocab_size=256 ** args.token_bytes, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.hidden, dropout=0.0)


def initial_state(args) -> dict:
    """The weights every precision starts from: fp32, on the CPU, from ``--seed``."""
    from fxmegatron.models.gpt import GPT
    torch.manual_seed(args.seed)
    return {k: v.detach().clone() for k, v in GPT(model_config(args)).state_dict().items()}


def to_batch(windows: torch.Tensor, dev) -> tuple:
    windows = windows.to(dev, non_blocking=True)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def val_loss(pm, val_set, dev) -> float:
    # From the logits in fp32: the model's own loss is bf16 on CUDA (steps of ~0.4%), too
    # coarse for a 1.5% comparison.
    total = 0.0
    for w in val_set:
        x, y = to_batch(w, dev)
        logits = pm.logits((x, y))
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()
    return total / len(val_set)


def train(name: str, args, dev, init: dict, batches, val_set) -> dict:
    """One precision's run: its losses per step, validation losses by step and timings."""
    import fxmegatron
    from fxmegatron.models.gpt import GPT
    from fxmegatron.train.lr import lr_at
    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    with torch.device(dev):
        model = GPT(model_config(args)).to(torch.bfloat16 if cuda else torch.float32)
    # state_dict= overrides the model's own values (cast to its dtypes): the same start for every run
    pm = fxmegatron.parallelize(model, None, to_batch(batches.windows(0), dev), state_dict=init, compile=cuda,
                                **PRECISIONS[name])
    del model
    named = list(pm.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]   # biases, norms
    if cuda:
        from fxmegatron.optim import FusedAdamW, clip_coefficient
        opt = FusedAdamW(groups, lr=args.lr, betas=(0.9, 0.95))

        def update():
            opt.step(clip_coefficient(pm.grad_norm(), args.clip))    # the clip inside the step: no host sync
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

        def update():
            pm.clip_grad_norm_(args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = args.batch * args.seq
    losses, val = [], {}
    mark = mark_step = first_s = None
    val_s = timed_s = 0.0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.lr * args.min_lr_ratio, args.warmup, "cosine")
        for g in opt.param_groups:
            g["lr"] = lr
        losses.append(pm.train_step(to_batch(batches.windows(step), dev)))   # kept on the device: no sync
        update()
        last = step == args.steps - 1
        if (step + 1) % args.val_every == 0 or last:
            sync()
            tv = time.perf_counter()
            val[step] = val_loss(pm, val_set, dev)
            val_s += time.perf_counter() - tv
        if step == 0 or (step + 1) % args.log_every == 0 or last:
            sync()
            now = time.perf_counter()
            if step == 0:     # capture, the passes and compilation: timed apart
                first_s, rate = now - t0, f"parallelize + first step {now - t0:.1f} s"
            else:
                ms = (now - mark - val_s) * 1e3 / (step - mark_step)
                timed_s += now - mark - val_s
                rate = f"{ms:.1f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s"
            mark, mark_step, val_s = now, step, 0.0
            shown = f", val {val[step]:.4f}" if step in val else ""
            print(f"{name:>15} step {step:5d}: loss {losses[-1].item():.4f}{shown}, lr {lr:.2e}, {rate}",
                  flush=True)
    return {"train": torch.stack(losses).float().tolist(), "val": val, "first_step_s": first_s,
            "ms_per_step": timed_s * 1e3 / (args.steps - 1) if args.steps > 1 else None}


# ---------------------------------------------------------------------------------------------
# results

def write_csv(path: str, runs: dict) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "precision", "train_loss", "val_loss"])
        for name, r in runs.items():
            for step, loss in enumerate(r["train"]):
                v = r["val"].get(step)
                w.writerow([step, name, f"{loss:.6f}", "" if v is None else f"{v:.6f}"])


def read_csv(path: str) -> dict:
    """{precision: {"train": [loss per step], "val": {step: loss}}}, in the file's order."""
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            r = runs.setdefault(row["precision"], {"train": [], "val": {}})
            step = int(row["step"])
            if step != len(r["train"]):
                raise ValueError(f"{path}: {row['precision']} step {step} out of order")
            r["train"].append(float(row["train_loss"]))
            if row["val_loss"]:
                r["val"][step] = float(row["val_loss"])
    return runs


def compare(runs: dict, tail: int, tolerance: float) -> tuple[dict, dict]:
    """Per run: the mean training loss over its last ``tail`` steps and the last validation
    loss (every run measures one after its last step); per FP8 run: |fp8 - bf16| / bf16 of
    each, and whether both are within ``tolerance``."""
    ends = {name: {"train_loss_last": float(np.mean(r["train"][-tail:])), "val_loss_final": r["val"][max(r["val"])]}
            for name, r in runs.items()}
    diffs = {}
    for name, e in ends.items():
        if name != "bf16" and "bf16" in ends:
            d = {f"{k.split('_')[0]}_rel_diff": abs(e[k] - ends["bf16"][k]) / ends["bf16"][k]
                 for k in ("train_loss_last", "val_loss_final")}
            diffs[name] = {**d, "within_tolerance": max(d.values()) <= tolerance}
    return ends, diffs


def plot(csv_path: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = read_csv(csv_path)
    try:     # the run's own summary, for the model's size and the comparison window
        with open(os.path.join(os.path.dirname(os.path.abspath(csv_path)), "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {}
    cfg = summary.get("config", {})
    tail = cfg.get("tail", 50)
    _, diffs = compare(runs, tail, cfg.get("tolerance", 0.015))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"bf16": "black", "fp8-tensorwise": "tab:blue", "fp8-rowwise": "tab:orange"}
    widths = {"bf16": 2.4}     # the reference drawn wider, under the FP8 curves it should hide
    n_steps = max(len(r["train"]) for r in runs.values())
    zoom_from = int(n_steps * 0.6)
    for name, r in runs.items():
        c = colors.get(name)
        y = np.asarray(r["train"])
        idx = np.arange(len(y))     # centred mean over 20 steps (fewer at the ends): no lag
        lo_i, hi_i = np.maximum(idx - 10, 0), np.minimum(idx + 10, len(y))
        cs = np.concatenate([[0.0], np.cumsum(y)])
        smooth = (cs[hi_i] - cs[lo_i]) / (hi_i - lo_i)
        vs, vl = sorted(r["val"]), [r["val"][s] for s in sorted(r["val"])]
        for ax, lo in ((axes[0], 0), (axes[1], zoom_from)):
            steps = np.arange(lo, len(y))
            ax.plot(steps, y[lo:], color=c, alpha=0.15, lw=0.7)
            ax.plot(steps, smooth[lo:], color=c, lw=widths.get(name, 1.2), label=f"{name} train (mean of 20)")
            pts = [(s, v) for s, v in zip(vs, vl) if s >= lo]
            if pts:
                ax.plot(*zip(*pts), "o--", color=c, ms=4, lw=0.8, label=f"{name} validation")
    axes[0].set_title("whole run")
    axes[1].set_title(f"steps {zoom_from}-{n_steps - 1}")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per byte)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    floor = summary.get("data", {}).get("entropy_floor")
    if floor:    # the whole-run panel only: in the zoom it would squash the curves
        axes[0].axhline(floor, color="gray", ls=":", lw=1)
        axes[0].text(0, floor * 1.04, f"lowest possible loss (the data's entropy) {floor:.3f}", fontsize=8,
                     color="gray")
    head = "GPT"
    if cfg:
        head = (f"GPT {cfg['layers']}L h{cfg['hidden']} ({summary['params'] / 1e6:.3g}M params), "
                f"{cfg['batch']}x{cfg['seq']} = {cfg['batch'] * cfg['seq']:,} tokens/step, {n_steps} steps, "
                f"{summary.get('device', '')}")
    ends = "; ".join(f"{n}: train {d['train_rel_diff']:.2%}, val {d['val_rel_diff']:.2%}" for n, d in diffs.items())
    fig.suptitle(f"{head}\n|fp8 - bf16| / bf16 at the end (train: mean of the last {tail} steps): {ends}",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)
    print(f"wrote {png}")


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--tiny", action="store_true")
    sizes = TINY if pre.parse_known_args(argv)[0].tiny else FULL
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke sizes: {TINY}")
    for k, v in sizes.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--precisions", default="bf16,fp8-tensorwise,fp8-rowwise",
                   help=f"comma-separated, from {', '.join(PRECISIONS)}; bf16 is the reference")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at lr times this")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument("--markov-order", type=int, default=5)
    p.add_argument("--token-bytes", type=int, choices=(1, 2), default=1,
                   help="bytes per token: 1, a vocabulary of 256; 2, each byte pair one token (65,536): "
                        "the LM head at the size of a real tokenizer's")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data-cache", default=None, help="where the generated text is written (default: under /tmp)")
    p.add_argument("--valid-fraction", type=float, default=0.01)
    p.add_argument("--tolerance", type=float, default=0.015)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", default="runs/fp8_convergence", help="folder for convergence.csv and summary.json")
    p.add_argument("--plot", metavar="CSV", help="only draw CSV (with --png); no training, no GPU")
    p.add_argument("--png", help="the figure --plot writes")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.precisions.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        p.error(f"--precisions: unknown {unknown}; choose from {', '.join(PRECISIONS)}")
    args.precisions = names
    if args.plot and not args.png:
        p.error("--plot needs --png")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return 0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    path, data = corpus(args)
    batches, val_set = datasets(args, path)
    init = initial_state(args)
    n_params = sum(v.numel() for k, v in init.items() if k != "lm_head.weight")   # tied to wte
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"GPT {args.layers}L h{args.hidden} {args.heads} heads, {n_params / 1e6:.1f}M params; "
          f"{args.batch}x{args.seq} tokens/step, {args.steps} steps ({args.steps * args.batch * args.seq / 1e6:.1f}M "
          f"of {len(batches.stream) / 1e6:.1f}M training tokens); {device_name}; entropy floor "
          f"{data['entropy_floor']:.4f} nats/byte (x{args.token_bytes} a token)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for name in args.precisions:
        runs[name] = train(name, args, dev, init, batches, val_set)
        gc.collect()     # the run's model and optimizer state, before the next one's
        if dev.type == "cuda":
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        write_csv(os.path.join(args.out, "convergence.csv"), runs)     # after each run: a crash keeps the rest
    ends, diffs = compare(runs, args.tail, args.tolerance)
    for name, e in ends.items():
        e.update(first_step_s=runs[name]["first_step_s"], ms_per_step=runs[name]["ms_per_step"])
    config = {k: v for k, v in vars(args).items() if k not in ("plot", "png")}
    summary = {"config": config, "params": n_params, "tokens_per_step": args.batch * args.seq,
               "device": device_name, "torch": torch.__version__, "data": {**data, "path": path},
               "runs": ends, "vs_bf16": diffs}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"\nat the end (train: mean of the last {args.tail} steps; val: after the last step):")
    for name, e in ends.items():
        d = diffs.get(name)
        rel = (f"  |diff|/bf16: train {d['train_rel_diff']:.2%}, val {d['val_rel_diff']:.2%}, "
               f"{'within' if d['within_tolerance'] else 'OUTSIDE'} {args.tolerance:.1%}") if d else ""
        print(f"  {name:>15}: train {e['train_loss_last']:.4f}, val {e['val_loss_final']:.4f}{rel}")
    print(f"wrote {os.path.join(args.out, 'convergence.csv')} and summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
