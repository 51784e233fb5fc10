"""fp32 gradient accumulation over microbatches (``parallelize(grad_accum_dtype=torch.float32)``,
``fxmegatron.runtime.grad_accumulation``): the hook's arithmetic on a crafted case where bf16 loses
the small terms, and a bf16 model's gradients against float64 at one process, dp2 and pp2."""
import pytest
import torch

from fxmegatron.errors import FxMegatronError
from fxmegatron.runtime.grad_accumulation import Fp32GradAccumulator, check_grad_accum_dtype
from tests.distributed import run_distributed
from tests.workers import grad_accum_errors


def _accumulate(grads, accumulator: bool):
    """``.grad`` of a bf16 parameter after one backward per gradient in ``grads``."""
    p = torch.nn.Parameter(torch.zeros(len(grads[0]), dtype=torch.bfloat16))
    acc = Fp32GradAccumulator([p], {}) if accumulator else None
    if acc:
        acc.start(len(grads))
    for g in grads:
        (p * torch.tensor(g, dtype=torch.bfloat16)).sum().backward()
    if acc:
        acc.finish()
        acc.remove()
    return p.grad


@pytest.fixture(params=["foreach", "kernel"])
def path(request, monkeypatch):
    """The callback's two ways to add: torch's foreach ops, and the Triton kernel (interpreter)."""
    if request.param == "kernel":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(torch, "_foreach_add_", lambda *a: pytest.fail("took the foreach path"))
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def test_small_terms_survive_in_fp32(path):
    # 1 + 16 * 2^-9: each 2^-9 is below half an ulp of 1 in bf16 (2^-8), so autograd's bf16
    # sum stays 1; the fp32 sum is 1.03125, which bf16 holds exactly
    grads = [[1.0, 3.0]] + [[2.0 ** -9, 2.0 ** -8]] * 16
    assert _accumulate(grads, False).tolist() == [1.0, 3.0]
    assert _accumulate(grads, True).tolist() == [1.03125, 3.0625]


def test_many_parameters_and_chunks_match_an_fp32_sum(path):
    """Parameters of both half dtypes, sizes across the kernel's chunks and blocks, one of them
    used twice per microbatch: each ``.grad`` is the fp32 sum of its gradients, rounded once."""
    g = torch.Generator().manual_seed(0)
    shapes, dtypes = [(300,), (7, 5), (1,), (129, 3)], [torch.bfloat16, torch.float16, torch.bfloat16, torch.bfloat16]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dt)) for s, dt in zip(shapes, dtypes)]
    acc = Fp32GradAccumulator(params, {id(params[3]): 2})
    m = 5
    acc.start(m)
    total = [torch.zeros(s) for s in shapes]
    for _ in range(m):
        gs = [torch.randn(s, generator=g).to(dt) for s, dt in zip(shapes, dtypes)]
        sum(((p * x).float().sum() for p, x in zip(params, gs)), torch.zeros(())).backward()
        extra = torch.randn(shapes[3], generator=g).to(torch.bfloat16)
        (params[3] * extra).float().sum().backward()      # a second use: a second backward
        for t, x in zip(total, gs):
            t += x.float()
        total[3] += extra.float()
    acc.finish()
    acc.remove()
    for p, t in zip(params, total):
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, t.to(p.dtype))


def test_a_parameter_missed_by_a_microbatch_still_gets_its_sum():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    acc = Fp32GradAccumulator([p], {id(p): 2})      # expects 2 accumulations per microbatch
    acc.start(2)
    for _ in range(3):                               # only 3 of the 4 happen
        (p * torch.tensor([1.0, 2.0], dtype=torch.bfloat16)).sum().backward()
    assert p.grad is None                            # held in fp32 until the step ends
    acc.finish()
    assert p.grad.dtype == torch.bfloat16 and p.grad.tolist() == [3.0, 6.0]


def test_bad_dtype_is_refused():
    with pytest.raises(FxMegatronError, match=r"grad_accum_dtype=torch.bfloat16.*None .*or torch.float32"):
        check_grad_accum_dtype(torch.bfloat16)


@pytest.mark.parametrize("world,layout,m,shard", [(1, (1, 1, 1), 16, "none"), (2, (2, 1, 1), 8, "none"),
                                                  (2, (1, 2, 1), 8, "none"), (2, (2, 1, 1), 8, "gradients")])
def test_bf16_gradients_against_float64(world, layout, m, shard):
    """With fp32 accumulation the error against float64 is bf16's per-microbatch compute error
    alone (about 0.83% here, whatever m), below autograd's bf16 sum (0.89-0.95% measured); the
    data-parallel average (dp2) and the pipeline (pp2) see the fp32 sums (were the rounded sum
    not in ``.grad`` when a bucket is reduced, its gradients would be zeros: error 1). Under
    ``dp_shard="gradients"`` the reduced pieces of every microbatch are summed in fp32."""
    res = run_distributed(grad_accum_errors, world, layout, m, 4, 16, shard)[0]
    bf16, fp32 = res["None"], res["torch.float32"]
    assert not bf16["missing"] and not fp32["missing"]
    assert fp32["err"] < 1.5e-2, res
    # 3% of slack over the measured gap's smallest margin (7%) for other CPUs' bf16 kernels
    assert fp32["err"] < 0.97 * bf16["err"], res
