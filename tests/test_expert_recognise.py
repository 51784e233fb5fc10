"""Recognising mixtures of experts from a captured graph's ops (fxmegatron/passes/expert_parallel,
docs/EXPERT_PARALLEL.md): every MoE family of the pinned transformers that captures is found with
its number of experts, top-k, one block per MoE layer, and expert weights that are exactly the
model's parameters with a leading experts dim (with the router's weight); a dense model gives [];
planted experts computations the walk cannot follow, and families it does not follow (PhiMoE's
sparsemixer, JetMoE's loop over experts), raise naming the module, the step and the nodes seen."""
import functools
import re

import pytest
import torch
import torch.nn as nn

from fxmegatron.capture import capture
from fxmegatron.errors import ExpertParallelError, ShardingError
from fxmegatron.passes.expert_parallel import DENSE, GATHERED, SORTED, check_divisible, find_experts
from tests.families import FAMILIES, make_batch

_TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=0)


def _hf(cls_name, **kw):
    import transformers
    cfg = getattr(transformers, cls_name + "Config")(**kw)
    torch.manual_seed(0)
    return getattr(transformers, cls_name + "ForCausalLM")(cfg).float().train()


def _ids_batch():
    x = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": x, "labels": x.clone()}


def _family(name):
    f = FAMILIES[name]
    return f.build(n_layer=2), make_batch(f, 0)


def _moe_tp(name):
    from tests.test_moe_tp_rules import CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(name, use_cache=False, **CONFIGS[name])), _ids_batch()


def _loss_split(name):
    from tests.workers.loss_split import MOE, moe_batch
    return MOE[name](router_loss=False), moe_batch()


def _deepseek_v3():     # tests/test_slice_writes.py's: layer 0 dense, layer 1 MoE with a shared expert
    kw = {**_TINY, "num_key_value_heads": 4}
    return _hf("DeepseekV3", **kw, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1), _ids_batch()


MODELS = {
    "mixtral": lambda: _family("mixtral"),
    "qwen2_moe": lambda: _family("qwen2_moe"),
    "olmoe": lambda: _family("olmoe"),
    "gpt_oss": lambda: _moe_tp("gpt_oss"),
    "llama4_text": lambda: _moe_tp("llama4_text"),
    "qwen3_moe": lambda: _loss_split("qwen3_moe"),
    "granite_moe": lambda: _loss_split("granite_moe"),
    "deepseek_v3": _deepseek_v3,
}
# (family, variant): E, k, MoE layers, dispatch, expert matmul op, shared experts, expert biases
CASES = {
    ("mixtral", ""): (4, 2, 2, SORTED, "grouped_mm_fallback", False, False),
    ("mixtral", "bf16"): (4, 2, 2, SORTED, "aten._grouped_mm", False, False),     # torch's grouped mm
    ("qwen2_moe", ""): (4, 2, 2, SORTED, "grouped_mm_fallback", True, False),
    ("olmoe", ""): (4, 2, 2, SORTED, "grouped_mm_fallback", False, False),
    ("gpt_oss", ""): (4, 2, 2, SORTED, "grouped_mm_fallback", False, True),
    ("gpt_oss", "batched_mm"): (4, 2, 2, GATHERED, "aten.bmm", False, True),
    ("llama4_text", ""): (4, 1, 2, DENSE, "aten.bmm", True, False),
    ("qwen3_moe", ""): (4, 2, 2, SORTED, "grouped_mm_fallback", False, False),
    ("granite_moe", ""): (4, 2, 2, SORTED, "grouped_mm_fallback", False, False),
    ("deepseek_v3", ""): (4, 2, 1, SORTED, "grouped_mm_fallback", True, False),
}


@functools.lru_cache(maxsize=None)
def _captured(name, variant=""):
    model, batch = MODELS[name]()
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    elif variant:
        model.set_experts_implementation(variant)
    return model, capture(model, batch)


@pytest.mark.parametrize("name, variant", list(CASES), ids=[f"{n}-{v}" if v else n for n, v in CASES])
def test_family_is_recognised(name, variant):
    E, k, layers, dispatch, op, has_shared, has_bias = CASES[(name, variant)]
    model, cap = _captured(name, variant)
    blocks = find_experts(cap.gm)
    assert [(b.num_experts, b.top_k, b.dispatch) for b in blocks] == [(E, k, dispatch)] * layers
    params = dict(model.named_parameters())
    # the expert weights and biases and the router weights are exactly the parameters led by E
    found = {w for b in blocks for w in b.weights + b.biases + (b.router.weight,)}
    assert found == {n for n, p in params.items() if p.ndim >= 2 and p.shape[0] == E}
    for b in blocks:
        assert b.module and all(w.startswith(b.module + ".") for w in found if w in b.weights + b.biases)
        assert [params[w].ndim for w in b.weights] == [3, 3] and [m.experts_dim for m in b.matmuls] == [0, 0]
        assert all(op in str(m.node.target) for m in b.matmuls)
        assert bool(b.biases) == has_bias and all(params[n].shape[0] == E for n in b.biases)
        assert b.router.topk.args[1] == k and b.router.expert_ids.meta["val"].shape[-1] == k
        tokens = b.tokens.meta["val"].shape
        assert tuple(b.combine.meta["val"].shape) == tuple(tokens)
        assert tuple(b.router.weights.meta["val"].shape) == (tokens[0], E if dispatch == DENSE else k)
        if dispatch == SORTED:
            assert b.offsets.meta["val"].shape == (E,) and b.unpermute is not None
            assert [m.node.args[2] for m in b.matmuls] == [b.offsets, b.offsets]
            assert b.rows.meta["val"].shape[0] == tokens[0] * k
        # shared experts: every other matrix of the block (not the router's, not the experts')
        others = {n for n, p in params.items() if n.startswith(b.module + ".") and p.ndim == 2 and n not in found}
        if has_shared:
            assert {p for _, p in b.shared.matmuls} == others
        else:
            assert b.shared is None and not others
    if name == "qwen2_moe":     # its shared expert is scaled by sigmoid(gate), a [1, h] weight
        gate = dict(blocks[0].shared.matmuls)[blocks[0].shared.gate]
        assert params[gate].shape == (1, params[gate].shape[1])


def test_a_dense_model_has_no_experts():
    model, batch = _family("llama")
    assert find_experts(capture(model, batch).gm) == []


def test_check_divisible_names_the_block():
    _, cap = _captured("mixtral")
    blocks = find_experts(cap.gm)
    check_divisible(blocks, 2)
    check_divisible(blocks, 4)
    with pytest.raises(ExpertParallelError, match=r"ep=3 does not divide the 4 experts of model\.layers\.0\.mlp "
                                                   r"\(weights model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        check_divisible(blocks, 3)
    assert issubclass(ExpertParallelError, ShardingError)


# ---- planted experts computations -----------------------------------------------------------------
class Routed(nn.Module):
    """A hand-written top-k MoE in transformers' sorted layout, under names that say nothing of
    experts; ``combine``: "sum" (recognised), "index_add" (the rows summed into tokens by
    index_add), ``offsets``: "histc" (recognised) or "fixed" (equal counts per expert)."""

    def __init__(self, combine="sum", offsets="histc", e=4, k=2, h=8, f=16):
        super().__init__()
        self.combine, self.offsets, self.e, self.k = combine, offsets, e, k
        self.pick = nn.Linear(h, e, bias=False)
        self.a = nn.Parameter(torch.randn(e, h, f) * 0.1)
        self.b = nn.Parameter(torch.randn(e, f, h) * 0.1)

    def forward(self, x):
        from transformers.integrations import moe   # noqa: F401  (registers transformers::grouped_mm_fallback)
        gmm = torch.ops.transformers.grouped_mm_fallback
        w, ids = torch.topk(self.pick(x).softmax(-1), self.k)
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        rows = x[perm // self.k]
        if self.offsets == "histc":
            offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=self.e, min=0, max=self.e - 1), 0,
                                dtype=torch.int32)
        else:
            offs = torch.arange(1, self.e + 1, dtype=torch.int32) * (rows.shape[0] // self.e)
        y = gmm(torch.relu(gmm(rows, self.a, offs=offs)), self.b, offs=offs) * w.reshape(-1)[perm][:, None]
        if self.combine == "index_add":
            return torch.zeros_like(x).index_add(0, perm // self.k, y)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return y[inv].view(x.shape[0], self.k, -1).sum(1)


class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.trunk = nn.Module()
        self.trunk.part = Routed(**kw)

    def forward(self, x):
        return self.trunk.part(x).pow(2).mean()


def _planted(**kw):
    torch.manual_seed(0)
    net = Net(**kw)
    return net, capture(net, torch.randn(16, 8))


def test_a_planted_moe_is_recognised_by_its_ops():
    _, cap = _planted()
    (b,) = find_experts(cap.gm)
    assert (b.module, b.num_experts, b.top_k, b.dispatch) == ("trunk.part", 4, 2, SORTED)
    assert b.weights == ("trunk.part.a", "trunk.part.b") and b.router.weight == "trunk.part.pick.weight"


@pytest.mark.parametrize("kw, step, why", [
    (dict(offsets="fixed"), "offsets", r"cumsum\(histc\(ids, bins=E.*but they are mul"),
    (dict(combine="index_add"), "combine", r"a sum over one dim of size 2 leaving \[T, h\] = \[16, 8\].*"
                                           r"but the rows reach index_add"),
], ids=["offsets-not-from-topk", "combine-replaced"])
def test_an_unfollowable_experts_computation_names_module_step_and_nodes(kw, step, why):
    _, cap = _planted(**kw)
    with pytest.raises(ExpertParallelError) as err:
        find_experts(cap.gm)
    msg = str(err.value)
    assert msg.startswith("cannot follow the mixture-of-experts computation in trunk.part: "
                          f"step '{step}' requires "), msg
    assert re.search(why, msg), msg
    seen = msg.split("Nodes seen along the walk: ")[1]
    assert seen.startswith("grouped_mm_fallback (transformers.grouped_mm_fallback.default), trunk_part_a "
                           "(get_attr trunk.part.a), grouped_mm_fallback_1 (transformers.grouped_mm_fallback."), seen
    assert "(get_attr trunk.part.a)" in seen and "(get_attr trunk.part.b)" in seen


# ---- families the walk refuses, with the reason -----------------------------------------------------
REFUSED = {
    # sparsemixer: two argmaxes of Gumbel-noised scores, the ids joined by cat (no aten.topk)
    "phimoe": (lambda: _hf("Phimoe", **_TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
               "model.layers.0.mlp.experts", "top-k", "but they are concat_1 (aten.concat.default)"),
    # one linear per expert over W[e], rows split by data-dependent counts
    "jetmoe": (lambda: _hf("JetMoe", **{k: v for k, v in _TINY.items() if k != "num_attention_heads"},
                           intermediate_size=64, kv_channels=16, num_local_experts=4, num_experts_per_tok=2),
               "model.layers.0.self_attention.experts.input_linear", "dispatch",
               "but 4 matmuls each read one expert's slice W[e] of "
               "model.layers.0.self_attention.experts.input_linear.weight"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_family_the_walk_does_not_follow_is_refused_with_why(name):
    build, module, step, why = REFUSED[name]
    cap = capture(build(), _ids_batch())
    with pytest.raises(ExpertParallelError) as err:
        find_experts(cap.gm)
    msg = str(err.value)
    assert f"computation in {module}: step '{step}' requires" in msg and why in msg, msg
