"""The dump of a 2-layer model at tp=2 shows exactly Megatron's collectives:
one f and one g per attention block and per MLP block, the embedding's g, and the
LM head's f with the vocab-parallel loss; nothing more."""
import re

import pytest

from fxmegatron.io.dump import collective_nodes, write_dump
from tests import models
from tests.helpers import transform


def _block_of(path):
    m = re.match(r"(.*?\.\d+)\.", path + ".")
    return m.group(1) if m else ""


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_collective_count_two_layers(name, tmp_path):
    model = models.build(name, n_layer=2)
    _, plan, gm = transform(model, models.batch(name), tp=2)
    write_dump(str(tmp_path), gm, {})
    listed = (tmp_path / "collectives.txt").read_text().splitlines()
    found = collective_nodes(gm)
    assert len(listed) == len(found)

    per_block = {}
    outside = []
    for node, kind in found:
        users = [u for u in node.users] if kind == "f" else [node]
        # f belongs where its consumers are (the first matmuls of the block)
        from fxmegatron.capture import module_path
        path = module_path(users[0])
        block = _block_of(path)
        (per_block.setdefault(block, []) if block else outside).append(kind)
    blocks = sorted(per_block)
    assert len(blocks) == 2, per_block
    for b in blocks:
        # attention: f ... g, then MLP: f ... g
        assert per_block[b] == ["f", "g", "f", "g"], (b, per_block[b])
    kinds = [k.split("[")[0] for k in outside]
    assert kinds == ["g", "f", "vocab_parallel_cross_entropy"], outside
    # 2 column + 2 row matmul groups per block; the loss is vocab-parallel
    assert sum(d.kind == "row" for d in plan.decisions.values()) == 4
    assert sum(d.kind == "vocab" for d in plan.decisions.values()) == 2


def test_dump_lists_placements_and_decisions(tmp_path):
    model = models.build("gpt2")
    _, _, gm = transform(model, models.batch("gpt2"), tp=2)
    write_dump(str(tmp_path), gm, {"tp": "2"})
    table = (tmp_path / "placements.txt").read_text()
    assert "S(1, blocks=[64, 64, 64])" in table       # fused QKV split per block
    assert "reduce_from_tp" in (tmp_path / "graph.py").read_text()
    plan = (tmp_path / "plan.txt").read_text()
    assert "transformer.wpe" in plan and "replicated: its indices are computed" in plan
