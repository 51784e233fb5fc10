"""fxmegatron's overlapped tensor parallelism (NCCL) beside other users of the same process group
and of symmetric memory in one process: collectives of the user's own, torch's async-TP ops
(its symmetric-memory workspace, its backend stream), a symmetric buffer of the user's own with
its barriers and signals, and a DTensor model whose layers inductor's micro-pipeline pass
compiles into those ops (torchtitan's async TP). Each runs before fxmegatron's model is built
and between its steps; fxmegatron's losses and gradients are compared with the plain model's."""
import copy

import torch

# a GPT small enough for seconds a step, large enough that the overlapped ops' pieces are
# megabytes (fxmegatron's workspace grows past its first size) and the kernels take real time
SHAPE = dict(vocab_size=2048, block_size=256, n_layer=2, n_head=8, n_embd=512)
BATCH = 4


def _batch(seed, dev):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]), generator=g)
    labels = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.25] = -100     # masked labels, as in SFT
    return ids.to(dev), labels.to(dev)


class Neighbours:
    """The foreign work, each kind a method run on the tp group ``pg`` of ``mesh``."""

    def __init__(self, mesh, kinds, dev):
        self.mesh, self.pg, self.kinds, self.dev = mesh, mesh.get_group(), kinds, dev
        self.name = self.pg.group_name
        self.world, self.rank = self.pg.size(), self.pg.rank()
        self.calls = 0
        self.model = None

    def __call__(self):
        for kind in self.kinds:
            getattr(self, kind)()
        self.calls += 1

    def collectives(self):
        import torch.distributed as dist
        n = (1 << 20) + 4096 * self.calls     # a new size each time: NCCL's and the allocator's state move
        x = torch.randn(n * self.world, device=self.dev)
        dist.all_reduce(x, group=self.pg)
        out = torch.empty(n * self.world * self.world, device=self.dev)
        dist.all_gather_into_tensor(out, x, group=self.pg)
        dist.reduce_scatter_tensor(x[:n], out[: n * self.world], group=self.pg)
        dist.barrier(group=self.pg)

    def torch_async_ops(self):
        """torch's fused all-gather + matmul and matmul + reduce-scatter on the same group, each
        time larger, so its workspace is re-allocated (and re-rendezvoused) while ours lives."""
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
        rows = 256 * (self.calls + 1)
        a = torch.randn(rows, 512, device=self.dev)
        b = torch.randn(512, 1024, device=self.dev)
        torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, self.name)
        torch.ops.symm_mem.fused_matmul_reduce_scatter(torch.randn(rows * self.world, 512, device=self.dev), b,
                                                        "sum", 0, self.name)

    def own_symmetric_buffer(self):
        """A user's own symmetric buffer: filled, barriers on both channels, a peer read, and a
        signal sent and awaited per peer."""
        from torch.distributed import _symmetric_memory as symm_mem
        buf = symm_mem.empty(1 << 22, dtype=torch.uint8, device=self.dev)
        h = symm_mem.rendezvous(buf, self.pg)
        buf.fill_(self.rank + 1)
        h.barrier(channel=0)
        peer = (self.rank + 1) % self.world
        got = h.get_buffer(peer, (1 << 22,), torch.uint8, 0).clone()
        h.barrier(channel=1)
        for r in range(self.world):
            if r != self.rank:
                h.put_signal(r, channel=2)
        for r in range(self.world):
            if r != self.rank:
                h.wait_signal(r, channel=2)
        assert int(got[0]) == peer + 1

    def async_tp_model(self):
        """A DTensor MLP on sequence shards (torchtitan's plan), compiled with inductor's
        micro-pipeline pass on: forward and backward."""
        if self.model is None:
            import torch.nn as nn
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                           parallelize_module)
            import torch._inductor.config as inductor_config
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group
            inductor_config._micro_pipeline_tp = True
            enable_symm_mem_for_group(self.name)
            torch.manual_seed(7)
            mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(self.dev)
            parallelize_module(mlp, self.mesh, {
                "0": ColwiseParallel(input_layouts=Shard(1)),
                "2": RowwiseParallel(output_layouts=Shard(1))})
            self.model = torch.compile(mlp)
        x = torch.randn(4, 1024 // self.world, 512, device=self.dev, requires_grad=True)
        self.model(x).square().sum().backward()     # the plan's input and output: local sequence shards
        self.model.zero_grad(set_to_none=True)


def fx_beside_neighbours(rank, world, transport, compile, kinds, steps=4, dtype=torch.float32):
    """fxmegatron at tp=world, sequence parallel, ``tp_comm_overlap=2`` over ``transport``
    (``compile``), with ``kinds`` of foreign work before the build and between the steps, and the
    plain model on one GPU, ``steps`` AdamW steps on different batches: (whether the copy engines
    served the group, fx's losses, the plain model's, each parameter's first-step gradient error
    relative to the plain model's)."""
    from gpt import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh

    import fxmegatron
    from fxmegatron.ops import copy_engine
    from tests.workers.common import rel_err

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    neighbours = Neighbours(mesh, kinds, dev)
    neighbours()
    torch.manual_seed(1234)
    ref = GPT(GPTConfig(dropout=0.0, **SHAPE)).to(dev, dtype)
    model = copy.deepcopy(ref)
    pm = fxmegatron.parallelize(model, mesh, _batch(0, dev), sequence_parallel=True, tp_comm_overlap=2,
                                tp_comm_transport=transport, compile=compile)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, losses_ref, grad_err = [], [], {}
    for i in range(steps):
        neighbours()
        b = _batch(i + 1, dev)
        loss_ref = ref(*b)
        loss_ref.backward()
        losses_ref.append(loss_ref.item())
        losses.append(pm.train_step(b).item())
        neighbours()
        if i == 0:
            full = pm.full_grads()
            grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            scale = 0.01 * max(g.abs().max().item() for g in grads.values())
            grad_err = {n: rel_err(full[n], g, scale) for n, g in grads.items()}
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    served = any(copy_engine._USABLE.values())
    return served, losses, losses_ref, grad_err
