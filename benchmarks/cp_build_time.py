"""How long one rank of a context-parallel layout takes to build, per sequence length: capture of
an HF Llama with Llama-3-8B's layer shapes built on the meta device, then the rank's passes and
the build of its module with its weights on --device (materialised, N(0, 0.02)). One process, no
process group: the compiler is handed rank 0's coordinates and group names nothing resolves, so
this is the build alone, not a step.

    python benchmarks/cp_build_time.py --device cuda --seq 16384,65536,131072 --layers 4
    python benchmarks/cp_build_time.py --device cpu --seq 1024 --tiny

The compile time used to grow with s (the causal mask was evaluated as an s × s tensor to prove
it causal); passes/mask_intervals.py proves it by key intervals instead."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from fxmegatron.capture import capture  # noqa: E402
from fxmegatron.compiler import compile_captured  # noqa: E402
from fxmegatron.config import ParallelConfig  # noqa: E402
from fxmegatron.mesh import Axis  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", default="16384,65536,131072")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="h 128, 4 heads, 2 kv heads, ffn 256, V 512 (CPU smoke)")
    args = ap.parse_args()
    for s in (int(x) for x in args.seq.split(",")):
        shape = (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                      vocab_size=512) if args.tiny else
                 dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      vocab_size=128256, rope_theta=500000.0))
        cfg = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=s, use_cache=False, **shape)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)     # its buffer (inv_freq) real, on the CPU
        ids = torch.zeros(1, s, dtype=torch.long, device="meta")
        cap = capture(model, {"input_ids": ids, "labels": ids})
        t1 = time.perf_counter()
        axes = {d: Axis() for d in ("dp", "pp", "tp", "cp")}
        axes["cp"] = Axis(args.cp, 0, "unbound-cp", tuple(range(args.cp)))
        prog = compile_captured(cap, axes, args.device, ParallelConfig())
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"s {s}: capture {t1 - t0:.2f} s, rank passes + build on {args.device} {t2 - t1:.2f} s, "
              f"total {t2 - t0:.2f} s", flush=True)
        del prog, cap, model


if __name__ == "__main__":
    main()
