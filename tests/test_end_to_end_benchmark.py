"""benchmarks/end_to_end.py on CPU (gloo, 2 processes): its --check trains the plain model
and compares every layout's first two losses and first gradient norm with it (1e-4
relative), exiting non-zero otherwise: PyTorch-native DTensor TP and fxmegatron tp2+sp
must both be exact, so the GPU table compares equal programs; compile=True at tp2 (with
fxmegatron's FusedAdamW, the clip folded in), dp2 and pp2 as well."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_layouts_match_the_plain_model():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "end_to_end.py"), "--tiny", "--device", "cpu", "--dtype", "float32",
           "--check", "--no-profile", "--steps", "1", "--warmup", "1", "--layers", "2",
           "--layouts", "native-tp2,fx-tp2,fx-tp2-compile-fadam,fx-dp2-compile,fx-pp2-v1-1f1b-compile"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "check: passed" in out.stdout
    assert out.stdout.count(" ok") >= 5, out.stdout[-2000:]


def test_rounds_alternate_the_order_and_pool_the_steps(tmp_path):
    """--rounds 2: round 1 runs the layouts in the given order, round 2 backwards; a row's
    step time is the median of all its rounds' timed steps, and each round's median is kept."""
    import json
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "examples")]))
    path = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "end_to_end.py"), "--tiny", "--device", "cpu",
           "--dtype", "float32", "--check", "--no-profile", "--steps", "2", "--warmup", "1", "--layers", "2",
           "--layouts", "eager,fx", "--rounds", "2", "--json", str(path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    order = [line.split("]")[1].split(":")[0].strip() for line in out.stdout.splitlines() if line.startswith("[round")]
    assert order == ["eager", "fx", "fx", "eager"], order
    rows = {r["layout"]: r for r in json.load(open(path))["rows"]}
    for r in rows.values():
        steps = r["step_ms_all"]
        assert len(steps) == 4 and len(r["step_ms_rounds"]) == 2
        assert r["step_ms"] == sorted(steps)[2]
        assert abs(r["tokens_per_s"] - 16 * 64 / (r["step_ms"] / 1e3)) < 1e-6 * r["tokens_per_s"]
        assert r["check"]["ok"]


def test_layout_names_give_the_compile_mode():
    """``-autotune``/``-cgraphs`` pick torch.compile's mode for the plain compile baseline and for
    fxmegatron alike (the side-by-side row needs both in the same mode); an eager layout takes
    neither."""
    import pytest
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from end_to_end import parse_layout
    finally:
        sys.path.pop(0)
    assert parse_layout("compile", 8).compile is False
    assert parse_layout("compile-autotune", 8).compile == "max-autotune-no-cudagraphs"
    assert parse_layout("compile-cgraphs", 8).compile == "reduce-overhead"
    assert parse_layout("fx-compile-fadam-autotune", 8).compile == "max-autotune-no-cudagraphs"
    assert parse_layout("fx-compile", 8).compile is True
    with pytest.raises(ValueError, match="unknown part 'autotune' for a eager layout"):
        parse_layout("eager-autotune", 8)
