"""fxmegatron's attention op where the batch or the model is split, on two GPUs (skipped without
them): pipeline 1F1B and interleaved with microbatches, data parallel, tensor parallel with
selective and full recompute, compiled. The op must be in the program, and the gradients with it
no further from the fp32 unmodified model than those of the same layout with aten's SDPA."""
import pytest
import torch

from tests.distributed import run_distributed
from tests.workers.fused_attention import LAYOUTS, op_against_sdpa


def test_attention_op_is_as_exact_as_sdpa_in_every_split_layout():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results = run_distributed(op_against_sdpa, 2, list(LAYOUTS), backend="nccl")
    failures = []
    for rank, out in enumerate(results):
        for name, row in out.items():
            op, sdpa = row["op"], row["sdpa"]
            print(rank, name, "calls", op["calls"], "losses", op["losses"], sdpa["losses"],
                  "worst grad err op %.4f sdpa %.4f" % (max(op["grad_err"].values()), max(sdpa["grad_err"].values())))
            if op["calls"] == 0 or sdpa["calls"] != 0:
                failures.append(f"rank {rank} {name}: op calls {op['calls']}, sdpa-row calls {sdpa['calls']}")
            for a, b in zip(op["losses"], sdpa["losses"]):
                if abs(a - b) > 2e-2 * abs(b):
                    failures.append(f"rank {rank} {name}: losses {op['losses']} against {sdpa['losses']}")
                    break
            for n, err in op["grad_err"].items():
                if err > max(2 * sdpa["grad_err"][n], 0.03):
                    failures.append(f"rank {rank} {name}: {n} gradient error {err:.4f} (sdpa {sdpa['grad_err'][n]:.4f})")
    assert not failures, "\n".join(failures)
