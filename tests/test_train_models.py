"""The trainer's model sources (fxmegatron.train.models): lazy safetensors weights whose
``read_shard`` gives exactly ``take_shard`` of the whole tensor for every placement; HF folders
(one file or sharded, tied weights saved once) that give ``parallelize`` the local parameters
of the model in memory; the bundled GPT's shard-by-shard initialisation; factories; errors."""
import atexit
import json
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fxmegatron.compiler import compile_program
from fxmegatron.config import ParallelConfig
from fxmegatron.errors import ConfigError
from fxmegatron.mesh import Axis
from fxmegatron.models.gpt import GPT, GPTConfig
from fxmegatron.placement import P, R, Shard, take_shard
from fxmegatron.lower.materialize import init_shard
from fxmegatron.train.models import SafetensorsState, load_model
from tests.families import FAMILIES, make_batch

_FILES = tempfile.mkdtemp(prefix="fxm-read-shard-")     # hypothesis runs many examples per test: no tmp_path
atexit.register(shutil.rmtree, _FILES, True)


@st.composite
def tensor_and_placement(draw):
    world = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    kind = draw(st.sampled_from(["R", "P", "S", "S-blocks"]))
    plc = {"R": R, "P": P}.get(kind)
    if plc is None:
        dim = draw(st.integers(0, ndim - 1))
        if kind == "S":
            shape[dim] = world * draw(st.integers(1, 3))
            plc = Shard(dim)
        else:
            blocks = tuple(world * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
            shape[dim] = sum(blocks)
            plc = Shard(dim, blocks)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return torch.randn(shape).to(dtype), plc, draw(st.integers(0, world - 1)), world


@settings(max_examples=150, deadline=None)
@given(tensor_and_placement())
def test_read_shard_is_take_shard(case):
    full, plc, rank, world = case
    path = os.path.join(_FILES, "t.safetensors")
    save_file({"w": full}, path)
    state = SafetensorsState({"layer.w": (path, "w")}, torch.float32)
    got = state.read_shard("layer.w", plc, rank, world)
    want = take_shard(full, plc, rank, world).float()
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.equal(got, want), (plc, rank, world)
    assert torch.equal(state["layer.w"], full.float())


def _saved(tmp_path, name, **overrides):
    d = str(tmp_path / name)
    FAMILIES[name].build(**overrides).save_pretrained(d)
    return d


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "qwen2_moe", "olmoe"])
def test_simulated_tp2_ranks_equal_the_model_in_memory(tmp_path, name, monkeypatch):
    """Each rank of tp=2, built in this process by the compiler ``parallelize`` runs: from the
    meta model and the files (read_shard) and from the model in memory, the same local shards
    (gpt2: its tied embedding, and a fused qkv split block-wise; the MoE families: transformers
    saves their experts one tensor each, and the trainer stacks them as from_pretrained does)."""
    asked = []
    read = SafetensorsState.read_shard
    monkeypatch.setattr(SafetensorsState, "read_shard", lambda self, n, *a: asked.append(n) or read(self, n, *a))
    src = load_model("hf", _saved(tmp_path, name), {}, torch.float32)
    assert all(p.is_meta for p in src.model.parameters())
    batch = make_batch(FAMILIES[name], 0)
    kinds = set()
    for rank in range(2):
        axes = {"tp": Axis(2, rank, "", (0, 1)), "pp": Axis(), "dp": Axis()}
        ours = compile_program(src.model, batch, axes, torch.device("cpu"), ParallelConfig(state_dict=src.state_dict))
        ref = compile_program(FAMILIES[name].build(), batch, axes, torch.device("cpu"), ParallelConfig())
        mine, theirs = dict(ours.graph_module.named_parameters()), dict(ref.graph_module.named_parameters())
        assert sorted(mine) == sorted(theirs)
        for n, p in mine.items():
            assert torch.equal(p, theirs[n]), (name, rank, n)
        kinds |= {type(plc).__name__ + ("-blocks" if getattr(plc, "blocks", None) else "")
                  for plc in ours.placements.values()}
    assert "Shard" in kinds and (name != "gpt2" or "Shard-blocks" in kinds), kinds
    assert sorted(asked) == sorted(list(ours.placements) * 2)     # materialisation read each through the hook


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_a_folder_in_its_checkpoint_layout_reads_as_from_pretrained_loads_it(tmp_path, name):
    """save_pretrained writes these families' experts as one tensor per expert and projection
    (Mixtral's block_sparse_moe.experts.{e}.w1, ...); the trainer's lazy state renames and stacks
    them through transformers' own conversion: every tensor equals from_pretrained's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    d = _saved(tmp_path, name)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    ref = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, torch_dtype=torch.float32).state_dict()
    assert not set(ref) <= on_disk            # the folder is not in the model's own layout
    src = load_model("hf", d, {}, torch.float32)
    assert sorted(src.state_dict) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(src.state_dict[k], v), k


def test_hf_folder_sharded_tied_and_buffers(tmp_path):
    model = FAMILIES["gemma"].build()           # tied head, a non-persistent embed_scale, rotary buffers
    d = str(tmp_path / "gemma")
    model.save_pretrained(d, max_shard_size="20KB")
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    src = load_model("hf", d, {}, torch.bfloat16)
    assert src.batch_kind == "hf" and src.vocab_size == 128 and src.max_positions == 64
    json.dumps(src.describe)
    assert src.describe["kind"] == "hf" and src.describe["dtype"] == "bfloat16"
    ref = model.state_dict()
    assert sorted(src.state_dict) == sorted(ref)
    for k, v in ref.items():
        assert src.state_dict[k].dtype == torch.bfloat16 and torch.equal(src.state_dict[k], v.bfloat16()), k
    bufs = dict(model.named_buffers())
    for k, b in src.model.named_buffers():
        assert not b.is_meta and torch.equal(b, bufs[k].to(b.dtype)), k
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in src.model.parameters())


def test_hf_folder_errors(tmp_path):
    d = _saved(tmp_path, "llama")
    with pytest.raises(ConfigError, match="not fields of LlamaConfig"):
        load_model("hf", d, {"no_such_field": 1}, torch.float32)
    weights = os.path.join(d, "model.safetensors")
    from safetensors.torch import load_file
    sd = load_file(weights)
    sd["extra.weight"] = torch.zeros(2)
    save_file(sd, weights)
    with pytest.raises(ConfigError, match=r"tensor 'extra\.weight' is not a parameter or buffer"):
        load_model("hf", d, {}, torch.float32)
    del sd["extra.weight"], sd["model.norm.weight"]
    save_file(sd, weights)
    with pytest.raises(ConfigError, match=r"no tensor 'model\.norm\.weight'"):
        load_model("hf", d, {}, torch.float32)
    sd["model.norm.weight"] = torch.ones(3)
    save_file(sd, weights)
    with pytest.raises(ConfigError, match=r"'model\.norm\.weight' has shape \[3\]"):
        load_model("hf", d, {}, torch.float32)
    os.remove(weights)
    with pytest.raises(ConfigError, match="no model.safetensors"):
        load_model("hf", d, {}, torch.float32)
    with pytest.raises(ConfigError, match="config.json"):
        load_model("hf", str(tmp_path), {}, torch.float32)
    with pytest.raises(ConfigError, match="model kind 'llama'"):
        load_model("llama", d, {}, torch.float32)


def test_gpt_is_meta_and_initialised_like_gpt():
    """parallelize initialises a meta model's shards with materialize.init_shard: the bundled
    GPT's own initialisation in distribution (N(0, 0.02) matrices, zero biases, unit LayerNorm
    weights), not in values (those are keyed by seed, name and row chunk, for every layout)."""
    opts = {"vocab_size": 96, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64}
    src = load_model("gpt", None, opts, torch.float32)
    assert src.state_dict is None and src.batch_kind == "xy" and (src.vocab_size, src.max_positions) == (96, 32)
    assert all(p.is_meta for p in src.model.parameters())
    assert src.model.lm_head.weight is src.model.wte.weight
    torch.manual_seed(0)
    eager = dict(GPT(GPTConfig(**opts)).named_parameters())
    for name, p in src.model.named_parameters():
        ours, theirs = init_shard(name, p.shape, p.dtype, R, 0, 1), eager[name]
        if p.dim() == 1:
            assert torch.equal(ours, theirs), name      # zeros or ones, both
        else:
            assert abs(ours.std().item() - 0.02) < 0.003 and abs(theirs.std().item() - 0.02) < 0.003, name
            assert not torch.equal(ours, theirs)
    with pytest.raises(ConfigError, match=r"unknown GPT option\(s\) \['n_embed'\]"):
        load_model("gpt", None, {"n_embed": 64}, torch.float32)


FACTORY = '''
import torch
from fxmegatron.models.gpt import GPT, GPTConfig

def xy(n_layer=1):
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=n_layer, n_head=2, n_embd=16))
    x = torch.zeros(2, 8, dtype=torch.long)
    return model, (x, x)

def bare():
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
'''


def test_factory(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY)
    src = load_model("factory", f"{path}:xy", {"n_layer": 2}, torch.bfloat16)
    assert src.batch_kind == "xy" and src.vocab_size == 64 and len(src.model.blocks) == 2
    assert src.example_batch is not None and src.state_dict is None
    assert all(p.dtype == torch.bfloat16 for p in src.model.parameters())
    assert src.describe == {"kind": "factory", "factory": f"{path}:xy", "options": {"n_layer": 2},
                            "dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="cannot tell the batch form"):
        load_model("factory", f"{path}:bare", {}, torch.float32)
    with pytest.raises(ConfigError, match="expected FILE.py:FUNCTION"):
        load_model("factory", str(path), {}, torch.float32)
    with pytest.raises(ConfigError, match="no_such"):
        load_model("factory", f"{path}:no_such", {}, torch.float32)
