"""`fxmegatron compile` writes each rank's stage modules as Python source and safetensors
weights; `torchrun -m fxmegatron.launch FOLDER` trains from them and reproduces the losses of
parallelize() in-process (4 gloo processes)."""
import json
import os
import subprocess
import sys

import pytest

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


def test_launch_refuses_a_layout_it_was_not_compiled_for(folder):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "fxmegatron.launch", folder, "--steps", "1", "--device", "cpu"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "!= 2 processes" in r.stderr + r.stdout
