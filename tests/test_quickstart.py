"""The README's "Use the API" snippet is examples/quickstart.py, verbatim, and runs as written on CPU
under torchrun (4 processes, pp2 x tp2): the loss falls and the held-out loss is printed."""
import os
import re
import subprocess

import pytest

from tests.trainer_runs import ROOT, TORCHRUN, env

SCRIPT = os.path.join(ROOT, "examples", "quickstart.py")


def test_readme_shows_the_file_verbatim():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(SCRIPT) as f:
        code = f.read()
    assert "```python\n" + code + "```" in readme, "README's Use snippet differs from examples/quickstart.py"


@pytest.mark.slow
def test_quickstart_runs_as_written(tmp_path):
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=4", SCRIPT], cwd=tmp_path, env=env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert r.returncode == 0, r.stdout
    steps = re.findall(r"step (\d): loss ([\d.]+), held-out ([\d.]+)", r.stdout)
    assert [int(s) for s, _, _ in steps] == list(range(5)), r.stdout
    assert float(steps[-1][1]) < float(steps[0][1]) - 0.2, steps
    assert os.path.exists(tmp_path / "dump" / "quickstart")
