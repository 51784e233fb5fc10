"""Placement rules on gloo: three AdamW steps of fxmegatron at tp=2 and 4 next to the
unmodified model, for the cases the rules once got wrong quietly or refused needlessly:

* an embedding with ``padding_idx`` (HF Llama with ``pad_token_id``; the pad id in every
  batch): the padding row's gradient stays zero;
* a column-then-row MLP whose matmuls are spelled six ways (``x @ W.T``, ``matmul``,
  ``F.linear``, ``addmm``, ``mm``, ``einsum``);
* fewer kv heads than tp (HF Llama's repeat_kv, and SDPA with ``enable_gqa=True``): k/v
  projections replicated, q, attention and the output projection split.

Losses match to 1e-5 (relative), every first-step gradient to 1e-4."""
import copy

import pytest
import torch

from tests.distributed import run_distributed
from tests.workers.common import side_by_side
from tests.test_tp_rules_models import SPELLINGS, GqaAttention, Mlp, llama, llama_batch


def build(case):
    """(model, batch(step), parallelize keywords) for a case."""
    kind, arg = case[:2]
    kw = {"sequence_parallel": True} if "sp" in case[2:] else {}
    if kind == "pad":
        return llama(pad=1), llama_batch, kw
    if kind == "llama_kv":
        return llama(kv=arg), llama_batch, kw
    if kind == "mlp":
        return Mlp(arg), lambda step: (torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step)),), kw
    if kind == "gqa":
        return (GqaAttention(arg),
                lambda step: (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(step)),), kw)
    raise ValueError(case)


def train_cases(rank, world, cases, steps=3):
    """For each case: both models' losses over ``steps`` AdamW steps, each parameter's
    first-step gradient error, the decision of each matmul / embedding (by module) and
    the placement of each parameter."""
    import fxmegatron
    from torch.distributed.device_mesh import init_device_mesh

    from fxmegatron.capture import module_path
    from fxmegatron.placement import placed

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for case in cases:
        model, batch, kw = build(case)
        ref = copy.deepcopy(model)
        pm = fxmegatron.parallelize(model, mesh, batch(0), **kw)
        r = side_by_side(pm, ref, batch, steps, lr=1e-2)
        gm = pm.graph_module
        out[case] = {**r,
                     "decisions": {module_path(n) or n.name: n.meta["tp_decision"].split(":")[0]
                                   for n in gm.graph.nodes if "tp_decision" in n.meta},
                     "params": {n.target: str(placed(n, "tp")) for n in gm.graph.nodes if n.op == "get_attr"}}
    return out


KV = [(2, 1), (2, 2), (4, 1), (4, 2)]      # (tp, kv heads) of an 8-head Llama
CASES = {2: [("pad", 1)] + [("mlp", s) for s in SPELLINGS] + [("llama_kv", 1), ("llama_kv", 2), ("gqa", 1)],
         4: [("llama_kv", 1), ("llama_kv", 2), ("gqa", 2), ("llama_kv", 1, "sp")]}


@pytest.fixture(scope="module")
def run_at():
    """tp -> every rank's results for CASES[tp] (one gloo run per tp, when first asked)."""
    done = {}

    def get(world):
        if world not in done:
            done[world] = run_distributed(train_cases, world, CASES[world])
        return done[world]
    return get


def _check(per_rank, world, case):
    for rank, res in enumerate(per_rank):
        r = res[case]
        for a, b in zip(r["losses"], r["losses_ref"]):
            assert abs(a - b) <= 1e-5 * abs(b), (case, world, rank, r["losses"], r["losses_ref"])
        bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
        assert not bad, f"{case} tp={world} rank {rank}: gradients differ: {bad}"
    return per_rank[0][case]


def test_padding_idx(run_at):
    r = _check(run_at(2), 2, ("pad", 1))
    assert r["decisions"]["model.embed_tokens"] == "vocab"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_matmul_spellings(run_at, spelling):
    r = _check(run_at(2), 2, ("mlp", spelling))
    assert sorted(r["decisions"].values()) == ["column", "row"], r["decisions"]
    assert r["params"]["w1"] == "S(0)" and r["params"]["w2"] == "S(1)", r["params"]


@pytest.mark.parametrize("world,kv,sp", [(w, kv, ()) for w, kv in KV] + [(4, 1, ("sp",))],
                         ids=[f"tp{w}-kv{kv}" for w, kv in KV] + ["tp4-kv1-sp"])
def test_kv_heads_fewer_than_tp(run_at, world, kv, sp):
    r = _check(run_at(world), world, ("llama_kv", kv) + sp)
    attn = "model.layers.0.self_attn"
    d = r["decisions"]
    assert d[f"{attn}.q_proj"] == "column" and d[f"{attn}.o_proj"] == "row", d
    expect = "column" if kv % world == 0 else "replicated"
    assert d[f"{attn}.k_proj"] == d[f"{attn}.v_proj"] == expect, d
    assert r["params"][f"{attn}.q_proj.weight"] == "S(0)" and r["params"][f"{attn}.o_proj.weight"] == "S(1)"


@pytest.mark.parametrize("world,kv", [(2, 1), (4, 2)], ids=["tp2-kv1", "tp4-kv2"])
def test_sdpa_enable_gqa(run_at, world, kv):
    d = _check(run_at(world), world, ("gqa", kv))["decisions"]
    assert d["q"] == "column" and d["o"] == "row" and d["k"] == d["v"] == "replicated", d
