"""benchmarks/e2e/grad_check.py, ``end_to_end.py --check`` in bfloat16: every row's first
gradients against the plain model's in float32, no further off than the plain model's own bf16
step (times ``RATIO``, plus ``FLOOR``). fxmegatron and the plain model in eager pass on a tiny
HF Llama (tied, GQA) on the CPU; a row whose gradient of one weight is 2% off fails, named. At
world 2 (gloo) tp2, pp2 and dp2 rows pass, and a pipeline rank's gradient 2% off, held by that rank
alone, fails the row on every rank and is named by the lead."""
import contextlib
import functools
import io
import os
import sys

import torch

from .distributed import run_distributed
from .test_end_to_end_benchmark import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from e2e import grad_check  # noqa: E402
from e2e.builders import BUILDERS  # noqa: E402
from e2e.layouts import parse_layout  # noqa: E402
from e2e.models import build_spec  # noqa: E402


def _spec():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import end_to_end
    return build_spec(end_to_end.parse_args(["--model", "hf-llama1b", "--tiny", "--layers", "2",
                                             "--dtype", "bfloat16"]))


def _build(spec, batch, skew=None, meshes=lambda **_: None):
    def build(lay, state):
        job = BUILDERS[lay.kind](lay, spec, torch.device("cpu"), torch.bfloat16, batch, meshes=meshes,
                                 ref_state=state if lay.kind == "fx" else None)
        if skew is None:
            return job
        inner = job.fwd_bwd

        def fwd_bwd():      # the planted bug: one weight's gradient 2% too large
            loss = inner()
            grads = dict(job.keep[0].named_parameters())
            if skew in grads:   # at pp, only the rank whose stage holds the weight
                grads[skew].grad.mul_(1.02)
            return loss
        job.fwd_bwd = fwd_bwd
        return job
    return build


def test_fx_and_the_plain_model_pass_and_a_gradient_two_percent_off_fails(capsys):
    spec = _spec()
    batch = spec.make_batch(torch.device("cpu"))
    rows = [parse_layout(n, 1) for n in ("fx", "eager")]
    failed, state = grad_check.check_bf16(rows, _build(spec, batch), spec, torch.device("cpu"), batch, True)
    out = capsys.readouterr().out
    assert not failed and out.count(" ok") == 2 and "check (bf16): passed" in out, out
    assert set(state) >= {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"}
    weight = "model.layers.1.mlp.down_proj.weight"
    failed, _ = grad_check.check_bf16(rows[1:], _build(spec, batch, skew=weight), spec, torch.device("cpu"),
                                      batch, True)
    out = capsys.readouterr().out
    assert failed and f"worst gradient {weight}" in out and "FAILED" in out, out


def test_compare_names_a_missing_gradient_and_an_off_loss():
    g32 = {"a": torch.ones(4), "b": torch.ones(4)}
    ref = ({}, 2.0, g32, 2.001, {k: v * 1.001 for k, v in g32.items()})
    assert grad_check.compare(2.001, {k: v * 1.001 for k, v in g32.items()}, ref)["ok"]
    r = grad_check.compare(2.001, {"a": g32["a"]}, ref)
    assert not r["ok"] and r["missing"] == ["b"]
    assert not grad_check.compare(2.05, dict(g32), ref)["ok"]


def _check_at_world(rank, world, names, skew):
    from fxmegatron.runtime.distributed import Env, make_mesh
    env = Env(rank=rank, world=world, local_rank=rank, local_world=world, launched=True,
              device=torch.device("cpu"), backend="gloo")
    meshes = functools.lru_cache(maxsize=None)(lambda **sizes: make_mesh(env, **sizes))
    spec = _spec()
    batch = spec.make_batch(torch.device("cpu"))
    rows = [parse_layout(n, world) for n in names]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        failed, _ = grad_check.check_bf16(rows, _build(spec, batch, skew, meshes), spec, torch.device("cpu"),
                                          batch, rank == 0)
    return failed, out.getvalue()


def test_at_world_two_every_rank_s_gradients_are_checked():
    names = ("fx-tp2", "fx-pp2", "fx-dp2")
    results = run_distributed(_check_at_world, 2, names, None)
    (failed, out), (failed1, _) = results
    assert not failed and not failed1 and "check (bf16): passed" in out, out
    assert all(f"  {n} " in out and "no gradient for" not in out for n in names), out
    assert out.count(" ok") == 3, out
    # layer 1 of 2 is on the second pipeline stage: its gradient is on rank 1 alone
    weight = "model.layers.1.mlp.down_proj.weight"
    results = run_distributed(_check_at_world, 2, ("fx-pp2",), weight)
    (failed, out), (failed1, _) = results
    assert failed and failed1 and f"worst gradient {weight}" in out and "FAILED" in out, out
