"""e2e/compile_stats.py and the SDPA backend of benchmarks/end_to_end.py's rows: each row reports
the torch.compile graph breaks (with their reasons), recompilations and graphs of its own build
and steps, though the rows share one process and its dynamo counters, and the SDPA backend its
profiled step's op and kernel names show. In process, on a one-rank gloo group."""
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from e2e.builders import torch_job
from e2e.compile_stats import REASON_CHARS, CompileStats, describe, short_reason
from e2e.interleave import run_interleaved
from e2e.layouts import parse_layout
from e2e.measure import run_guarded
from e2e.profiling import sdpa_backend


def test_compile_stats_count_a_graph_break_and_a_recompilation():
    """The counters' differences over the spans entered: a planted graph break counted once with
    its reason, the graphs before and after it, a recompilation on a new rank; nothing for a span
    that only runs what is compiled already, or no compiled code."""
    @torch.compile(backend="eager")
    def broken(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()

    first, again, other, plain = CompileStats(), CompileStats(), CompileStats(), CompileStats()
    with first:
        broken(torch.randn(3))
    with again:
        broken(torch.randn(3))
    with other:
        broken(torch.randn(3, 2))
    with plain:
        torch.randn(3).sin()
    f = first.fields()
    assert (f["graph_breaks"], f["recompilations"], f["graphs_compiled"]) == (1, 0, 2), f
    assert len(f["graph_break_reasons"]) == 1 and "graph_break()" in f["graph_break_reasons"][0], f
    assert again.fields() == plain.fields() == {"graph_breaks": 0, "graph_break_reasons": [], "recompilations": 0,
                                                "graphs_compiled": 0}
    o = other.fields()
    assert o["recompilations"] >= 1 and o["graph_breaks"] == 1, o
    assert len(short_reason("x" * 200 + "\nhint")) == REASON_CHARS and short_reason("\n a\n b") == "a"
    line = describe(dict(f, layout="row", sdpa_backend="cudnn"))
    assert line.startswith("compile: row: 1 graph breaks, 0 recompilations, 2 graphs; SDPA: cudnn; breaks: ")


def test_sdpa_backend_from_op_and_kernel_names():
    """The SDPA backend named from the profile's aten ops (CPU side) and GPU kernels."""
    assert sdpa_backend(["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::mm"]) == "cpu-flash"
    assert sdpa_backend(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]) == "cudnn"
    assert sdpa_backend(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>",
                         "aten::_scaled_dot_product_cudnn_attention_backward"]) == "cudnn+flash"
    assert sdpa_backend(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "efficient"
    assert sdpa_backend(["aten::_scaled_dot_product_attention_math", "aten::bmm"]) == "math"
    assert sdpa_backend(["fxmegatron::attention", "aten::matmul"]) == "math"
    assert sdpa_backend(["aten::mm", "triton_poi_fused_add_0"]) == "none seen"


def _planted_rows(interleave):
    """Two rows in one process: "compile" a compiled attention with a graph break, whose input
    changes shape after the warm-up (a recompilation in the timed steps); "eager" the same
    function uncompiled, run after it (or step by step beside it)."""
    def attend(x):
        y = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        torch._dynamo.graph_break()
        return (y * y).mean()

    def builder(fn):
        def build(lay, spec, dev, dtype, batch, meshes=None, ref_state=None):
            w, calls = torch.nn.Parameter(torch.randn(2, 8, 16)), []

            def fwd_bwd():
                calls.append(1)
                loss = fn(w[None, :, :8 if len(calls) == 1 else 4])
                loss.backward()
                return loss.detach()
            return torch_job([w], fwd_bwd, [w])
        return build

    builders = {"compile": builder(torch.compile(attend, backend="eager")), "eager": builder(attend)}
    args = types.SimpleNamespace(optimizer="master", lr=1e-4, warmup=1, steps=2, no_profile=False, profile_dir="",
                                 hang_dump=0)
    spec = types.SimpleNamespace(flops=lambda: 1e6, batch=1, seq=8)
    layouts = [parse_layout("compile", 8), parse_layout("eager", 8)]
    dev = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if interleave:
            rows = run_interleaved(layouts, spec, args, dev, torch.float32, None, None, lambda lay: None, None,
                                   builders=builders)
        else:
            rows = [run_guarded(lay, spec, args, dev, torch.float32, None, None, None, None, builders=builders)
                    for lay in layouts]
    finally:
        dist.destroy_process_group()
    return {r["layout"]: r for r in rows}


@pytest.mark.parametrize("interleave", [False, True])
def test_each_row_reports_its_own_graph_breaks_recompilations_and_sdpa_backend(interleave):
    """A row with a planted graph break reports it (with its reason) and the recompilation of its
    timed steps; the uncompiled row run after it, or alternated with it step by step, reports
    none. The profiled step names CPU flash attention; --interleave profiles nothing."""
    rows = _planted_rows(interleave)
    planted, plain = rows["compile"], rows["eager"]
    assert "error" not in planted and "error" not in plain, rows
    # two frames, the function and its resume after the break, each compiled for 8 positions in the
    # warm-up and again for 4 in the first timed step; each trace of the function meets the break
    assert (planted["graph_breaks"], planted["recompilations"], planted["graphs_compiled"]) == (2, 2, 4), planted
    assert any("graph_break()" in r for r in planted["graph_break_reasons"]), planted["graph_break_reasons"]
    assert (plain["graph_breaks"], plain["recompilations"], plain["graphs_compiled"]) == (0, 0, 0), plain
    want = "not profiled" if interleave else "cpu-flash"
    assert planted["sdpa_backend"] == plain["sdpa_backend"] == want
