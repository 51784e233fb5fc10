"""benchmarks/context_parallel.py on CPU: its --smoke (gloo, two processes it spawns itself, a
tiny Llama, float32) prints a row per layout, numbers for the fxmegatron rows, "needs CUDA" for
PyTorch's context parallelism, and its --check passes: every fx row trains the plain model's
losses. The cp rows must also agree with the tp2 row, so a benchmark whose context-parallel
rows train something else fails here, not on the GPUs. The torch-cp row's own feeding of the
HF model (the cut buffers, shifted labels, global positions, the global token count, the
summed gradients) is checked on CPU by routing the CPU SDPA kernel through torch's own ring
code: the GPUs would otherwise be the first to run it. And the FLOPs: causal attention counts
half of end_to_end.py's attention term; exposed communication counts the ring's P2P too."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "context_parallel.py")
LAYOUTS = ["fx-cp2-ring", "fx-cp2-allgather", "fx-tp2-sp-full", "torch-cp"]


def test_smoke_prints_every_layout_and_the_cp_rows_train_what_tp2_trains(tmp_path):
    path = tmp_path / "cp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)   # FusedAdamW's torch path on CPU, not the interpreted kernel
    out = subprocess.run([sys.executable, SCRIPT, "--smoke", "--json", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "check: passed" in out.stdout and "6·B·l·s²·a·d" in out.stdout
    table = out.stdout.split("s=64, B=1:")[1].split("check against")[0]
    lines = {line.split()[0]: line for line in table.splitlines() if line.split() and line.split()[0] in LAYOUTS}
    assert set(lines) == set(LAYOUTS), table
    for name in LAYOUTS[:3]:
        step, model_ms, optim_ms, tokens, tflops = (float(x) for x in lines[name].split()[1:6])
        assert step > 0 and tokens > 0 and model_ms > 0 and optim_ms > 0, lines[name]
    assert "needs CUDA" in lines["torch-cp"]

    data = json.load(open(path))
    rows = {r["layout"]: r for r in data["rows"]}
    tp = rows["fx-tp2-sp-full"]["losses"][0]
    for name in ("fx-cp2-ring", "fx-cp2-allgather"):
        assert rows[name]["losses"][0] == pytest.approx(tp, rel=1e-4), (name, rows[name]["losses"], tp)
        assert rows[name]["layout_spec"]["attention"] == name.rsplit("-", 1)[1]
    assert all(rows[n]["check"]["ok"] and rows[n]["optimizer"] == "FusedAdamW" for n in LAYOUTS[:3])
    assert rows["torch-cp"]["skipped"]
    cfg, s = data["config"], 64
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    want = 6 * s * data["matmul_params"] + 6 * cfg["num_hidden_layers"] * s * s * cfg["num_attention_heads"] * d
    assert rows["fx-cp2-ring"]["flops_per_step"] == want


def test_layout_names_and_refusals():
    from context_parallel import check_layout, make_spec, parse_args, parse_layout
    lay = parse_layout("fx-cp2-ring", "selective", 2)
    assert (lay.kind, lay.cp, lay.tp, lay.attention, lay.recompute) == ("fx", 2, 1, "ring", "selective")
    lay = parse_layout("fx-tp2-sp-full", "selective", 2)
    assert (lay.tp, lay.sp, lay.recompute) == (2, True, "full")
    lay = parse_layout("fx-cp2-ring-compile-zero1", "none", 2)
    assert (lay.compile, lay.dp_shard) == (True, "optimizer") and "optimizer sharded" in lay.label
    lay = parse_layout("fx-cp2-ring-compile-zero3", "none", 2)
    assert lay.dp_shard == "full" and "fully sharded" in lay.label
    lay = parse_layout("torch-cp-alltoall-compile", "none", 2)
    assert (lay.kind, lay.cp, lay.attention, lay.compile) == ("torch", 2, "alltoall", True)
    for bad in ("fx-cp2-tp2", "fx-ring", "torch-cp-ring", "native-tp2"):
        with pytest.raises(ValueError):
            parse_layout(bad, "none", 2)
    spec = make_spec(parse_args(["--smoke"]), 66)
    cp2 = parse_layout("fx-cp2-ring", "none", 2)
    assert "2·cp = 4 must divide the sequence length 66" in check_layout(cp2, 2, spec)
    assert "needs 2 processes" in check_layout(cp2, 4, make_spec(parse_args([]), 64))


def test_flops_count_half_of_the_causal_scores():
    from context_parallel import make_spec, parse_args
    spec = make_spec(parse_args(["--seq", "131072"]), 131072)
    t, s = spec.text, spec.seq
    assert (spec.layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size,
            t.vocab_size, t.rope_parameters["rope_theta"], spec.batch) == (4, 4096, 32, 8, 14336, 128256, 500000.0, 1)
    full = super(type(spec), spec).flops()          # end_to_end.py's count: 12·B·l·s²·a·d
    attention = 12 * 4 * s * s * 32 * 128
    assert spec.flops() == full - attention / 2


# ---- torch-cp's feeding of the model, on CPU ---------------------------------------------------
def _torch_cp_on_cpu(rank, world, layouts):
    """One forward + backward of the torch-cp row (the benchmark's own builder) on gloo, with the
    CPU flash-attention kernel handed to torch's own ring attention (``_templated_ring_attention``:
    what its CUDA kernels go through); returns (loss, the plain model's loss, worst relative
    gradient error) for each of ``layouts``. Wrong positions, labels, token count or gradient sum
    show here."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attn

    import context_parallel as bench
    aten = torch.ops.aten

    def wrap(t, mesh):
        return DTensor.from_local(t, mesh, [Shard(2)], run_check=False)

    def forward(op, args, kwargs):
        q, k, v = args[:3]
        out, lse = cp_attn._templated_ring_attention(
            q.device_mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu.default,
            query=q.to_local(), key=k.to_local(), value=v.to_local(), is_causal=args[4] if len(args) > 4
            else kwargs.get("is_causal", False), dropout_p=0.0, scale=kwargs.get("scale"))[:2]
        return wrap(out, q.device_mesh), wrap(lse, q.device_mesh)

    def backward(op, args, kwargs):
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        a = {**dict(zip(names, args)), **kwargs}
        mesh = a["query"].device_mesh
        a = {n: x.to_local() if isinstance(x, DTensor) else x for n, x in a.items()}
        grads = cp_attn._templated_ring_attention_backward(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out_name="grad_out", **a)[:3]
        return tuple(wrap(g, mesh) for g in grads)

    cp_attn.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    cp_attn.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward
    spec = bench.make_spec(bench.parse_args(["--smoke"]), 64)
    batch = spec.make_batch("cpu")
    plain = spec.plain("cpu", torch.float32)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    ref = plain(**batch).loss
    ref.backward()
    meshes = functools.lru_cache(None)(
        lambda **s: init_device_mesh("cpu", tuple(s.values()), mesh_dim_names=tuple(s)))
    out = {}
    for layout in layouts:
        job = bench.build_torch_cp(bench.parse_layout(layout, "none", world), spec, torch.device("cpu"),
                                   torch.float32, batch, meshes, ref_state=state)
        loss = job.fwd_bwd()
        grads = {n.replace("_orig_mod.", ""): p.grad for n, p in job.keep[1].named_parameters()}
        err = max(((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in plain.named_parameters())
        out[layout] = (loss.item(), ref.item(), err)
    return out


def test_torch_cp_feeds_the_model_what_the_plain_model_sees():
    cp_attn = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
    if not hasattr(cp_attn, "_templated_ring_attention") or not hasattr(cp_attn, "custom_ops"):
        pytest.skip("this torch's context parallelism has no _templated_ring_attention / custom_ops to route through")
    for got in run_distributed(_torch_cp_on_cpu, 2, ["torch-cp", "torch-cp-alltoall", "torch-cp-hfloss"]):
        for layout, (loss, ref, err) in got.items():
            assert loss == pytest.approx(ref, rel=1e-5) and err < 1e-4, (layout, loss, ref, err)


def test_exposed_communication_counts_the_rings_p2p_and_collectives_once():
    """e2e.profiling's split: a collective and the ring's send/recv that overlap each other but no
    compute kernel are exposed communication once (end_to_end.py's columns keep them apart)."""
    from e2e.profiling import STEP_MARK, breakdown

    def ev(name, ts, dur, cat="kernel"):
        return {"name": name, "ph": "X", "cat": cat, "ts": ts, "dur": dur}
    got = breakdown([ev(STEP_MARK, 0, 20, "user_annotation"), ev("flash_fwd_kernel", 0, 10),
                     ev("ncclDevKernel_AllGather_RING_LL", 8, 4), ev("ncclDevKernel_SendRecv", 11, 3)])
    assert (got["exposed_comm_ms"], got["bubble_ms"]) == (pytest.approx(2e-3), pytest.approx(3e-3))
    assert got["exposed_any_comm_ms"] == pytest.approx(4e-3) and got["idle_ms"] == pytest.approx(6e-3)
