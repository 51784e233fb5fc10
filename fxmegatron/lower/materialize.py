"""Each rank creates only its own shards.

Sources, in order: a given full state dict (sliced per tensor, so a
``torch.load(..., mmap=True)`` dict is read lazily; a state dict that has a method
``read_shard(name, placement, rank, world)`` is asked for the rank's piece instead, so
that a reader of files can read only that piece), the model's own weights
when they are real, or direct initialisation of the shard for a model built on
the meta device. Direct initialisation draws N(0, 0.02) for matrices (in row
chunks seeded by (seed, name, chunk), so a shard holds exactly the values the
full tensor would, whatever the layout), zeros for 1-D ``*bias`` and ones for
other 1-D parameters (norm weights): GPT-2/Megatron's initialisation.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from fxmegatron.capture import Captured, retarget_device
from fxmegatron.ops.dp_gather import take_shard as take_dp_shard
from fxmegatron.placement import Placement, R, Shard, local_shape, shard_slices, take_shard

_CHUNK = 1 << 20
DIGESTS = "fxmegatron/dp_digests"   # gm.meta: a sharded parameter's name -> weight_digest of its whole local piece


def _seed(seed: int, name: str, chunk: int) -> int:
    h = hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def init_shard(name: str, shape, dtype, plc: Placement, rank: int, world: int,
               seed: int = 0, std: float = 0.02) -> torch.Tensor:
    """The values rank ``rank`` holds of a freshly initialised parameter."""
    shape = list(shape)
    if len(shape) < 2:
        full = torch.zeros(shape, dtype=dtype) if name.endswith("bias") else torch.ones(shape, dtype=dtype)
        return take_shard(full, plc, rank, world).clone()
    row = 1
    for s in shape[1:]:
        row *= s
    rows_per_chunk = max(1, _CHUNK // row)
    if isinstance(plc, Shard) and plc.dim == 0:
        wanted = shard_slices(shape[0], plc, rank, world)
    else:
        wanted = [(0, shape[0])]
    pieces = []
    for start, n in wanted:
        c0, c1 = start // rows_per_chunk, (start + n - 1) // rows_per_chunk
        rows = []
        for c in range(c0, c1 + 1):
            g = torch.Generator().manual_seed(_seed(seed, name, c))
            lo = c * rows_per_chunk
            hi = min(shape[0], lo + rows_per_chunk)
            chunk = torch.randn([hi - lo] + shape[1:], generator=g, dtype=torch.float32) * std
            rows.append(chunk[max(start, lo) - lo: min(start + n, hi) - lo])
        pieces.append(torch.cat(rows, 0))
    out = torch.cat(pieces, 0).to(dtype)
    if isinstance(plc, Shard) and plc.dim != 0:
        out = take_shard(out, plc, rank, world).contiguous()
    return out


def local_parameter(name: str, model_tensor: torch.Tensor, plc: Placement, rank: int, world: int,
                    device, state_dict: Optional[Mapping[str, torch.Tensor]] = None,
                    seed: int = 0, expert_cut: Optional[tuple] = None) -> Tuple[torch.nn.Parameter, str]:
    """This rank's piece of parameter ``name`` on ``device``, and "" or, with ``expert_cut`` =
    (experts dim, ep rank, ep), the digest of the whole piece before its experts are cut (the
    replica check compares it over every dp rank): the cut is taken where the values are read,
    so only the rank's experts travel to the device."""
    if torch.device(device).type == "meta":   # planning only: shapes, no values
        shape = list(local_shape(model_tensor.shape, plc, world))
        if expert_cut is not None:
            shape[expert_cut[0]] //= expert_cut[2]
        return torch.nn.Parameter(torch.empty(shape, dtype=model_tensor.dtype, device="meta"),
                                  requires_grad=model_tensor.requires_grad), ""
    if state_dict is not None and name in state_dict:
        read_shard = getattr(state_dict, "read_shard", None)
        local = read_shard(name, plc, rank, world) if callable(read_shard) else \
            take_shard(state_dict[name], plc, rank, world)
    elif model_tensor.device.type != "meta":
        local = take_shard(model_tensor.detach(), plc, rank, world)
    else:
        local = init_shard(name, model_tensor.shape, model_tensor.dtype, plc, rank, world, seed)
    digest = ""
    if expert_cut is not None:
        dim, ep_rank, ep = expert_cut
        digest = weight_digest(local.to(model_tensor.dtype))
        n = local.shape[dim] // ep
        local = local.narrow(dim, ep_rank * n, n)
    local = local.to(device=device, dtype=model_tensor.dtype, copy=True).contiguous()
    return torch.nn.Parameter(local, requires_grad=model_tensor.requires_grad), digest


def materialize_graph(gm: fx.GraphModule, cap: Captured, placements: Mapping[str, Placement], rank: int,
                      world: int, device, state_dict: Optional[Mapping] = None, seed: int = 0,
                      source: Optional[fx.GraphModule] = None,
                      params: Optional[Dict[str, torch.nn.Parameter]] = None,
                      groups: Optional[Mapping[str, str]] = None,
                      shards: Optional[Mapping[str, tuple]] = None, shard_world: int = 1,
                      shard_rank: int = 0, experts: Optional[tuple] = None,
                      shard_over: Optional[Mapping[str, Tuple[int, int]]] = None) -> fx.GraphModule:
    """``gm``'s graph with this rank's parameter shards, the buffers, constants and
    submodules it uses, on ``device`` ("meta": local shapes, no values). Constants are
    taken from ``source`` where it has them (the graph before it went to meta). ``params``
    (name -> shard) is shared between calls, so chunks of one rank share a weight.
    ``groups`` binds the passes' axis names ("@tp") to this job's process groups. ``shards``
    (``passes.dp_shard``'s names): each of those parameters is kept as rank ``shard_rank``'s
    shard of ``shard_world`` (``ops.dp_gather``); the digest of its whole local piece goes to
    ``gm.meta[DIGESTS]``, for the check that every data-parallel replica built the same model.
    ``experts``: (parameter -> experts dim, ep rank, ep) of expert parallelism: each of those
    parameters keeps its rank's E/ep experts (after the tp cut); its whole local piece's digest
    goes to ``DIGESTS`` as well. ``shard_over``: name -> (world, rank) of a sharded parameter
    spread over another group than ``shard_world`` (an expert weight over the ranks holding
    the same experts)."""
    params = {} if params is None else params
    shards = shards or {}
    root, digests = {}, {}
    for node in gm.graph.nodes:
        t = node.target
        if node.op == "get_attr":
            if t in cap.params:
                if t not in params:
                    cut = (experts[0][t], experts[1], experts[2]) if experts is not None and t in experts[0] \
                        else None
                    params[t], digest = local_parameter(t, cap.params[t], placements.get(t, R), rank, world,
                                                        device, state_dict, seed, cut)
                    if cut is not None:
                        digests[t] = digest
                    if t in shards:
                        # an expert weight's replicas compare the piece before its experts were cut
                        digests.setdefault(t, weight_digest(params[t]))
                        size, at = (shard_over or {}).get(t, (shard_world, shard_rank))
                        params[t] = nn.Parameter(take_dp_shard(params[t], size, at),
                                                 requires_grad=params[t].requires_grad)
                root[t] = params[t]
            elif t in cap.buffers:
                root[t] = cap.buffers[t].to(device)
            elif is_module(gm, t):
                root[t] = gm.get_submodule(t)
            else:   # lifted constants
                owner = source if source is not None and _has_attr(source, t) else gm
                v = _get_attr(owner, t)
                root[t] = v.to(device) if isinstance(v, torch.Tensor) else v
        elif node.op == "call_module":
            root[t] = gm.get_submodule(t)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = bind_groups(retarget_device(fx.GraphModule(root, graph), device), groups or {})
    if digests:
        out.meta[DIGESTS] = digests
    return out


DIGEST_CHUNK = 1 << 26     # bytes: a weight larger than this is hashed in pieces on threads


def weight_digest(t: torch.Tensor) -> str:
    """The exact bits of ``t`` (NaNs and signed zeros included), hashed on the host, with its
    shape and dtype; "" for a meta tensor. Digests are compared within one job only (the
    replica check), never stored."""
    if t.device.type == "meta":
        return ""
    raw = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    return f"{tuple(t.shape)} {t.dtype} " + _bytes_digest(raw)


def _bytes_digest(raw) -> str:
    """blake2b of ``raw``; above ``DIGEST_CHUNK`` bytes, blake2b of its pieces' blake2b digests,
    the pieces hashed on threads (hashlib lets go of the GIL while it hashes a large buffer), so
    that a weight of gigabytes (an MoE block's experts) is not hashed on one core."""
    if raw.nbytes <= DIGEST_CHUNK:
        return hashlib.blake2b(raw, digest_size=16).hexdigest()
    pieces = [raw[i:i + DIGEST_CHUNK] for i in range(0, raw.nbytes, DIGEST_CHUNK)]
    with ThreadPoolExecutor(max_workers=min(len(pieces), os.cpu_count() or 1)) as pool:
        parts = list(pool.map(lambda piece: hashlib.blake2b(piece, digest_size=16).digest(), pieces))
    return hashlib.blake2b(b"".join(parts), digest_size=16).hexdigest()


def bind_groups(gm: fx.GraphModule, groups: Mapping[str, str]) -> fx.GraphModule:
    """The passes name a collective's group by its mesh axis ("@tp"): here, in ``gm`` and the
    graphs inside it (recomputed regions), each becomes the process group's name."""
    if not groups:
        return gm
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            if n.op == "call_function" and any(isinstance(a, str) and a in groups for a in n.args):
                n.args = tuple(groups[a] if isinstance(a, str) and a in groups else a for a in n.args)
        mod.recompile()
    return gm


def is_module(gm: nn.Module, target: str) -> bool:
    try:
        gm.get_submodule(target)
        return True
    except AttributeError:
        return False


def _get_attr(obj, target: str):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _has_attr(obj, target: str) -> bool:
    try:
        _get_attr(obj, target)
        return True
    except AttributeError:
        return False
