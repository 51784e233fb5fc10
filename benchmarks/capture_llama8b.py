"""Capture + tensor-parallel transform of a Llama-3-8B-shaped model on meta tensors.

Prints wall time per phase and the peak resident memory of this process.
Target (issue: tensor parallel): under 30 s and under 2 GiB RSS on a 2-core CPU machine.

    python benchmarks/capture_llama8b.py --tp 8
"""
import argparse
import resource
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    t_start = time.perf_counter()
    from transformers import LlamaConfig, LlamaForCausalLM

    from fxmegatron.lower.rank_passes import assemble_local, check_local_shapes as _check_local_shapes
    from fxmegatron.capture import capture
    from fxmegatron.passes.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel

    t_import = time.perf_counter() - t_start
    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=args.seq, use_cache=False, rope_theta=500000.0)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    t_build = time.perf_counter() - t0

    t0 = time.perf_counter()
    cap = capture(model, {"input_ids": ids, "labels": ids})
    t_capture = time.perf_counter() - t0

    t0 = time.perf_counter()
    plan = plan_tensor_parallel(cap.gm, args.tp, cap.params.keys())
    apply_tensor_parallel(cap.gm, plan, args.rank, "tp")
    t_tp = time.perf_counter() - t0

    t0 = time.perf_counter()
    local = assemble_local(cap.gm, cap, plan, args.rank, args.tp, "meta")
    _check_local_shapes(local)
    t_local = time.perf_counter() - t0
    local_params = sum(p.numel() for p in local.parameters())
    total = time.perf_counter() - t_start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB -> GiB
    counts = {}
    for d in plan.decisions.values():
        counts[d.kind] = counts.get(d.kind, 0) + 1
    print(f"Llama-3-8B shape: {args.layers} layers, h 4096, 32 heads, 8 kv heads, ffn 14336, "
          f"vocab 128256, {n_params / 1e9:.2f} B params; tp={args.tp}, rank {args.rank}, "
          f"batch {args.batch}x{args.seq}")
    print(f"graph nodes: {len(cap.gm.graph.nodes)}; decisions: {counts}; "
          f"local params {local_params / 1e9:.2f} B; planning attempts {plan.attempts}")
    print(f"{'phase':28s} {'seconds':>8s}")
    for name, t in [("import torch+transformers", t_import), ("build model on meta", t_build),
                    ("capture (torch.export)", t_capture), ("tensor-parallel plan+rewrite", t_tp),
                    ("local shards + shape check", t_local)]:
        print(f"{name:28s} {t:8.2f}")
    print(f"{'capture + transform':28s} {t_capture + t_tp + t_local:8.2f}")
    print(f"{'total (process)':28s} {total:8.2f}")
    print(f"peak RSS: {rss:.2f} GiB")


if __name__ == "__main__":
    main()
