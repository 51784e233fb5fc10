"""A checkpoint that is not what was saved never loads quietly: a digest per shard in index.json,
checked on load (a flipped bit, a truncated or garbled shard: one error naming the file), older
checkpoints without digests load with a warning, and a checkpoint of another model is refused
naming a parameter, before anything is loaded. One process, the bundled GPT."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from fxmegatron.errors import CheckpointError
from fxmegatron.io.checkpoint import load, read_full_state
from tests.workers.export import GPT_OPTIONS, gpt_batch, load_step_save


def parallel_gpt(**options):
    import fxmegatron
    from fxmegatron.train.models import load_model
    src = load_model("gpt", None, {**GPT_OPTIONS, **options}, torch.float32)
    return fxmegatron.parallelize(src.model, None, gpt_batch(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("integrity") / "ckpt")
    load_step_save(0, 1, None, "gpt", None, GPT_OPTIONS, ckpt)
    return ckpt


@pytest.fixture(scope="module")
def pm():
    return parallel_gpt()


def copy_of(saved, tmp_path):
    d = shutil.copytree(saved, str(tmp_path / "copy"))
    return d, os.path.join(d, "shard-pp0-tp0.safetensors")


def test_index_records_each_shards_digest(saved, pm):
    index = json.load(open(os.path.join(saved, "index.json")))
    assert sorted(index["digests"]) == index["files"] == ["shard-pp0-tp0.safetensors"]
    path = os.path.join(saved, index["files"][0])
    data = open(path, "rb").read()
    assert index["digests"][index["files"][0]] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert sorted(os.listdir(saved)) == ["index.json", "shard-pp0-tp0.safetensors"]
    load(pm, None, saved)


def test_a_flipped_bit_is_refused(saved, pm, tmp_path):
    d, shard = copy_of(saved, tmp_path)
    data = bytearray(open(shard, "rb").read())
    data[-5] ^= 0x10            # in the last tensor's bytes: safetensors itself cannot tell
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard}: sha256 .* index.json recorded .*changed after it was saved"):
        load(pm, None, d)
    with pytest.raises(CheckpointError, match=rf"{shard}: sha256"):
        read_full_state(d)


@pytest.mark.filterwarnings("ignore:.*has no shard digests")
@pytest.mark.parametrize("digests", [True, False], ids=["with-digests", "without"])
def test_a_truncated_or_garbled_shard_is_named(saved, pm, tmp_path, digests):
    d, shard = copy_of(saved, tmp_path)
    if not digests:
        _drop_digests(d)
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"^{shard}: .*(truncated|not a readable checkpoint shard)"):
        load(pm, None, d)
    open(shard, "wb").write(b"\x07" * len(data))
    with pytest.raises(CheckpointError, match=rf"^{shard}: "):
        load(pm, None, d)


def _drop_digests(d):
    path = os.path.join(d, "index.json")
    index = json.load(open(path))
    del index["digests"]
    json.dump(index, open(path, "w"))


def test_a_checkpoint_without_digests_loads_with_a_warning(saved, pm, tmp_path):
    d, _ = copy_of(saved, tmp_path)
    _drop_digests(d)
    with pytest.warns(UserWarning, match="has no shard digests .*load unverified"):
        load(pm, None, d)
    assert all(torch.equal(p, read_full_state(saved)[n]) for n, p in pm.named_parameters())


def test_a_garbled_index_is_named(saved, pm, tmp_path):
    d, _ = copy_of(saved, tmp_path)
    index = os.path.join(d, "index.json")
    open(index, "w").write(open(os.path.join(saved, "index.json")).read()[:50])
    with pytest.raises(CheckpointError, match=rf"^{index}: unreadable"):
        load(pm, None, d)


@pytest.mark.parametrize("options,message", [
    ({"n_layer": 1}, r"parameter 'blocks\.1\.\S+' that the model does not have \(\d+ such\)"),
    ({"n_layer": 3}, r"no parameter 'blocks\.2\.\S+' \(\d+ missing\)"),
    ({"vocab_size": 100}, r"'wte\.weight' of shape \[128, 64\], the model's is \[100, 64\]"),
], ids=["fewer-layers", "more-layers", "other-vocabulary"])
def test_a_checkpoint_of_another_model_is_refused(saved, options, message):
    other = parallel_gpt(**options)
    before = {n: p.clone() for n, p in other.named_parameters()}
    with pytest.raises(CheckpointError, match=rf"^{saved}: a checkpoint of another model: .*{message}"):
        load(other, None, saved)
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters()), "loaded part of it"
