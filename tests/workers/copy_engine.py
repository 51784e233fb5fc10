"""The copy-engine transport of the overlapped tensor-parallel linears (GPU), and its set-up
agreement (gloo)."""
import torch


def copy_engine_vs_nccl(rank, world):
    """The overlapped linears over copy engines and over NCCL, both in fp32, against the same ops
    over NCCL in fp64, forward and backward: the gather with three linears of one input (biases;
    the backward's weight gradients are allocated while the reduce-scatter still runs on the side
    stream) and the reduce-scatter; twice in a row, so the second round runs in the other buffer
    half. Returns (whether the group has symmetric memory, the copy engines' largest relative
    error, NCCL's): fp32 rounding alone reaches a few 1e-5 here (the activations grow through
    the two rounds), so the copy engines are held to NCCL's own error, not to a fixed bound."""
    import torch.distributed as dist

    from fxmegatron.ops import copy_engine
    from fxmegatron.ops.overlapped_linear import gathered_linears, scattered_linear

    pg = dist.group.WORLD
    name = pg.group_name
    B, S, H = 3, 8 * world, 32
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(B, S // world, H, generator=g).cuda()
    ws0 = [torch.randn(H // world, H, generator=g).cuda() for _ in range(3)]
    bs0 = [torch.randn(H // world, generator=g).cuda() for _ in range(3)]
    w20 = torch.randn(H, H // world, generator=g).cuda()
    usable = copy_engine.usable(x0, pg, name)

    def run(transport, dtype=torch.float32):
        x = x0.to(dtype, copy=True).requires_grad_()
        ws = [w.to(dtype, copy=True).requires_grad_() for w in ws0]
        bs = [b.to(dtype, copy=True).requires_grad_() for b in bs0]
        w2 = w20.to(dtype, copy=True).requires_grad_()
        y = None
        for _ in range(2):
            q, k, v = gathered_linears(x if y is None else y, ws, bs, 1, world, name, 4, transport)
            y = scattered_linear(torch.tanh(q) * k + v, w2, 1, world, name, 4, transport)
        y.pow(2).sum().backward()
        return [y.detach(), x.grad, w2.grad] + [t.grad for t in ws + bs]

    def err(got, ref):
        return max(((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, ref))

    ref = run("nccl", torch.float64)
    nccl = run("nccl")
    ce = run("copy_engine" if usable else "nccl")
    return usable, err(ce, ref), err(nccl, ref)


def copy_engine_agreement(rank, world, fail_allocate, fail_rendezvous):
    """``copy_engine.agree_to_set_up`` with the allocation failing on rank ``fail_allocate`` or
    the rendezvous on rank ``fail_rendezvous`` (-1: none): (result, rendezvous was called)."""
    import torch.distributed as dist

    from fxmegatron.ops.copy_engine import agree_to_set_up
    called = []

    def allocate():
        if rank == fail_allocate:
            raise RuntimeError("no symmetric memory here")
        return torch.zeros(4)

    def rendezvous(buf):
        called.append(True)
        if rank == fail_rendezvous:
            raise RuntimeError("rendezvous failed")
    return agree_to_set_up(dist.group.WORLD, torch.device("cpu"), allocate, rendezvous), bool(called)
