# torchrun --standalone --nproc_per_node 4 examples/quickstart.py      (CPU, gloo; no downloads)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxmegatron
from fxmegatron.models.gpt import GPT, GPTConfig      # or your own nn.Module, or an HF causal LM

dist.init_process_group("gloo")      # GPUs: "nccl", torch.cuda.set_device(LOCAL_RANK), mesh on "cuda"
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))   # any of ("dp", "pp", "tp")
torch.manual_seed(0)                 # the same weights on every rank
model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))


def batch(step):                     # what model(...) takes; its forward returns the loss
    start = torch.randint(0, 256, (8, 1), generator=torch.Generator().manual_seed(step))
    x = (start + torch.arange(33)) % 256     # counting sequences: learnable in a few steps
    return (x[:, :-1], x[:, 1:])


pm = fxmegatron.parallelize(model, mesh, batch(0), microbatches=2,   # 1F1B over pp, tp inside
                            sequence_parallel=True, recompute="selective")
opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)                   # this rank's shards
for step in range(5):
    loss = pm.train_step(batch(step))        # forward + backward by the schedule; the global batch
    pm.clip_grad_norm_(1.0)                  # the whole model's norm, across shards
    opt.step()
    opt.zero_grad()
    held_out = pm.eval_step(batch(10_000))   # forward only: no backward, dropout off
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}, held-out {held_out.item():.4f}")
pm.dump("dump/quickstart")                   # graph.py, placements, collectives, plan per rank
full = pm.full_state_dict()                  # collective: whole tensors on every rank
if dist.get_rank() == 0:
    model.load_state_dict(full)              # the unmodified model, trained (HF: model.save_pretrained)
dist.barrier()                               # every rank done before any tears down
dist.destroy_process_group()
