"""fxmegatron.optim.FusedAdamW against torch.optim.AdamW(foreach=False) on fp32 master copies
(grads = param.grad.float() * scale, masters copied back into the parameters after each step):
the torch path (no interpreter), the Triton kernel under TRITON_INTERPRET=1 on CPU, and the
constructor's errors."""
import pytest
import torch

from fxmegatron.codegen.where_kernels_run import kernels_run
from fxmegatron.optim import FusedAdamW

LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
SHAPES = [(37,), (300, 7), (1,), (1025,)]


def _grads(shapes, dtypes, steps, seed):
    """Per step, one gradient per parameter; parameter 2's is None at step 1."""
    g = torch.Generator().manual_seed(seed)
    seq = [[torch.randn(s, generator=g).to(dt) for s, dt in zip(shapes, dtypes)] for _ in range(steps)]
    seq[1][2] = None
    return seq


def _reference(p0, grad_seq, scales):
    """(parameters, masters, torch optimizer) after the steps, done the unfused way."""
    params = [p.detach().clone() for p in p0]
    masters = [p.float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    for grads, s in zip(grad_seq, scales):
        for m, g in zip(masters, grads):
            m.grad = None if g is None else g.float() * s
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return params, masters, opt


def _run(dtypes, scales, seed=0, unaligned=False):
    g = torch.Generator().manual_seed(seed + 1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dt)) for s, dt in zip(SHAPES, dtypes)]
    p0 = [p.detach().clone() for p in params]
    grad_seq = _grads(SHAPES, dtypes, len(scales), seed)
    opt = FusedAdamW(params, lr=LR, betas=BETAS, weight_decay=WD)
    for grads in grad_seq:
        for k, (p, gr) in enumerate(zip(params, grads)):
            if unaligned and k == 0 and gr is not None:    # a gradient at an odd address
                buf = torch.empty(gr.numel() + 1, dtype=gr.dtype)
                gr = buf[1:].view(gr.shape).copy_(gr)
            p.grad = gr
        opt.step(scales.pop(0) if scales else None)
        assert all(p.grad is None for p in params)
    return params, p0, grad_seq, opt


def _close(a, b, rel):
    """max |a - b| <= rel * max |b| (b the reference)."""
    return (a.double() - b.double()).abs().max().item() <= rel * max(b.double().abs().max().item(), 1e-30)


def _check(params, opt, ref_params, ref_masters, ref_opt, rel):
    for i, (p, m) in enumerate(zip(params, ref_masters)):
        st = ref_opt.state[m]
        assert opt.steps[i] == int(st["step"]), i
        assert _close(opt.masters[i], m.detach(), rel), i
        assert _close(opt.exp_avgs[i], st["exp_avg"], rel), i
        assert _close(opt.exp_avg_sqs[i], st["exp_avg_sq"], rel), i
        # the parameter is its master rounded (to nearest even), and within one ulp of the reference
        assert torch.equal(p.detach(), opt.masters[i].to(p.dtype)), i
        ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[p.dtype]
        torch.testing.assert_close(p.detach().float(), ref_params[i].float(), rtol=ulp, atol=1e-6)
    # parameter 2 had no gradient at step 1: one step fewer than the others
    assert opt.steps[2] == opt.steps[0] - 1


def test_torch_path_matches_torch_adamw(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    scales = [torch.tensor(0.5), torch.tensor(0.25), torch.tensor(0.8)]
    params, p0, grad_seq, opt = _run(dtypes, list(scales))
    assert not kernels_run(opt.masters[0]) and not opt._kernels_run()
    ref_params, ref_masters, ref_opt = _reference(p0, grad_seq, scales)
    _check(params, opt, ref_params, ref_masters, ref_opt, rel=1e-6)
    # moments moved, parameters moved: the comparison is not between untouched tensors
    assert all(v.abs().max() > 0 for v in opt.exp_avg_sqs)
    assert not torch.equal(params[1].detach(), p0[1])


@pytest.mark.parametrize("case", ["bf16", "fp32", "mixed"])
def test_kernel_matches_torch_adamw(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(FusedAdamW, "_torch_step", lambda *a: pytest.fail("took the torch path"))
    dtypes = {"bf16": [torch.bfloat16] * 4, "fp32": [torch.float32] * 4,
              "mixed": [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]}[case]
    # 3 steps: the third runs with per-parameter step counts (parameter 2 skipped step 1)
    scales = [torch.tensor(0.5), torch.tensor(0.3), None]
    params, p0, grad_seq, opt = _run(dtypes, list(scales), seed=3, unaligned=case == "mixed")
    ref_params, ref_masters, ref_opt = _reference(p0, grad_seq, [s if s is not None else 1.0 for s in scales])
    _check(params, opt, ref_params, ref_masters, ref_opt, rel=1e-6)


def test_kernel_keeps_grads_when_asked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    opt = FusedAdamW([p, frozen], set_grads_to_none=False)
    assert len(opt.params) == 1
    p.grad = torch.ones_like(p)
    opt.step()
    assert p.grad is not None and opt.steps == [1]
    opt.step(set_grads_to_none=True)
    assert p.grad is None and opt.steps == [2]


def test_errors():
    ok = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"parameter 1 has dtype torch.int64.*floating-point"):
        FusedAdamW([ok, torch.arange(3)])
    with pytest.raises(ValueError, match=r"parameter 0 has dtype torch.float64"):
        FusedAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match=r"parameter 2 is on meta but parameter 0 on cpu.*one device"):
        FusedAdamW([ok, torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.empty(3, device="meta"))])
    with pytest.raises(ValueError, match=r"parameter 1 .* is not contiguous"):
        FusedAdamW([ok, torch.nn.Parameter(torch.randn(4, 3).t())])
    with pytest.raises(ValueError, match=r"parameter 1 appears more than once"):
        FusedAdamW([ok, ok])
    with pytest.raises(ValueError, match="empty parameter list"):
        FusedAdamW([torch.nn.Parameter(torch.randn(3), requires_grad=False)])
    opt = FusedAdamW([ok])
    ok.data = torch.randn(4)         # the parameter changed shape under the optimizer
    ok.grad = torch.randn(4)
    with pytest.raises(ValueError, match=r"parameter 0's gradient is torch.float32\[4\]"):
        opt.step()


def test_state_dict_round_trip(monkeypatch):
    """A second optimizer loaded from the first's state_dict takes the same next step, exactly;
    the state_dict holds copies, and bad input is refused by name."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    params, _, _, opt = _run(dtypes, [0.5, 0.25, 0.8])
    sd = opt.state_dict()
    assert [int(st["step"]) for st in sd["state"].values()] == opt.steps == [3, 3, 2, 3]
    assert sd["state"][1]["exp_avg"].data_ptr() != opt.exp_avgs[1].data_ptr()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = FusedAdamW(twins, lr=0.5)                   # hyperparameters come from the state_dict
    other.load_state_dict(sd)
    g = other.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"]) == (LR, BETAS, WD)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=g).to(dt) for s, dt in zip(SHAPES, dtypes)]
    for o, ps in ((opt, params), (other, twins)):
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        o.step()
    for a, b, ma, mb in zip(params, twins, opt.masters, other.masters):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    assert other.steps == [4, 4, 3, 4]
    with pytest.raises(ValueError, match=r"expected 1 parameter group\(s\) of \[4\] parameters"):
        other.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})
    bad = opt.state_dict()
    bad["state"][0]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"parameter 0's exp_avg has shape \(5,\), expected \(37,\)"):
        other.load_state_dict(bad)


def _grouped(params):
    """Two groups, as a training script builds them: matrices with weight decay, the rest
    without and at a different rate."""
    return [{"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": LR * 3}]


@pytest.mark.parametrize("kernel", [False, True])
def test_groups_and_a_scheduler_match_torch_adamw(kernel, monkeypatch):
    """Per-group lr and weight decay, and torch's LR schedulers: the same steps as
    torch.optim.AdamW with the same groups and the same schedule on fp32 masters."""
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(FusedAdamW, "_torch_step", lambda *a: pytest.fail("took the torch path"))
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    g = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dt)) for s, dt in zip(SHAPES, dtypes)]
    ref_params = [p.detach().clone() for p in params]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = FusedAdamW(_grouped(params), lr=LR, betas=BETAS, weight_decay=WD)
    ref = torch.optim.AdamW(_grouped(masters), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda t: 1.0 / (1 + t))
    order = [p for grp in _grouped(params) for p in grp["params"]]
    assert opt.params == order                   # the optimizer's order: the groups' one after the other
    for grads in _grads(SHAPES, dtypes, 3, seed=5):
        for p, m, gr in zip(params, masters, grads):
            p.grad, m.grad = gr, None if gr is None else gr.float()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
        with torch.no_grad():
            for rp, m in zip(ref_params, masters):
                rp.copy_(m)
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"] == LR * 3 / 4
    for i, p in enumerate(order):
        k = next(j for j, q in enumerate(params) if q is p)
        st = ref.state[masters[k]]
        assert opt.steps[i] == int(st["step"]), i
        assert _close(opt.masters[i], masters[k].detach(), 1e-6), i
        assert _close(opt.exp_avg_sqs[i], st["exp_avg_sq"], 1e-6), i
        assert torch.equal(p.detach(), opt.masters[i].to(p.dtype)), i


def test_grouped_state_dict_round_trip_keeps_the_schedule(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SHAPES]
    opt = FusedAdamW(_grouped(params), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
        sched.step()
    sd = opt.state_dict()
    assert [grp["params"] for grp in sd["param_groups"]] == [[0], [1, 2, 3]]
    assert sd["param_groups"][1]["initial_lr"] == LR * 3 and sd["param_groups"][1]["lr"] == LR * 3 / 4
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = FusedAdamW(_grouped(twins), lr=1.0)
    other.load_state_dict(sd)
    assert [grp["lr"] for grp in other.param_groups] == [LR / 4, LR * 3 / 4]
    for o, ps in ((opt, params), (other, twins)):
        for p in ps:
            p.grad = torch.ones_like(p)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
    with pytest.raises(ValueError, match=r"expected 2 parameter group\(s\) of \[1, 3\] parameters, got \[4\]"):
        other.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1, 2, 3]}]})


def test_group_errors_and_closure():
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"parameter group 1: invalid learning rate -1"):
        FusedAdamW([{"params": [a]}, {"params": [b], "lr": -1.0}])
    with pytest.raises(ValueError, match=r"parameter group 0: invalid betas \(0.9, 1.0\)"):
        FusedAdamW([{"params": [a], "betas": (0.9, 1.0)}, {"params": [b]}])
    opt = FusedAdamW([a])
    with pytest.raises(ValueError, match="add_param_group: the parameter set is fixed"):
        opt.add_param_group({"params": [b]})

    def closure():
        loss = (a.float() ** 2).sum()
        loss.backward()
        return loss
    before = a.detach().clone()
    loss = opt.step(closure)
    assert torch.is_tensor(loss) and opt.steps == [1] and not torch.equal(a.detach(), before)
