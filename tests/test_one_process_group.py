"""A script run as plain ``python`` (no torchrun) forms a one-process group; two such runs side
by side (say, one-GPU benchmark rows on two GPUs of one host) must not meet on one port."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE = """
import time, torch.distributed as dist
from fxmegatron.runtime.distributed import init_from_env, read_env
env = init_from_env("cpu", env=read_env(one_process_port=0))
time.sleep(4)                  # both groups alive at once
dist.barrier()
print("world", env.world, "port", __import__("os").environ["MASTER_PORT"])
dist.destroy_process_group()
"""


def test_two_one_process_groups_side_by_side():
    envs = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                            "MASTER_ADDR", "LOCAL_WORLD_SIZE")}
    envs["PYTHONPATH"] = ROOT + os.pathsep + envs.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-c", ONE], env=envs, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.startswith("world 1 port ")
    ports = {out.split()[-1] for out, _ in outs}
    assert len(ports) == 2, ports
