"""The torchrun set-up, written once: read the process's place from the environment,
pick the device and backend, start the process group, build the device mesh.

    env = init_from_env()                       # RANK, WORLD_SIZE, ... as torchrun sets them
    mesh = make_mesh(env, dp=1, pp=2, tp=2)     # a ("dp", "pp", "tp") DeviceMesh (cp=: a "cp" dim)
    ...
    dist.destroy_process_group()

Scripts that also run as a plain ``python script.py`` pass ``one_process_port``: without
torchrun's variables they then form a one-process group on that port, or on a port the OS
finds free for 0 (so that two one-process runs side by side do not meet on one port). Scripts that check
their arguments against the world size before starting the group call ``read_env`` first
and hand its result to ``init_from_env``.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Env:
    """Where this process stands: its rank among ``world`` processes (``local_rank`` among
    ``local_world`` on its host) and, once the group is started, its device and backend."""
    rank: int
    world: int
    local_rank: int
    local_world: int
    launched: bool                          # started by torchrun (False: a plain one-process run)
    device: Optional[torch.device] = None   # set by init_from_env
    backend: Optional[str] = None           # "nccl" or "gloo", set by init_from_env

    @property
    def lead(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS finds free now (for a rendezvous started next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_env(one_process_port: Optional[int] = None) -> Env:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them. Without
    them and with ``one_process_port``, sets them (and MASTER_ADDR, MASTER_PORT: that port, a
    free one for 0, unless MASTER_PORT is set) for a one-process group; without them and
    without a port, raises a RuntimeError."""
    launched = "RANK" in os.environ
    if not launched:
        if one_process_port is None:
            raise RuntimeError("RANK is not set: start this script with torchrun")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(one_process_port or free_port()))
    return Env(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
               local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
               launched=launched)


def pick_device(device: str, env: Env) -> torch.device:
    """``device`` "cpu", "cuda" (GPU ``local_rank``) or "auto": cuda when there is a GPU for
    each process on this host, else cpu."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected auto, cpu or cuda")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= env.local_world else "cpu"
    return torch.device("cuda", env.local_rank) if device == "cuda" else torch.device("cpu")


def init_from_env(device: str = "auto", backend: Optional[str] = None, env: Optional[Env] = None,
                  one_process_port: Optional[int] = None) -> Env:
    """Start the default process group from torchrun's environment: pick the device
    (``pick_device``; on cuda, make GPU ``local_rank`` current), the backend (``backend``,
    else nccl on cuda and gloo on cpu) and call ``init_process_group``. Returns ``env``
    (default: ``read_env(one_process_port)``) with its device and backend."""
    env = env or read_env(one_process_port)
    dev = pick_device(device, env)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    dist.init_process_group(backend)
    return replace(env, device=dev, backend=backend)


def make_mesh(env: Env, dp: Optional[int] = None, pp: Optional[int] = None, tp: Optional[int] = None,
              cp: Optional[int] = None):
    """A DeviceMesh on ``env``'s device type with the axes given, in the order dp, pp, cp, tp
    (``make_mesh(env, pp=2, tp=2)`` has axes ("pp", "tp")). Their product must be the world
    size."""
    axes = [(name, size) for name, size in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)) if size is not None]
    if not axes:
        raise ValueError("make_mesh: give at least one of dp, pp, cp, tp")
    sizes = [size for _, size in axes]
    product = 1
    for size in sizes:
        product *= size
    if product != env.world:
        shown = " x ".join(f"{name}={size}" for name, size in axes)
        raise ValueError(f"make_mesh: {shown} = {product}, but the world has {env.world} processes")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(env.device.type if env.device is not None else "cpu", tuple(sizes),
                            mesh_dim_names=tuple(name for name, _ in axes))
