"""`fxmegatron compile` writes each rank's stage modules as Python source and safetensors
weights; `torchrun -m fxmegatron.launch FOLDER` trains from them and reproduces the losses of
parallelize() in-process (4 gloo processes). A folder changed after it was written is refused
before any of its code runs or any weight is read."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from fxmegatron.errors import CompiledFolderError
from fxmegatron.io import stage_folder
from fxmegatron.placement import R

from tests.distributed import run_distributed
from tests.workers import inprocess_lm_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTORY = os.path.join(ROOT, "tests", "factories", "gpt_small.py") + ":build"


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return env


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("compiled") / "gpt_pp2_tp2")
    r = subprocess.run([sys.executable, "-m", "fxmegatron.cli", "compile", "--factory", FACTORY, "--pp", "2",
                        "--tp", "2", "--microbatches", "2", "--out", out], env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_folder_is_readable_source_without_model_code(folder):
    src = open(os.path.join(folder, "pp0-tp1", "stage.py")).read()
    assert "class Chunk0(torch.nn.Module)" in src and "def forward(self" in src
    assert "copy_to_tp" in src and "'@tp'" in src          # collectives by symbolic group
    assert "import gpt" not in src and "examples" not in src and "pickle" not in src
    man = json.load(open(os.path.join(folder, "manifest.json")))
    assert man["layout"] == {"pp": 2, "tp": 2} and len(man["chunks"]) == 2


def test_launch_reproduces_parallelize(folder, tmp_path):
    losses_file = str(tmp_path / "losses.json")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                        "-m", "fxmegatron.launch", folder, "--steps", "3", "--losses", losses_file, "--device", "cpu"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    launched = json.load(open(losses_file))
    inproc = run_distributed(inprocess_lm_losses, 4, (1, 2, 2), 3)[0]
    assert len(launched) == 3
    for a, b in zip(launched, inproc):
        assert abs(a - b) <= 1e-6 * abs(b), (launched, inproc)


def test_a_folder_weights_microbatches_by_their_counted_labels(tmp_path):
    """A microbatch with most labels ignored: the folder's step is parallelize's (each
    microbatch weighted by the labels it counts, the unmodified model's mean), not the mean of
    the microbatches' means (1/m, what a folder without the counter did)."""
    from tests.workers.launch import folder_against_parallelize
    ((loss, grads), (loss_f, grads_f)), has_counter = run_distributed(
        folder_against_parallelize, 1, str(tmp_path / "f"))[0]
    assert has_counter
    assert abs(loss_f - loss) <= 1e-6 * abs(loss), (loss_f, loss)
    for n, g in grads.items():
        assert (grads_f[n] - g).abs().max() <= 1e-6 * g.abs().max() + 1e-12, n


def test_a_folder_without_a_counter_is_refused_where_the_batch_is_split(folder, rank0_mesh):
    """A folder written before the counter (microbatches 2): refused at load, not weighted 1/m."""
    man = json.load(open(os.path.join(folder, "manifest.json")))
    assert man["count_ignore"] == -100
    man.pop("count_ignore")
    with pytest.raises(CompiledFolderError, match="no token counter"):
        stage_folder.load_folder(stage_folder.CheckedFolder(folder, man), rank0_mesh)


def test_launch_refuses_a_layout_it_was_not_compiled_for(folder):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "fxmegatron.launch", folder, "--steps", "1", "--device", "cpu"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "!= 2 processes" in r.stderr + r.stdout


# ---- a compiled folder is code: changed files are refused -------------------------------------
@pytest.fixture
def rank0_mesh():
    """Rank 0 of a pp=2 x tp=2 mesh in this process, on torch's fake process group (its
    collectives do nothing): enough for load_folder to execute rank 0's stage.py."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def copied(folder, tmp_path):
    return shutil.copytree(folder, str(tmp_path / "copy"))


@pytest.fixture
def no_weights_read(monkeypatch):
    """The paths load_folder opened as weights: none, when it refused the folder in time."""
    reads = []

    def refuse_to_read(path, *args, **kwargs):
        reads.append(path)
        raise AssertionError(f"read {path}")
    monkeypatch.setattr(stage_folder.load, "safe_open", refuse_to_read)      # where load_folder reads
    return reads


def _replace(path, old: bytes, new: bytes):
    """``old`` -> ``new`` where it first occurs; the test passes two that differ in one byte."""
    data = open(path, "rb").read()
    assert len(old) == len(new) and sum(a != b for a, b in zip(old, new)) == 1
    at = data.index(old)
    open(path, "wb").write(data[:at] + new + data[at + len(old):])


def _flip_last_byte(path):
    """The last byte of a safetensors file is tensor data: the header cannot notice."""
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))


def _refused(copied, mesh, name, *words):
    with pytest.raises(CompiledFolderError) as exc:
        stage_folder.load_folder(copied, mesh)
    for w in (name,) + words:
        assert w in str(exc.value), str(exc.value)


@pytest.mark.parametrize("rank_dir", ["pp0-tp0", "pp1-tp1"])   # the one rank 0 runs, and another's
def test_a_changed_stage_py_is_refused_before_it_runs(copied, rank0_mesh, no_weights_read, rank_dir):
    # executed, the changed file raises ModuleNotFoundError (torcx): a CompiledFolderError
    # instead shows the check came before its first line ran
    _replace(os.path.join(copied, rank_dir, "stage.py"), b"import torch\n", b"import torcx\n")
    _refused(copied, rank0_mesh, f"{rank_dir}/stage.py", "modified after the folder was written",
             "only run folders you trust")
    assert not no_weights_read


def test_a_changed_weights_byte_is_refused(copied, rank0_mesh, no_weights_read):
    _flip_last_byte(os.path.join(copied, "pp0-tp0", "weights.safetensors"))
    _refused(copied, rank0_mesh, "pp0-tp0/weights.safetensors", "modified after the folder was written")
    assert not no_weights_read


def test_a_missing_file_is_refused(copied, rank0_mesh, no_weights_read):
    os.remove(os.path.join(copied, "pp1-tp0", "weights.safetensors"))
    _refused(copied, rank0_mesh, "pp1-tp0/weights.safetensors", "missing")
    assert not no_weights_read


def test_an_added_py_file_is_refused(copied, rank0_mesh):
    open(os.path.join(copied, "pp0-tp0", "helpers.py"), "w").write("raise SystemExit('ran')\n")
    _refused(copied, rank0_mesh, "pp0-tp0/helpers.py", "not recorded")


def test_a_manifest_without_hashes_is_refused(copied, rank0_mesh):
    path = os.path.join(copied, "manifest.json")
    man = json.load(open(path))
    del man["files"]
    json.dump(man, open(path, "w"))
    _refused(copied, rank0_mesh, path, "recompile")


def test_an_untouched_folder_loads(folder, rank0_mesh):
    checked = stage_folder.check_folder(folder)
    assert sorted(checked.manifest["files"]) == [f"pp{p}-tp{t}/{f}" for p in (0, 1) for t in (0, 1)
                                                 for f in ("stage.py", "weights.safetensors")]
    pm = stage_folder.load_folder(folder, rank0_mesh)
    assert sum(p.numel() for p in pm.parameters()) > 0


def test_a_folder_with_tp_only_placements_loads_the_same(folder, copied, rank0_mesh):
    """Folders written before per-axis layouts list each parameter's tp ``placement``; they
    load with the same placements as today's ``layout``."""
    path = os.path.join(copied, "manifest.json")
    man = json.load(open(path))
    assert any(p["layout"] for p in man["params"]) and any(not p["layout"] for p in man["params"])
    for p in man["params"]:
        layout = p.pop("layout")
        assert set(layout) <= {"tp"}, layout
        p["placement"] = layout.get("tp", "R")
    json.dump(man, open(path, "w"))
    now, old = stage_folder.load_folder(folder, rank0_mesh), stage_folder.load_folder(copied, rank0_mesh)
    names = [n for n, _ in now.named_parameters()]
    assert names == [n for n, _ in old.named_parameters()]
    assert [now.placement(n) for n in names] == [old.placement(n) for n in names]
    assert any(now.placement(n) != R for n in names)


def test_launch_refuses_a_changed_folder_before_starting(copied):
    _flip_last_byte(os.path.join(copied, "pp1-tp1", "weights.safetensors"))
    r = subprocess.run([sys.executable, "-m", "fxmegatron.launch", copied, "--steps", "1", "--device", "cpu"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "CompiledFolderError" in r.stderr and "pp1-tp1/weights.safetensors" in r.stderr, r.stderr[-3000:]
    assert "modified after the folder was written" in r.stderr and "step" not in r.stdout
