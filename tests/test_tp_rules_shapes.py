"""Placement rules for ``stack``, ``flatten`` and a cast of a parameter (the interleaved
rotary of GPT-J and Cohere, Cohere's per-head q/k LayerNorm weight cast to the activations'
dtype), and einsum FLOPs in the coverage report. Each rule carries the split where its
precondition holds and, where it does not, leaves the op replicated with the reason; every
case is proved exact by ``fxmegatron.verify`` on simulated ranks."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxmegatron import verify
from fxmegatron.capture import capture
from fxmegatron.passes.tensor_parallel import plan_tensor_parallel
from fxmegatron.passes.tp_coverage import coverage, einsum_flops
from fxmegatron.placement import Shard
from tests.helpers import decisions, transform
from tests.test_tp_rules_models import Mlp

aten = torch.ops.aten
MOE = pytest.importorskip("transformers.integrations.moe")   # registers transformers::grouped_mm_fallback


class RotaryAttention(nn.Module):
    """Attention with the interleaved rotary of GPT-J / Cohere (``rotate_every_two``:
    ``stack([-x2, x1], -1).flatten(-2)``) and, with ``head_norm``, a weight per head
    ([heads, d]) cast to the activations' dtype before it scales q (Cohere's q LayerNorm).
    ``mix``: the rotated pairs are stacked with a slice of the replicated input instead
    of with q itself. ``fold``: heads folded into the batch dim ([b, H, s, d] ->
    [b*H, s, d]) before the scores (Bloom)."""

    def __init__(self, heads=4, h=64, head_norm=False, mix=False, fold=False, whole_norm_use=False):
        super().__init__()
        torch.manual_seed(11)
        self.heads, self.d = heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.head_norm, self.mix, self.fold, self.whole_norm_use = head_norm, mix, fold, whole_norm_use
        if head_norm:
            self.w = nn.Parameter(1 + 0.1 * torch.randn(heads, self.d, dtype=torch.float64))

    def rotate(self, t, x):
        b, s = x.shape[:2]
        t1, t2 = t[..., ::2], t[..., 1::2]
        other = x.view(b, s, self.heads, self.d)[..., ::2] if self.mix else t1
        return torch.stack([-t2, other], dim=-1).flatten(-2)

    def forward(self, x):
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, self.d)
        k = self.k(x).view(b, s, self.heads, self.d)
        v = self.v(x).view(b, s, self.heads, self.d).transpose(1, 2)
        if self.head_norm:
            q = F.layer_norm(q, (self.d,)) * self.w.to(q.dtype)
        pos = torch.arange(s, dtype=x.dtype)[:, None, None]
        q = q * torch.cos(pos) + self.rotate(q, x) * torch.sin(pos)
        k = k * torch.cos(pos) + self.rotate(k, x) * torch.sin(pos)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.fold:
            scores = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(b, self.heads, s, s)
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.o(y.transpose(1, 2).reshape(b, s, h)).pow(2).mean()
        if self.whole_norm_use:
            out = out + self.w.to(x.dtype).sum() * 1e-3
        return out


def _x(seed=0):
    return (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(seed)),)


def _rules(plan, packet):
    return [(plan.node_plc[n], plan.rules[n]) for n in plan.node_plc
            if getattr(n.target, "overloadpacket", None) is packet]


# ---- stack and flatten: the interleaved rotary -------------------------------------------------

@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_interleaved_rotary_keeps_attention_split(tp, sp):
    _, plan, _ = transform(RotaryAttention(), _x(), tp=tp, sequence_parallel=sp)
    d = decisions(plan)
    assert [d[m].kind for m in "qkvo"] == ["column"] * 3 + ["row"], d
    # [b, s, H, d/2] stacked to [b, s, H, d/2, 2], flattened back to [b, s, H, d]: heads stay dim 2
    assert _rules(plan, aten.stack) == [(Shard(2), "reductions.stack")] * 2
    assert _rules(plan, aten.flatten) == [(Shard(2), "views.flatten")] * 2
    verify(RotaryAttention(), _x(), tp=tp, sequence_parallel=sp)


def test_stack_of_split_and_whole_inputs_is_replicated_with_reason():
    _, plan, _ = transform(RotaryAttention(mix=True), _x(), tp=2)
    d = decisions(plan)
    for m in "qk":
        assert d[m].kind == "replicated" and "stacks differently split inputs" in d[m].reason, d[m]
    verify(RotaryAttention(mix=True), _x(), tp=2)


def test_flatten_merging_heads_into_the_batch_is_replicated_with_reason():
    _, plan, _ = transform(RotaryAttention(fold=True), _x(), tp=2)
    d = decisions(plan)
    for m in "qk":
        assert d[m].kind == "replicated" and "merges split dim 1 of [2, 4, 8, 16] into a later position" \
            in d[m].reason, d[m]
    verify(RotaryAttention(fold=True), _x(), tp=2)


def test_flatten_outside_and_inside_the_split():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):                      # x: [b, s, 16]
            h = self.up(x).view(2, 4, 4, 8)        # split along dim 2 (4 groups of 8 features)
            h = F.gelu(h.flatten(0, 1)).flatten(1)  # merge b, s (outside); merge groups, features (inside)
            return self.down(h).pow(2).mean()

    x = torch.randn(2, 4, 16)
    _, plan, _ = transform(Flat(), (x,), tp=2)
    assert [p for p, _ in _rules(plan, aten.flatten)] == [Shard(1), Shard(1)]
    d = decisions(plan)
    assert d["up"].kind == "column" and d["down"].kind == "row", d
    verify(Flat(), (x,), tp=2)
    verify(Flat(), (x,), tp=4, sequence_parallel=True)


# ---- a cast of a parameter ---------------------------------------------------------------------

@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_cast_parameter_is_split_by_its_consumer(tp, sp):
    _, plan, _ = transform(RotaryAttention(head_norm=True), _x(), tp=tp, sequence_parallel=sp)
    d = decisions(plan)
    assert [d[m].kind for m in "qkvo"] == ["column"] * 3 + ["row"], d
    assert plan.param_plc["w"] == Shard(0), plan.param_plc     # [heads, d]: this rank's heads
    cast = next(n for n in plan.rules if n.target is aten._to_copy.default or n.target is aten.to.dtype)
    assert plan.rules[cast] == "pointwise.cast"
    verify(RotaryAttention(head_norm=True), _x(), tp=tp, sequence_parallel=sp)


def test_cast_parameter_also_needed_whole_is_replicated_with_reason():
    model = RotaryAttention(head_norm=True, whole_norm_use=True)
    _, plan, _ = transform(model, _x(), tp=2)
    d = decisions(plan)
    assert d["q"].kind == "replicated" and "parameter w" in d["q"].reason, d["q"]
    assert "w" not in plan.param_plc or not isinstance(plan.param_plc["w"], Shard)
    verify(RotaryAttention(head_norm=True, whole_norm_use=True), _x(), tp=2)


def test_cast_of_a_claimed_parameter_is_an_ordinary_pointwise_op():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, dtype=torch.float64))

        def forward(self, x):
            return (x * self.w.sum() + x * self.w.to(x.dtype)).pow(2).mean()

    _, plan, _ = transform(Scale(), (torch.randn(2, 4, 16),), tp=2)
    cast = next(n for n in plan.rules if n.target in (aten._to_copy.default, aten.to.dtype))
    assert plan.rules[cast] == "pointwise.cast" and cast in plan.node_plc


# ---- einsum FLOPs in the coverage report -------------------------------------------------------

@pytest.mark.parametrize("eq,shapes,flops", [
    ("bsh,oh->bso", [(2, 4, 16), (32, 16)], 2 * 2 * 4 * 16 * 32),
    ("ij,jk", [(3, 4), (4, 5)], 2 * 3 * 4 * 5),                              # implicit output
    ("...ij,...jk->...ik", [(7, 3, 4), (4, 5)], 2 * 7 * 3 * 4 * 5),          # broadcast batch
    ("bhqd,bhkd->bhqk", [(2, 4, 8, 16), (2, 4, 8, 16)], 2 * 2 * 4 * 8 * 8 * 16),
    ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 6)], 2 * 3 * 4 * 5 + 2 * 3 * 5 * 6),   # left to right
    ("i,j->ij", [(3,), (4,)], 3 * 4),                                        # outer product: multiplies
    ("ii->i", [(3, 3)], 0),                                                  # one operand: no matmul
])
def test_einsum_flops(eq, shapes, flops):
    assert einsum_flops(eq, shapes) == flops
    # the count agrees with the matmul the einsum is
    if eq == "bsh,oh->bso":
        assert einsum_flops(eq, shapes) == 2 * torch.empty(2, 4, 32).numel() * 16


def test_coverage_counts_einsum_matmuls():
    x = torch.randn(2, 4, 16)
    cap = capture(Mlp("einsum"), (x,))
    plan = plan_tensor_parallel(cap.gm, 2, cap.params.keys())
    cov = coverage(cap.gm, plan, cap.params)
    assert cov.flops_split == 1.0 and not cov.replicated, cov.summary()
    # replicated at tp=3 (3 divides neither 32 nor 16 features): every einsum FLOP is counted as replicated
    plan3 = plan_tensor_parallel(cap.gm, 3, cap.params.keys())
    cov3 = coverage(cap.gm, plan3, cap.params)
    assert cov3.flops_split == 0.0 and len(cov3.replicated) == 2, cov3.summary()
    assert abs(sum(share for _, share, _ in cov3.replicated) - 1.0) < 1e-9


def test_split_parameter_also_reduced_whole_stays_replicated_with_reason():
    # a weight split by its elementwise use with a column output, then summed over the split
    # dim: there is no matmul to demote at the sum, so the parameter is kept whole
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
            self.w = nn.Parameter(torch.randn(32))

        def forward(self, x):
            return self.down(F.gelu(self.up(x)) * self.w).pow(2).mean() + self.w.sum()

    x = torch.randn(2, 4, 16)
    _, plan, _ = transform(Scaled(), (x,), tp=2)
    assert "reduces over the split dim" in plan.replicated_params["w"], plan.replicated_params
    d = decisions(plan)
    assert d["up"].kind == "replicated" and "uses parameter w that must stay replicated" in d["up"].reason, d
    verify(Scaled(), (x,), tp=2)


# ---- grouped matmuls of experts ----------------------------------------------------------------

class Experts(nn.Module):
    """A mixture's experts as HF runs them without a grouped-mm kernel: the rows routed to
    expert e (sorted, between offsets) times its slice of a [E, out, in] parameter, a fused
    gate/up projection chunked in two, then down. ``scaled``: the up weight is scaled
    before use (an activation, no longer a parameter)."""

    def __init__(self, e=4, h=16, f=32, scaled=False):
        super().__init__()
        torch.manual_seed(6)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * f, h) / h ** 0.5)
        self.down = nn.Parameter(torch.randn(e, h, f) / f ** 0.5)
        self.scaled = scaled

    def forward(self, x):                                     # x: [S, h], sorted by expert
        mm = torch.ops.transformers.grouped_mm_fallback
        offs = torch.tensor([3, 3, 6, 8])                     # expert 1 gets no rows
        w = self.gate_up * 2.0 if self.scaled else self.gate_up
        g, u = mm(x, w.transpose(1, 2), offs).chunk(2, dim=-1)
        return mm(F.silu(g) * u, self.down.transpose(1, 2), offs).pow(2).mean()


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_grouped_mm_experts_are_column_then_row(tp, sp):
    x = torch.randn(8, 16)
    cap, plan, _ = transform(Experts(), (x,), tp=tp, sequence_parallel=sp)
    kinds = {n.name: d.kind for n, d in plan.decisions.items()}
    assert sorted(kinds.values()) == ["column", "row"], kinds
    assert plan.param_plc["gate_up"] == Shard(1, (32, 32)) and plan.param_plc["down"] == Shard(2), plan.param_plc
    verify(Experts(), (x,), tp=tp, sequence_parallel=sp)


def test_grouped_mm_flops_are_counted():
    x = torch.randn(8, 16)
    cap = capture(Experts(), (x,))
    plan = plan_tensor_parallel(cap.gm, 2, cap.params.keys())
    cov = coverage(cap.gm, plan, cap.params)
    assert cov.flops_split == 1.0 and cov.params_split == 1.0, cov.summary()
    plan3 = plan_tensor_parallel(cap.gm, 3, cap.params.keys())
    cov3 = coverage(cap.gm, plan3, cap.params)
    # each row meets one expert: 2*8*16*64 for gate/up, 2*8*32*16 for down
    assert [round(share, 6) for _, share, _ in cov3.replicated] == [round(2 / 3, 6), round(1 / 3, 6)], cov3.summary()


def test_grouped_mm_with_a_computed_weight_is_replicated_with_reason():
    x = torch.randn(8, 16)
    _, plan, _ = transform(Experts(scaled=True), (x,), tp=2)
    mms = [n for n in plan.decisions if "grouped_mm" in str(n.target)]
    first = plan.decisions[mms[0]]
    assert first.kind == "replicated" and "3-D expert weight parameter" in first.reason, first
    assert plan.rules[mms[0]].startswith("opaque: is a grouped matmul")
    verify(Experts(scaled=True), (x,), tp=2)
