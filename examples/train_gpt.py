"""Train the bundled GPT on the bytes of a text file, parallelized by fxmegatron.

    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --pp 2 --tp 2
    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --tp 4 --sequence-parallel
    torchrun --standalone --nproc_per_node 4 examples/train_gpt.py --pp 2 --tp 2 \
        --virtual-stages 2 --microbatches 4 --recompute selective
    python examples/train_gpt.py            # one process, no parallelism

Byte-level language model (vocabulary 256) on ``--data`` (default: examples/data/tiny.txt).
The last 10% of the file is held out for validation. Every rank draws the same global
batch of random windows (a generator seeded by --seed and the step) and hands all of it
to ``train_step``: fxmegatron splits it over dp and into microbatches itself.
gloo on CPU, nccl when there is a GPU for each process on the host (--device auto).

Rank 0 shows progress and writes OUT/loss.csv (step, loss, tokens_per_s, elapsed_s,
val_loss) and OUT/loss.png. The exit code is 0 when the loss fell (mean of the last 10%
of the steps at least 5% under the mean of the first 10%), else 1.
"""
import argparse
import csv
import math
import os
import sys
import time

T_START = time.perf_counter()   # before importing torch: the wall time in the summary includes it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpt import GPT, GPTConfig  # noqa: E402

import fxmegatron  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, make_mesh, read_env  # noqa: E402

DEFAULT_DATA = os.path.join(HERE, "data", "tiny.txt")
MIN_DROP = 0.05     # the run passes when the loss fell by at least 5% (last 10% of steps vs first 10%)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA, help="text file, read as bytes")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g = ap.add_argument_group("layout (dp * pp * tp must equal the number of processes)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default: world / (dp * pp))")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    g.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    g.add_argument("--microbatches", type=int, default=1, help="microbatches per step (per dp replica)")
    g.add_argument("--schedule", default=None, choices=["gpipe", "1f1b", "interleaved"],
                   help="pipeline schedule (default: 1f1b, or interleaved with --virtual-stages > 1)")
    g = ap.add_argument_group("model and training")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--seq", type=int, default=64, help="sequence length (tokens = bytes)")
    g.add_argument("--batch", type=int, default=16, help="global batch size (sequences per step)")
    g.add_argument("--tie-embeddings", action="store_true",
                   help="share the token embedding with the LM head (untied by default: at this size and "
                        "step count the tied model sits on the unigram plateau, loss ~3.0, for longer)")
    # 200 steps: about a minute for 4 processes on a 2-core CPU (README); lr 1e-3 reached the lowest
    # loss most reliably over seeds in 200 steps (3e-3 and 2e-3 sometimes stay on the plateau longer).
    g.add_argument("--steps", type=int, default=200)
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear warmup, cosine decay)")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("output")
    g.add_argument("--out", default=os.path.join("runs", "train_gpt"))
    g.add_argument("--eval-every", type=int, default=50, help="validation every N steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=2, help="batches per validation")
    g.add_argument("--log-every", type=int, default=0,
                   help="when stdout is not a terminal: a line every N steps (default: steps / 10)")
    return ap.parse_args(argv)


# ---- layout -------------------------------------------------------------------------------
def check_layout(args, world):
    """Fill in tp and check the layout against the world size; returns an error message or None."""
    for name in ("dp", "pp", "virtual_stages", "microbatches", "batch", "steps", "seq"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.tp is None:
        if world % (args.dp * args.pp):
            return (f"--dp {args.dp} x --pp {args.pp} = {args.dp * args.pp} does not divide the {world} "
                    f"processes; pick dp and pp whose product divides the world size, or set --tp")
        args.tp = world // (args.dp * args.pp)
    if args.dp * args.pp * args.tp != world:
        return (f"--dp {args.dp} x --pp {args.pp} x --tp {args.tp} = {args.dp * args.pp * args.tp}, "
                f"but {world} processes were started (torchrun --nproc_per_node): they must be equal")
    if args.batch % (args.dp * args.microbatches):
        return (f"--batch {args.batch} must be divisible by --dp {args.dp} x --microbatches "
                f"{args.microbatches} = {args.dp * args.microbatches}")
    return None


def plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def layout_str(args):
    s = f"dp={args.dp} pp={args.pp} tp={args.tp}"
    if args.pp > 1 or args.virtual_stages > 1:
        sched = args.schedule or ("interleaved" if args.virtual_stages > 1 else "1f1b")
        s += f" ({sched}, v={args.virtual_stages})"
    s += f", m={args.microbatches}"
    if args.sequence_parallel:
        s += ", SP"
    if args.recompute != "none":
        s += f", recompute={args.recompute}"
    return s


# ---- data ---------------------------------------------------------------------------------
class ByteData:
    """The file's bytes; the last 10% for validation. ``batch(split, key)`` draws random
    windows of seq+1 bytes from a generator seeded by (seed, split, key): every rank that
    asks for the same key gets the same batch."""

    def __init__(self, path, seq, batch, seed, device):
        with open(path, "rb") as f:
            raw = f.read()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = len(data) // 10
        self.splits = {"train": data[:len(data) - n_val], "val": data[len(data) - n_val:]}
        for name, d in self.splits.items():
            if len(d) < seq + 2:
                raise SystemExit(f"{path}: {len(raw)} bytes leave {len(d)} for {name}, fewer than "
                                 f"--seq {seq} + 2; use a longer file or a shorter --seq")
        self.n_bytes = len(raw)
        self.seq, self.batch, self.seed, self.device = seq, batch, seed, device

    def batch_at(self, split, key):
        d = self.splits[split]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key * 2 + (split == "val"))
        starts = torch.randint(0, len(d) - self.seq - 1, (self.batch,), generator=g)
        win = torch.stack([d[s:s + self.seq + 1] for s in starts.tolist()]).long()
        return win[:, :-1].to(self.device), win[:, 1:].to(self.device)


def lr_at(step, args, warmup):
    """Linear warmup to --lr over ``warmup`` steps, then cosine decay to lr/10 at the last step."""
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


# ---- output -------------------------------------------------------------------------------
class Progress:
    """Rank 0's progress: one line redrawn in place on a terminal, else a line every N steps."""

    def __init__(self, steps, log_every):
        self.steps = steps
        self.tty = sys.stdout.isatty()
        self.every = log_every or max(1, steps // 10)
        self.width = 0

    def _line(self, step, loss, tps, elapsed, lr):
        frac = (step + 1) / self.steps
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        return (f"[{bar}] step {step + 1:>{len(str(self.steps))}}/{self.steps}  loss {loss:.4f}  "
                f"lr {lr:.2e}  {tps:,.0f} tokens/s  {elapsed:6.1f} s")

    def update(self, step, loss, tps, elapsed, lr):
        line = self._line(step, loss, tps, elapsed, lr)
        if self.tty:
            print("\r" + line.ljust(self.width), end="", flush=True)
            self.width = len(line)
        elif (step + 1) % self.every == 0 or step == 0 or step + 1 == self.steps:
            print(line, flush=True)

    def message(self, text):
        if self.tty and self.width:
            print("\r" + text.ljust(self.width), flush=True)   # over the bar; the next update redraws it
        else:
            print(text, flush=True)

    def close(self):
        if self.tty and self.width:
            print(flush=True)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "tokens_per_s", "elapsed_s", "val_loss"])
        for r in rows:
            w.writerow([r["step"], f"{r['loss']:.6f}", f"{r['tokens_per_s']:.1f}", f"{r['elapsed_s']:.3f}",
                        "" if r.get("val_loss") is None else f"{r['val_loss']:.6f}"])


def write_plot(path, rows, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2, label="train loss")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, lw=1, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    env = read_env(one_process_port=29517)     # plain `python train_gpt.py`: one process
    rank, world = env.rank, env.world
    err = check_layout(args, world)
    if err:
        # Only rank 0 fails: torchrun ends the others as soon as one rank fails, which could
        # cut rank 0 off before it printed the message.
        if rank == 0:
            print(f"train_gpt.py: error: {err}", file=sys.stderr, flush=True)
            return 2
        return 0

    env = init_from_env(args.device, env=env)
    try:
        return train(args, env, T_START)
    finally:
        dist.destroy_process_group()


def train(args, env, t_start):
    lead, world, device = env.lead, env.world, env.device
    mesh = make_mesh(env, dp=args.dp, pp=args.pp, tp=args.tp)
    data = ByteData(args.data, args.seq, args.batch, args.seed, device)

    torch.manual_seed(args.seed)    # the same initial weights on every rank
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.hidden, dropout=0.0, tie_embeddings=args.tie_embeddings)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())     # tied weights counted once
    t0 = time.perf_counter()
    # The example batch is a global batch, like every batch given to train_step.
    pm = fxmegatron.parallelize(model, mesh, data.batch_at("train", 0),
                                sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                                microbatches=args.microbatches, virtual_stages=args.virtual_stages,
                                schedule=args.schedule, seed=args.seed)
    t_parallelize = time.perf_counter() - t0
    del model
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = args.warmup if args.warmup is not None else max(1, round(0.05 * args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args, warmup) / args.lr)

    layout = layout_str(args)
    if lead:
        n_local = sum(p.numel() for p in pm.parameters())
        print(f"train_gpt: {plural(world, 'process')} ({dist.get_backend()}, {device.type}), {layout}", flush=True)
        print(f"  GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
              f"{'tied' if args.tie_embeddings else 'untied'} embeddings, "
              f"{n_params:,} parameters ({n_local:,} on rank 0); global batch {args.batch} x {args.seq} "
              f"tokens; {args.steps} steps, lr {args.lr:g} (warmup {warmup}, cosine)", flush=True)
        print(f"  data: {args.data} ({data.n_bytes:,} bytes, {len(data.splits['val']):,} held out); "
              f"parallelize {t_parallelize:.1f} s", flush=True)

    def validate():
        # The parallel model only offers train_step (forward AND backward, by the pipeline
        # schedule when there is one), so validation runs train_step on held-out batches and
        # then throws the gradients away with zero_grad() -- the optimizer never steps on them.
        # It costs one training step's compute per batch; --eval-every 0 turns it off.
        losses = []
        for k in range(args.eval_batches):
            losses.append(pm.train_step(data.batch_at("val", k)).item())   # the same batches each time
            opt.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    progress = Progress(args.steps, args.log_every) if lead else None
    rows = []
    tokens_per_step = args.batch * args.seq
    t_train = time.perf_counter()
    recent = []     # step times of the last 10 steps, for the progress line
    for step in range(args.steps):
        t0 = time.perf_counter()
        lr = opt.param_groups[0]["lr"]
        loss = pm.train_step(data.batch_at("train", step + 1))   # key 0 was the example batch
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss = loss.item()          # also waits for the device
        dt = time.perf_counter() - t0
        recent = (recent + [dt])[-10:]
        row = {"step": step, "loss": loss, "tokens_per_s": tokens_per_step / dt,
               "elapsed_s": time.perf_counter() - t_train, "val_loss": None}
        if not math.isfinite(loss):
            if lead:
                progress.message(f"step {step}: the loss is {loss}; stopping")
            rows.append(row)
            break
        if args.eval_every > 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            row["val_loss"] = validate()
            if lead:
                progress.message(f"step {step + 1}: train loss {loss:.4f}, validation loss {row['val_loss']:.4f}")
            row["elapsed_s"] = time.perf_counter() - t_train
        rows.append(row)
        if lead:
            progress.update(step, loss, tokens_per_step * len(recent) / sum(recent), row["elapsed_s"], lr)
    train_s = time.perf_counter() - t_train
    if lead:
        progress.close()

    k = max(1, len(rows) // 10)
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    fell = len(rows) == args.steps and math.isfinite(last) and last < (1.0 - MIN_DROP) * first
    if lead:
        os.makedirs(args.out, exist_ok=True)
        csv_path, png_path = os.path.join(args.out, "loss.csv"), os.path.join(args.out, "loss.png")
        write_csv(csv_path, rows)
        write_plot(png_path, rows, f"bundled GPT ({args.layers}x{args.hidden}, {n_params / 1e6:.2f}M params) "
                                   f"on {os.path.basename(args.data)}\n{plural(world, 'process')}: {layout}")
        step_times = [tokens_per_step / r["tokens_per_s"] for r in rows]
        tps = tokens_per_step * len(rows) / sum(step_times)
        vals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
        print(f"layout      {plural(world, 'process')}, {layout}")
        print(f"loss        {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} (mean of first {k} steps {first:.4f}, "
              f"last {k} steps {last:.4f})" + (f"; validation {vals[-1]:.4f}" if vals else ""))
        print(f"throughput  {tps:,.0f} tokens/s (training steps only)")
        print(f"wall time   {time.perf_counter() - t_start:.1f} s (start-up and parallelize {t_train - t_start:.1f} s, "
              f"training {train_s:.1f} s)")
        print(f"files       {csv_path}, {png_path}")
        if not fell:
            print(f"FAILED: the loss did not fall by {MIN_DROP:.0%} (first {first:.4f}, last {last:.4f})",
                  file=sys.stderr, flush=True)
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
