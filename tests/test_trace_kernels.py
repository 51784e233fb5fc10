"""benchmarks/trace_kernels.py's clock check: the matmul and attention kernels two traces launch
alike (name, grid, count) tell whether the two steps ran at the same clocks."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import trace_kernels  # noqa: E402


def _trace(gemm_us, extra=()):
    ev = [{"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_NNT", "ts": 10 * i, "dur": gemm_us,
           "args": {"grid": [2, 66, 1]}} for i in range(4)]
    ev.append({"ph": "X", "cat": "kernel", "name": "cudnn_sdpa_fprop", "ts": 100, "dur": 2 * gemm_us,
               "args": {"grid": [132, 1, 1]}})
    ev.append({"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add", "ts": 200, "dur": 7,
               "args": {"grid": [64, 1, 1]}})
    return {"traceEvents": ev + list(extra)}


def test_same_kernels_at_other_clocks_give_their_time_ratio():
    slow, fast = _trace(12.0), _trace(10.0)
    ratio, n = trace_kernels.same_kernel_ratio(slow["traceEvents"], fast["traceEvents"])
    assert n == 2 and abs(ratio - 1.2) < 1e-9
    # a kernel only one trace launches, or launched a different number of times, is left out
    more = _trace(10.0, [{"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_TNT", "ts": 300, "dur": 500,
                          "args": {"grid": [2, 64, 1]}}])
    ratio, n = trace_kernels.same_kernel_ratio(more["traceEvents"], fast["traceEvents"])
    assert n == 2 and ratio == 1.0
    assert trace_kernels.same_kernel_ratio(fast["traceEvents"], {"traceEvents": []}["traceEvents"]) == (None, 0)


def test_against_prints_the_clock_warning(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_trace(12.0)))
    b.write_text(json.dumps(_trace(10.0)))
    script = os.path.join(ROOT, "benchmarks", "trace_kernels.py")
    out = subprocess.run([sys.executable, script, str(a), "--against", str(b)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ran 1.200x as long in A: the steps ran at different clocks" in out.stdout
    same = subprocess.run([sys.executable, script, str(b), "--against", str(b)], capture_output=True, text=True)
    assert "ran 1.000x as long in A" in same.stdout and "different clocks" not in same.stdout
