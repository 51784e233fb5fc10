"""The second MLP linear's input gradient with the tanh GeLU's backward in its epilogue, as a
Triton GEMM, against cuBLAS's GEMM then ``kernels.gelu_backward`` (what ``ops.gemm_epilogue``
runs), bf16, one GPU.

    python benchmarks/triton_dgelu_gemm.py

dact = dy·w2 ([T, h]·[h, f]); dpre = dact·gelu'(pre) and the bias gradient Σ dpre over rows.
Fused, dact never reaches memory: the GEMM's epilogue reads the pre-activation tile, writes
dpre and a [T / BM, f] table of the tile's column sums, where the separate path writes dact
and a kernel reads it back with pre. The kernel is a persistent TMA GEMM (Triton's tutorial
09 form; warp specialisation is Blackwell-only in Triton 3.6). The epilogue rounds the fp32
accumulator to bf16 before the derivative, as the separate path does, so with equal GEMM
results dpre is equal. Each configuration: (BM, BN, BK, GROUP_M, stages, warps, split the
epilogue in two halves); "plain" is the same kernel storing dact. Shapes: gpt1.3b's (T 16384,
h 2048, f 8192) and GPT-2 XL's widths at batch 8 × 1024 (T 8192, h 1600, f 6400).
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fxmegatron.kernels.gelu_backward import gelu_tanh_backward_bias
from fxmegatron.ops.gemm_epilogue import CUBIC, TWO_SQRT_2_OVER_PI

CONFIGS = [(128, 256, 64, 8, 3, 8, True), (128, 256, 64, 16, 3, 8, True), (128, 128, 64, 8, 4, 8, False),
           (128, 128, 64, 8, 4, 4, False), (128, 128, 64, 8, 5, 4, False)]
SHAPES = [("gpt1.3b", 16384, 2048, 8192), ("gpt2-xl widths", 8192, 1600, 6400)]


@triton.jit
def _tile(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (tile_id % group_size_m), (tile_id % num_pid_in_group) // group_size_m


@triton.jit
def _mm_dgelu(a_desc, b_desc, pre_desc, out_desc, part_ptr, M, N, K, C1: tl.constexpr, C3: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
              EPI: tl.constexpr, SPLIT: tl.constexpr):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tile_c = start - NUM_SMS
    group = GROUP_M * num_pid_n
    for tile_id in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile(tile_id, group, num_pid_m, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            acc = tl.dot(a_desc.load([pid_m * BM, ki * BK]), b_desc.load([ki * BK, pid_n * BN]), acc)
        tile_c += NUM_SMS
        pid_m, pid_n = _tile(tile_c, group, num_pid_m, GROUP_M)
        if SPLIT:
            halves = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        else:
            halves = (acc,)
        HN: tl.constexpr = BN // 2 if SPLIT else BN
        for i in tl.static_range(2 if SPLIT else 1):
            on = pid_n * BN + i * HN
            if EPI:
                dy = halves[i].to(tl.bfloat16).to(tl.float32)
                x = pre_desc.load([pid_m * BM, on]).to(tl.float32)
                x2 = x * x
                s = tl.sigmoid(x * (C1 + C3 * x2))
                d = dy * (s + x * s * (1.0 - s) * (C1 + 3.0 * C3 * x2))
                out_desc.store([pid_m * BM, on], d.to(tl.bfloat16))
                tl.store(part_ptr + pid_m * N + on + tl.arange(0, HN), tl.sum(d, axis=0))
            else:
                out_desc.store([pid_m * BM, on], halves[i].to(tl.bfloat16))


def fused(dy, w, pre, cfg, epi=True):
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk, gm, stages, warps, split = cfg
    (m, k), n = dy.shape, w.shape[1]
    out = torch.empty(m, n, dtype=dy.dtype, device=dy.device)
    part = torch.empty(triton.cdiv(m, bm), n, dtype=torch.float32, device=dy.device)
    hn = bn // 2 if split else bn
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    _mm_dgelu[grid](TensorDescriptor.from_tensor(dy, [bm, bk]), TensorDescriptor.from_tensor(w, [bk, bn]),
                    TensorDescriptor.from_tensor(pre, [bm, hn]), TensorDescriptor.from_tensor(out, [bm, hn]), part,
                    m, n, k, C1=TWO_SQRT_2_OVER_PI, C3=CUBIC, BM=bm, BN=bn, BK=bk, GROUP_M=gm, NUM_SMS=sms, EPI=epi,
                    SPLIT=split, num_stages=stages, num_warps=warps)
    return out, part


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for label, m, k, n in SHAPES:
        dy = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02
        pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        dact = torch.mm(dy, w)
        ref_d, ref_b = gelu_tanh_backward_bias(dact, pre, TWO_SQRT_2_OVER_PI, CUBIC)
        t_mm = do_bench(lambda: torch.mm(dy, w), warmup=25, rep=200, return_mode="median")
        t_gb = do_bench(lambda: gelu_tanh_backward_bias(dact, pre, TWO_SQRT_2_OVER_PI, CUBIC), warmup=25, rep=200,
                        return_mode="median")
        tf = 2 * m * n * k / 1e9
        print(f"{label} [{m}, {k}]·[{k}, {n}]: cuBLAS {t_mm:.3f} ms ({tf / t_mm:.0f} TFLOP/s) + gelu_backward "
              f"{t_gb:.3f} = {t_mm + t_gb:.3f} ms")
        for cfg in CONFIGS:
            plain, _ = fused(dy, w, pre, cfg, epi=False)
            d, part = fused(dy, w, pre, cfg)
            t_plain = do_bench(lambda: fused(dy, w, pre, cfg, epi=False), warmup=25, rep=200, return_mode="median")
            t_epi = do_bench(lambda: fused(dy, w, pre, cfg), warmup=25, rep=200, return_mode="median")
            print(f"  {cfg}: plain {t_plain:.3f} ms ({tf / t_plain:.0f} TFLOP/s, dact == cuBLAS's: "
                  f"{torch.equal(plain, dact)}); fused {t_epi:.3f} ms, {t_mm + t_gb - t_epi:+.3f} against separate "
                  f"(dpre == separate's: {torch.equal(d, ref_d)}, db max|diff| "
                  f"{(part.sum(0) - ref_b.float()).abs().max().item():.2g})")


if __name__ == "__main__":
    main()
