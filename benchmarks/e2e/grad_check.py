"""``--check`` in bfloat16: every row's first loss and each of its first gradients against the
plain model's in float32, measured by how far the plain model itself lands in bfloat16.

In bf16 no two programs agree to 1e-4 (the float32 check's tolerance): a GEMM of another
shape, a fused kernel, an fp32 upcast in another place each round differently. What the check
asks instead is that a row be no less exact than the plain model run in bf16, parameter by
parameter. From the same bf16 weights (the plain model's, upcast exactly for the reference):

* the reference: the plain model in float32, one forward and backward of the run's batch;
* the yardstick: the plain model in bf16, eager, the same step;
* each row: its first step in bf16, built as the timed rows are built.

For a parameter p, ``err(p) = ||g(p) - g32(p)|| / ||g32(p)||`` (norms over the whole tensor).
A row passes when for every parameter ``err_row(p) <= RATIO * err_plain(p) + FLOOR`` and its
loss is within ``RATIO * |L_plain - L32| + FLOOR * |L32|`` of the float32 loss. A program
that computes something else (a wrong mask, a gradient summed twice, a missing term) lands far
outside: a gradient 1% off is an error of 1e-2 where bf16 rounding gives about 3e-3 on these
models. The check runs before timing, on its own build of each row (compiled rows compile
twice; inductor's cache makes the second build quick).

At world > 1 every rank computes the reference (the plain model on its own device, seeded: the
same weights everywhere) and compares the gradients it holds, whole (``full_grads``: gathered
over tp, ep and a sharded dp); the ranks' verdicts are then joined: a parameter is missing only
when no rank holds its gradient (a pipeline stage holds its own), the row passes when every
rank's gradients and loss do, and the worst parameter is the worst on any rank.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from e2e.measure import release

RATIO = 2.0
FLOOR = 1e-3


def _named_grads(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The gradients by the unmodified model's names, in float32 on the CPU (a compiled
    module's ``_orig_mod.`` dropped; a ParallelModel's whole gradients)."""
    if hasattr(module, "full_grads"):
        grads = module.full_grads()
    else:
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    out = {}
    for n, g in grads.items():
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n.replace("_orig_mod.", "")] = g.detach().float().cpu()
    return out


def reference(spec, dev, batch) -> Tuple[dict, float, dict, float, dict]:
    """(the bf16 weights on the CPU, float32 loss, float32 gradients, bf16 loss, bf16 gradients)
    of the plain model's first step."""
    runs = {}
    state = {k: v.detach().cpu().clone() for k, v in spec.plain(dev, torch.bfloat16).state_dict().items()}
    for dtype in (torch.float32, torch.bfloat16):
        model = spec.plain(dev, dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        loss = spec.loss(model, batch)
        loss.backward()
        runs[dtype] = (loss.item(), _named_grads(model))
        del model, loss
        release(dev)
    return (state, *runs[torch.float32], *runs[torch.bfloat16])


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(loss, grads, ref) -> dict:
    """One row's result against ``reference``'s: the worst parameter's errors, and whether it
    passes (module docstring)."""
    _, loss32, g32, loss_bf, g_bf = ref
    missing = sorted(set(g32) - set(grads))
    worst, grads_ok = None, True
    for name, g in grads.items():
        if name not in g32:
            continue
        e_row, e_plain = _rel(g, g32[name]), _rel(g_bf[name], g32[name])
        grads_ok &= e_row <= RATIO * e_plain + FLOOR
        margin = e_row / (RATIO * e_plain + FLOOR)
        if worst is None or margin > worst[3]:
            worst = (name, e_row, e_plain, margin)
    loss_ok = abs(loss - loss32) <= RATIO * abs(loss_bf - loss32) + FLOOR * abs(loss32)
    return {"ok": grads_ok and loss_ok and not missing, "grads_ok": grads_ok, "loss_ok": loss_ok, "loss": loss,
            "loss_fp32": loss32, "loss_plain_bf16": loss_bf, "worst": worst, "missing": missing,
            "held": sorted(grads)}


def over_ranks(r: dict, g32) -> dict:
    """``compare``'s result of every rank as one (module docstring); collective over the
    default group, ``r`` itself in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return r
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (r["grads_ok"], r["loss_ok"], r["worst"], r["held"]))
    missing = sorted(set(g32) - set().union(*(set(e[3]) for e in every)))
    worst = max((e[2] for e in every if e[2] is not None), key=lambda w: w[3], default=None)
    ok = all(e[0] and e[1] for e in every) and not missing
    return dict(r, ok=ok, worst=worst, missing=missing)


def build_row(lay, state, spec, dev, batch, meshes):
    """A row's Job in bf16 as end_to_end.py builds it, fxmegatron's (and FSDP2's) from ``state``."""
    from e2e.builders import BUILDERS
    return BUILDERS[lay.kind](lay, spec, dev, torch.bfloat16, batch, meshes=meshes,
                              ref_state=state if lay.kind in ("fx", "fsdp2") else None)


def check_bf16(layouts, build, spec, dev, batch, lead) -> bool:
    """Build each layout (``build(lay, state)`` -> its Job, from the bf16 weights ``state``),
    run its first step, compare (``compare``); print a line per row on the lead rank. Returns
    whether any row failed, and the weights (the timed rows start from them too)."""
    ref = reference(spec, dev, batch)
    _, loss32, _, loss_bf, _ = ref
    if lead:
        print(f"check (bf16): the plain model's first loss {loss32:.6f} in float32, {loss_bf:.6f} in bf16; a row "
              f"passes when every gradient's relative error to float32 is <= {RATIO} x the plain bf16 model's "
              f"+ {FLOOR}", flush=True)
    failed = False
    for lay in layouts:
        job = build(lay, ref[0])
        loss = job.fwd_bwd().item()
        r = over_ranks(compare(loss, _named_grads(job.keep[0]), ref), ref[2])
        failed |= not r["ok"]
        if lead:
            name, e_row, e_plain, _ = r["worst"] or ("-", 0.0, 0.0, 0.0)
            miss = f"; no gradient for {r['missing'][:3]}" if r["missing"] else ""
            print(f"  {lay.name:18} loss {loss:.6f}; worst gradient {name}: error {e_row:.2e} against the plain "
                  f"bf16 model's {e_plain:.2e}{miss} {'ok' if r['ok'] else 'FAILED'}", flush=True)
        del job
        release(dev)
    if lead:
        print("check (bf16): " + ("FAILED" if failed else "passed"), flush=True)
    return failed, ref[0]
