"""benchmarks/end_to_end.py on CPU (gloo, 1 or 2 processes): its --check trains the plain model
and compares every layout's first two losses and first gradient norm with it (1e-4
relative), exiting non-zero otherwise: PyTorch-native DTensor TP and fxmegatron tp2+sp
must both be exact, so the GPU table compares equal programs; compile=True at tp2, dp2 and
pp2 as well; the same for an unmodified Hugging Face Llama (its own loss, labels = ids),
eager, torch.compile, fxmegatron, and native TP with torchtitan's plan on HF's names. Every
row trains with the run's optimizer (--optimizer, FusedAdamW by default), and the model and
optimizer phases are timed apart. The FLOPs formula reproduces the old GPT closed form. Each
row counts its own torch.compile graphs (tests/test_end_to_end_compile_stats.py: the rest)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "end_to_end.py")
SMOKE = ["--device", "cpu", "--dtype", "float32", "--check", "--no-profile"]


def _env(**extra):
    # without the Triton interpreter (conftest turns it on for the fuse tests on CPU): under it,
    # FusedAdamW's and the cross-entropy kernels run element by element, seconds a step; their torch
    # paths on CPU compute the same (fxmegatron.codegen.where_kernels_run)
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("TRITON_INTERPRET", None)
    return env


def one_process(args, timeout=300):
    env = _env(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "examples")]))
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def two_processes(args, timeout=600):
    env = _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def passed(out, rows):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "check: passed" in out.stdout
    assert out.stdout.count(" ok") >= rows, out.stdout[-2000:]


def test_benchmark_layouts_match_the_plain_model():
    # -fadam: still accepted, a no-op (every row uses --optimizer's FusedAdamW); one compiled
    # row (inductor on CPU is most of this test's time), the dp and pp builders eager
    out = two_processes(["--tiny", *SMOKE, "--steps", "1", "--warmup", "1", "--layers", "2", "--layouts",
                         "native-tp2,fx-tp2,fx-tp2-compile-fadam,fx-dp2,fx-dp2-zero1,fx-pp2-v1-1f1b"])
    passed(out, 6)
    assert "fx-dp2-zero1: fxmegatron dp_shard=optimizer" in out.stdout, out.stdout[:3000]


def test_rounds_alternate_the_order_and_pool_the_steps(tmp_path):
    """--rounds 2: round 1 runs the layouts in the given order, round 2 backwards; a row's
    step time is the median of all its rounds' timed steps, and each round's median is kept.
    Every row, the eager baseline too, trains with FusedAdamW (--optimizer's default), and
    its model and optimizer phases, timed apart, fit in the step."""
    path = tmp_path / "rows.json"
    out = one_process(["--tiny", *SMOKE, "--steps", "2", "--warmup", "1", "--layers", "2",
                       "--layouts", "eager,fx", "--rounds", "2", "--json", str(path)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    order = [line.split("]")[1].split(":")[0].strip() for line in out.stdout.splitlines() if line.startswith("[round")]
    assert order == ["eager", "fx", "fx", "eager"], order
    data = json.load(open(path))
    assert data["optimizer"] == "FusedAdamW" and data["args"]["optimizer"] == "fused"
    rows = {r["layout"]: r for r in data["rows"]}
    for r in rows.values():
        steps = r["step_ms_all"]
        assert len(steps) == 4 and len(r["step_ms_rounds"]) == 2
        assert r["step_ms"] == sorted(steps)[2]
        assert abs(r["tokens_per_s"] - 16 * 64 / (r["step_ms"] / 1e3)) < 1e-6 * r["tokens_per_s"]
        assert r["check"]["ok"]
        assert r["optimizer"] == "FusedAdamW"
        assert len(r["model_ms_all"]) == len(r["optim_ms_all"]) == 4
        assert r["model_ms"] == sorted(r["model_ms_all"])[2] and r["optim_ms"] == sorted(r["optim_ms_all"])[2]
        assert r["model_ms"] > 0 and r["optim_ms"] > 0
        assert r["model_ms"] + r["optim_ms"] <= 1.1 * r["step_ms"] + 1.0, r


def test_interleave_alternates_the_layouts_step_by_step_and_pairs_their_times(tmp_path):
    """--interleave: both layouts built first, then one timed step of each per pass, every other
    pass reversed (eager fx, fx eager, eager fx); each row's ``paired`` is the median over the
    passes of eager's step time over its own, and no row claims a peak memory of its own."""
    path = tmp_path / "rows.json"
    out = one_process(["--tiny", *SMOKE, "--steps", "3", "--warmup", "1", "--layers", "2",
                       "--layouts", "eager,fx", "--interleave", "--json", str(path)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["layout"]: r for r in json.load(open(path))["rows"]}
    started = sorted((t, name) for name, r in rows.items() for t in r["step_starts_s"])
    assert [name for _, name in started] == ["eager", "fx", "fx", "eager", "eager", "fx"], started
    ratios = sorted(a / b for a, b in zip(rows["eager"]["step_ms_in_order"], rows["fx"]["step_ms_in_order"]))
    assert rows["fx"]["paired"][0] == ratios[1] and rows["fx"]["paired_with"] == "eager"
    assert sorted(rows["fx"]["step_ms_in_order"]) == rows["fx"]["step_ms_all"]
    assert all(r["check"]["ok"] and r["peak_gib"] is None for r in rows.values())
    assert "fx: paired with eager step by step" in out.stdout
    refused = one_process(["--tiny", *SMOKE, "--layouts", "eager,fx", "--interleave", "--rounds", "2"])
    assert refused.returncode == 2 and "--interleave alternates the layouts" in refused.stderr


def test_master_optimizer_for_every_row_and_fadam_refused(tmp_path):
    """--optimizer master: every row MasterWeightAdamW (after torch-style clipping), still equal to
    the plain model; an -fadam layout then contradicts the run and is refused."""
    path = tmp_path / "rows.json"
    out = one_process(["--tiny", *SMOKE, "--steps", "1", "--warmup", "1", "--layers", "2", "--optimizer", "master",
                       "--layouts", "eager,fx", "--json", str(path)])
    passed(out, 2)
    assert {r["optimizer"] for r in json.load(open(path))["rows"]} == {"MasterWeightAdamW"}
    out = one_process(["--tiny", *SMOKE, "--optimizer", "master", "--layouts", "eager,fx-fadam"])
    assert out.returncode == 2 and "drop -fadam" in out.stderr, out.stderr


def test_hf_llama_eager_compile_fx_match_the_plain_model(tmp_path):
    """An unmodified HF Llama (tied, GQA, SwiGLU) trained with its own loss: eager, torch.compile
    of the whole model, each decoder layer compiled (torchtitan's habit) and fxmegatron give the
    plain model's losses and gradient norm."""
    path = tmp_path / "rows.json"
    out = one_process(["--model", "hf-llama1b", "--tiny", *SMOKE, "--steps", "1", "--warmup", "1", "--layers", "2",
                       "--layouts", "eager,compile,compile-layers,fx", "--json", str(path)])
    passed(out, 4)
    data = json.load(open(path))
    assert data["model"]["config"]["model_type"] == "llama" and data["model"]["tied"]
    assert {r["optimizer"] for r in data["rows"]} == {"FusedAdamW"}
    # each row its own counts: fx (uncompiled) runs after the compiled rows and reports none
    counts = {r["layout"]: (r["graph_breaks"], r["recompilations"], r["graphs_compiled"]) for r in data["rows"]}
    assert counts["eager"] == counts["fx"] == (0, 0, 0) and counts["compile"][2] >= 1, counts
    assert "compile: fx: 0 graph breaks, 0 recompilations, 0 graphs; SDPA: not profiled" in out.stdout


def test_without_check_the_fx_rows_start_from_the_hf_models_own_weights(tmp_path):
    """No --check: the fx rows still train from the weights the plain HF model was built with
    (HF GPT-2 scales its residual projections' initialisation, fxmegatron's own initialisation
    of a meta-device model does not), so every row's losses are the same numbers."""
    path = tmp_path / "rows.json"
    cfg = json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
                      "vocab_size": 96, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    out = one_process(["--hf-config", cfg, "--device", "cpu", "--dtype", "float32", "--no-profile", "--steps", "2",
                       "--warmup", "1", "--seq", "32", "--global-batch", "2", "--layouts", "eager,fx",
                       "--json", str(path)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["layout"]: r["losses"] for r in json.load(open(path))["rows"]}
    for a, b in zip(rows["fx"], rows["eager"]):
        assert abs(a - b) <= 1e-5 * abs(b), rows


def test_hf_llama_native_tp2_and_fx_tp2_match_the_plain_model():
    """torchtitan's Llama plan on HF's module names (sequence parallel, loss parallel over the
    model's own loss, the tied LM head tied again) and fxmegatron tp2+sp: both exact."""
    out = two_processes(["--model", "hf-llama1b", "--tiny", *SMOKE, "--steps", "1", "--warmup", "1",
                         "--layers", "2", "--layouts", "native-tp2,fx-tp2"])
    passed(out, 2)


def test_layout_names_give_the_compile_mode():
    """``-autotune``/``-cgraphs`` pick torch.compile's mode for the plain compile baseline and for
    fxmegatron alike (the side-by-side row needs both in the same mode); an eager layout takes
    neither."""
    from end_to_end import parse_layout
    assert parse_layout("compile", 8).compile is False
    assert parse_layout("compile-autotune", 8).compile == "max-autotune-no-cudagraphs"
    assert parse_layout("compile-cgraphs", 8).compile == "reduce-overhead"
    assert parse_layout("fx-compile-fadam-autotune", 8).compile == "max-autotune-no-cudagraphs"
    assert parse_layout("fx-compile", 8).compile is True
    with pytest.raises(ValueError, match="unknown part 'autotune' for a eager layout"):
        parse_layout("eager-autotune", 8)


def test_native_async_layout_turns_async_tp_on():
    """``native-tpN-async`` is torchtitan's async TP: the layout says so, the flag reaches only
    native rows, and the builder turns inductor's micro-pipeline pass on."""
    from end_to_end import parse_layout
    from e2e.builders import enable_async_tp
    lay = parse_layout("native-tp2-async", 8)
    assert lay.async_tp and lay.tp == 2 and "async TP" in lay.label
    assert not parse_layout("native-tp2", 8).async_tp
    with pytest.raises(ValueError, match="unknown part 'async' for a fx layout"):
        parse_layout("fx-tp2-async", 8)
    import types

    import torch._inductor.config as inductor_config
    before = inductor_config._micro_pipeline_tp
    try:
        enable_async_tp(types.SimpleNamespace(device_type="cpu"))
        assert inductor_config._micro_pipeline_tp is True
    finally:
        inductor_config._micro_pipeline_tp = before


def _spec(model, **over):
    import types

    from e2e.models import build_spec
    args = dict(model=model, hf_config="", tiny=False, layers=None, hidden=None, heads=None, seq=None, vocab=None,
                global_batch=None)
    args.update(over)
    return build_spec(types.SimpleNamespace(**args))


def test_model_flops_count_gqa_swiglu_and_the_tied_head():
    """F = 6·B·s·P + 12·B·l·s²·(heads·head_dim), P the matmuls' weights (the LM head counted even
    when tied): for GPT it is the old closed form; for the HF presets P is q (h·h), k and v
    (h·kv·d each), o (h·h), three SwiGLU matrices (h·ffn) a layer, and V·h."""
    from e2e.measure import gpt_flops
    for name in ("gpt1.3b", "gpt6.7b", "gpt13b"):
        s = _spec(name)
        old = gpt_flops(s.batch, s.seq, s.layers, s.hidden, s.vocab)
        assert abs(s.flops() - old) <= 1e-12 * old, name
    for name, tied in (("hf-llama1b", True), ("hf-qwen1.5b", True), ("hf-llama8b", False)):
        s = _spec(name)
        t = s.text
        h, d, l, ffn, V = t.hidden_size, s.head_dim, s.layers, t.intermediate_size, t.vocab_size
        P = l * (2 * h * h + 2 * h * t.num_key_value_heads * d + 3 * h * ffn) + V * h
        assert s.tied is tied and s.matmul_params() == P, name
        assert s.flops() == 6 * s.batch * s.seq * P + 12 * s.batch * l * s.seq ** 2 * t.num_attention_heads * d
    s = _spec("hf-llama1b")
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.vocab, s.seq, s.batch) == (16, 2048, 32, 8, 128256, 2048, 4)
    # Llama-3.2-1B has 1.236 G parameters (tied), Qwen2.5-1.5B 1.544 G
    assert abs(s.count_params() - 1.2358e9) < 1e6
    assert abs(_spec("hf-qwen1.5b").count_params() - 1.5437e9) < 1e6
    assert _spec("hf-llama8b", layers=32).count_params() == 8030261248


def test_moe_flops_count_the_experts_a_token_uses_and_ep_rows_match():
    """An MoE preset's P counts k of its E experts (Mixtral: 2 of 8 SwiGLU experts; its router, a
    parameter of transformers' router module and not an nn.Linear, is left out: 8·h a layer, under
    0.01%); the ep rows (fxmegatron ep=2 over dp2) and expert tp2 train as the plain model."""
    s = _spec("hf-mixtral")
    t = s.text
    h, d, l, ffn, V = t.hidden_size, s.head_dim, s.layers, t.intermediate_size, t.vocab_size
    P = l * (2 * h * h + 2 * h * t.num_key_value_heads * d + 2 * 3 * h * ffn) + V * h
    assert s.matmul_params() == P and s.active_expert_params() == l * 2 * 3 * h * ffn
    m = _spec("hf-moe64")
    assert m.active_expert_params() == m.layers * 8 * 3 * 2048 * 1408
    out = two_processes(["--model", "hf-moe64", "--tiny", *SMOKE, "--steps", "1", "--warmup", "1", "--layers", "2",
                         "--layouts", "fx-dp2-ep2,fx-tp2"])
    passed(out, 2)
    assert "fx-dp2-ep2: fxmegatron ep=2" in out.stdout, out.stdout[:3000]


def test_hf_batch_feeds_the_models_own_shifted_loss():
    """The HF batch is ``labels = input_ids`` and the model shifts them: the loss is the mean
    cross-entropy of position t's logits against token t + 1 (a double shift, or none, would pass
    --check unnoticed, since every layout and the reference share the batch)."""
    import torch
    import torch.nn.functional as F
    s = _spec("hf-llama1b", tiny=True, layers=2)
    batch = s.make_batch("cpu")
    ids = batch["input_ids"]
    assert ids.shape == (s.batch, s.seq) and torch.equal(batch["labels"], ids)
    model = s.plain("cpu", torch.float32)
    loss = s.loss(model, batch)
    logits = model(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, s.vocab), ids[:, 1:].reshape(-1))
    assert torch.allclose(loss, want, rtol=1e-6), (loss, want)


def test_torchao_layouts_give_the_recipe_and_compose_with_the_compile_mode():
    """compile-ao / compile-aorow: torchao float8 training (tensorwise / rowwise) + torch.compile,
    the FP8 baseline of fx-compile-fp8 / -fp8row, the recipe in ``fp8`` as for fxmegatron rows;
    -cgraphs / -autotune still pick the mode. -ao belongs to the compile head only."""
    from e2e.layouts import parse_layout
    ao, row, cg = parse_layout("compile-ao", 8), parse_layout("compile-aorow", 8), parse_layout("compile-ao-cgraphs", 8)
    assert (ao.kind, ao.fp8, ao.compile) == ("compile", "tensorwise", False)
    assert (row.kind, row.fp8, row.compile) == ("compile", "rowwise", False)
    assert (cg.kind, cg.fp8, cg.compile) == ("compile", "tensorwise", "reduce-overhead")
    assert parse_layout("compile-aorow-autotune", 8).compile == "max-autotune-no-cudagraphs"
    assert ao.label == "the plain model, torchao float8 tensorwise + torch.compile"
    assert row.label == "the plain model, torchao float8 rowwise + torch.compile"
    assert cg.label == "the plain model, torchao float8 tensorwise + torch.compile (reduce-overhead)"
    assert parse_layout("compile", 8).fp8 == "" and parse_layout("compile", 8).label == "the plain model, torch.compile"
    assert parse_layout("fx-compile-fp8row", 8).fp8 == "rowwise"
    for bad, part in (("compile-aox", "aox"), ("eager-ao", "ao"), ("fx-ao", "ao"), ("compile-fp8", "fp8")):
        with pytest.raises(ValueError, match=f"unknown part '{part}'"):
            parse_layout(bad, 8)


def test_torchao_layouts_refused_without_torchao_or_a_gpu(monkeypatch):
    """Without torchao a compile-ao row is refused in one line (nothing imports torchao until a
    row needs it); with torchao but on the CPU as well (torchao's float8 runs on CUDA only)."""
    import types

    from e2e.layouts import check_layout, parse_layout
    spec = types.SimpleNamespace(batch=16, layers=8)
    monkeypatch.setitem(sys.modules, "torchao", None)
    why = check_layout(parse_layout("compile-ao", 8), 1, spec)
    assert why.startswith("compile-ao needs torchao (pip install torchao==0.17.0): ") and "\n" not in why, why
    assert check_layout(parse_layout("compile-aorow-cgraphs", 8), 1, spec).startswith("compile-aorow-cgraphs needs")
    assert check_layout(parse_layout("compile", 8), 1, spec) is None
    fake = types.ModuleType("torchao")
    fake.float8 = types.ModuleType("torchao.float8")
    monkeypatch.setitem(sys.modules, "torchao", fake)
    monkeypatch.setitem(sys.modules, "torchao.float8", fake.float8)
    why = check_layout(parse_layout("compile-ao", 8), 1, spec, device="cpu")
    assert why == "compile-ao: torchao float8 training needs a CUDA GPU (sm_89+); this run is on the CPU", why


def test_per_layer_and_liger_layouts():
    """compile-layers: each decoder layer compiled, the rest eager; -liger adds Liger's kernels and
    needs -layers, an HF llama / qwen2 / mistral, liger-kernel and a GPU (each refused in one line)."""
    import types

    from e2e.layouts import check_layout, parse_layout
    lay, lig = parse_layout("compile-layers", 8), parse_layout("compile-layers-liger", 8)
    assert (lay.per_layer, lay.liger, lig.per_layer, lig.liger) == (True, False, True, True)
    assert lay.label == "the plain model, each decoder layer compiled"
    assert lig.label.endswith("Liger RMSNorm, SwiGLU and fused linear cross-entropy")
    assert parse_layout("compile-layers-ao", 8).fp8 == "tensorwise"
    with pytest.raises(ValueError, match="-liger goes with -layers"):
        parse_layout("compile-liger", 8)
    gpt = types.SimpleNamespace(batch=16, layers=8, model_type="gpt")
    assert "patches HF models of type llama, qwen2, mistral" in check_layout(lig, 1, gpt)
    assert check_layout(lay, 1, gpt) is None
    llama = types.SimpleNamespace(batch=16, layers=8, model_type="llama")
    why = check_layout(lig, 1, llama, device="cpu")
    assert why.startswith("compile-layers-liger needs liger-kernel") or "this run is on the CPU" in why, why


def test_liger_patches_the_instance_and_leaves_transformers_as_it_was(monkeypatch):
    """``apply_liger`` calls Liger's patch for the model's type on the instance; the classes and
    functions Liger swaps in transformers' modeling module (for models built later) are put back,
    so that the other rows of a run train transformers' own code. Liger is faked here (CPU)."""
    import types

    from transformers.models.llama import modeling_llama

    from e2e.builders import apply_liger
    seen = {}

    def fake_apply(rope, rms_norm, swiglu, fused_linear_cross_entropy, model):
        seen.update(rope=rope, rms=rms_norm, swiglu=swiglu, flce=fused_linear_cross_entropy, model=model)
        modeling_llama.apply_rotary_pos_emb = "liger rope"
        modeling_llama.LlamaRMSNorm = "LigerRMSNorm"
        model.patched = True
    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = fake_apply
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    before = dict(vars(modeling_llama))
    model = types.SimpleNamespace()
    apply_liger(model, "llama")
    assert seen == dict(rope=False, rms=True, swiglu=True, flce=True, model=model) and model.patched
    assert modeling_llama.apply_rotary_pos_emb is before["apply_rotary_pos_emb"]
    assert modeling_llama.LlamaRMSNorm is before["LlamaRMSNorm"]


def test_torchao_layout_refused_by_the_script_on_cpu():
    out = one_process(["--tiny", "--device", "cpu", "--layouts", "compile,compile-ao"], timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "compile-ao" in out.stderr and ("needs torchao" in out.stderr or "needs a CUDA GPU" in out.stderr)


def test_fp8_linear_filter_keeps_what_the_fxmegatron_pass_keeps():
    """The torchao rows' module filter mirrors fxmegatron's FP8 pass: the LM head (``lm_head``, or
    any linear tied to an embedding) and linears with an in or out feature count (or a token
    count) not a multiple of 16 stay in high precision; every other linear is selected."""
    import torch.nn as nn

    from e2e.builders import fp8_linear_filter

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(48, 32)
            self.block = nn.ModuleDict({"fc": nn.Linear(32, 128), "proj": nn.Linear(128, 32),
                                        "odd_in": nn.Linear(24, 32), "odd_out": nn.Linear(32, 40),
                                        "norm": nn.LayerNorm(32)})
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.tied_out = nn.Linear(32, 48, bias=False)
            self.tied_out.weight = self.wte.weight

    model = Tiny()
    keep = fp8_linear_filter(model)
    chosen = {fqn for fqn, mod in model.named_modules() if keep(mod, fqn)}
    assert chosen == {"block.fc", "block.proj"}, chosen
    assert fp8_linear_filter(model, tokens=16 * 64)(model.block.fc, "block.fc")
    assert not fp8_linear_filter(model, tokens=8 * 63)(model.block.fc, "block.fc")
    # the name alone marks the head, wherever it sits (HF: ``lm_head`` under the causal LM)
    assert not keep(nn.Linear(32, 64), "model.lm_head")


def test_inductor_config_sets_a_dotted_setting_and_names_an_unknown_one():
    """``--inductor-config KEY=VALUE`` sets torch._inductor.config before any layout compiles; a
    setting this torch lacks is refused by name (torch 2.11 lacks some of 2.13's)."""
    import torch._inductor.config as config
    from end_to_end import set_inductor_config
    with config.patch({"max_autotune_gemm": False}):
        assert set_inductor_config(["max_autotune_gemm=True"]) == []
        assert config.max_autotune_gemm is True
    (bad,) = set_inductor_config(["aten_distributed_optimizations.no_such_setting=1"])
    assert "has no setting 'aten_distributed_optimizations.no_such_setting'" in bad
    (bad,) = set_inductor_config(["max_autotune_gemm=yes please"])
    assert "not a Python literal" in bad


def test_an_aa_copy_and_hybrid_sharding_in_layout_names():
    """``-aN``: the same row under another name (an A/A pair in one --interleave run); ``-repN``:
    hybrid sharding, for fx only with a sharded mode, and a dp it divides."""
    import dataclasses

    from end_to_end import parse_layout
    from e2e.layouts import check_layout
    a, b = parse_layout("fx-compile", 8), parse_layout("fx-compile-a2", 8)
    assert dataclasses.replace(b, name=a.name) == a and b.name != a.name
    lay = parse_layout("fsdp2-dp4-rep2-compile", 8)
    assert lay.rep == 2 and "HSDP: 2 replicas of 2 shards" in lay.label
    spec = _spec("gpt1.3b", tiny=True)
    assert check_layout(parse_layout("fx-dp4-zero3-rep2", 8), 4, spec) is None
    assert "-rep2 (hybrid sharding)" in check_layout(parse_layout("fx-dp4-rep2", 8), 4, spec)
    assert "-rep3 (hybrid sharding)" in check_layout(parse_layout("fx-dp4-zero1-rep3", 8), 4, spec)

