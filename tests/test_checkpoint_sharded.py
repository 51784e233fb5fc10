"""Checkpoints under ``dp_shard`` are written without a gather: each rank of the first sharding
group writes the flat ranges it holds (``io.flat_pieces``), and a reader puts them together."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from fxmegatron.errors import CheckpointError
from fxmegatron.io.checkpoint import read_full_state
from fxmegatron.io.flat_pieces import join_flat
from tests.distributed import run_distributed
from tests.workers.checkpoint import sharded_save


def _files(directory):
    """{file: {key: (metadata, numel)}} of a checkpoint's shard files."""
    out = {}
    for f in json.load(open(os.path.join(directory, "index.json")))["files"]:
        with safe_open(os.path.join(directory, f), "pt") as s:
            meta = json.loads(s.metadata()["fxmegatron"])
            out[f] = {k: (meta[k], s.get_slice(k).get_shape()) for k in s.keys()}
    return out


@pytest.mark.parametrize("mode, world, replicate", [("full", 2, 1), ("optimizer", 2, 1), ("full", 4, 2)])
def test_each_rank_writes_its_share_and_the_whole_model_comes_back(tmp_path, mode, world, replicate):
    wholes = run_distributed(sharded_save, world, mode, replicate, str(tmp_path / "ck"))
    files = _files(tmp_path / "ck")
    writers = world // replicate
    assert len(files) == writers                            # one file per rank of the first replica group
    back = read_full_state(str(tmp_path / "ck"))        # a tied weight once
    assert back and set(back) <= set(wholes[0])
    for n, t in back.items():
        assert torch.equal(t, wholes[0][n]), n              # the whole model, bit for bit
    # what the ranks share out: under "full" every parameter and its state, under "optimizer" the
    # state; a step count is whole, written once
    share = lambda k: not k.endswith("/step") and (mode == "full" or k.startswith("optim/"))   # noqa: E731
    total, held = {}, {}
    for f, keys in files.items():
        held[f] = 0
        for k, (m, shape) in keys.items():
            if not share(k):
                assert "flat" not in m and f.endswith("shard0.safetensors"), (f, k)
                continue
            assert "flat" in m, (f, k)
            total[k] = torch.Size(m["shape"]).numel()
            held[f] += shape[0]
    assert sum(held.values()) == sum(total.values())         # the ranges tile each tensor once
    for f in files:                                          # each rank its share (and alignment padding)
        assert held[f] <= sum(total.values()) / writers + 64 * len(total), (f, held, sum(total.values()))


def test_flat_ranges_that_do_not_tile_the_tensor_are_named():
    t = torch.arange(10.0)
    assert torch.equal(join_flat("w", [(5, 10, t[5:]), (0, 5, t[:5])], (2, 5)), t.view(2, 5))
    with pytest.raises(CheckpointError, match=r"w: its flat pieces do not tile the tensor: elements \[4, 5\)"):
        join_flat("w", [(0, 4, t[:4]), (5, 10, t[5:])], (10,))
    with pytest.raises(CheckpointError, match="end at element 8 of 10"):
        join_flat("w", [(0, 8, t[:8])], (10,))
    with pytest.raises(CheckpointError, match="do not tile"):
        join_flat("w", [(0, 6, t[:6]), (5, 10, t[5:])], (10,))
