"""The causal-mask proof by key intervals (``fxmegatron.passes.mask_intervals``): where it
decides, it agrees with evaluating the mask whole (hypothesis, over masks built from rows and
columns with every comparison, ``&``, casts and broadcasts); it decides HF's masks; and a
context-parallel layout at 128k tokens plans in seconds on the CPU, the mask dropped for
``is_causal`` without ever being evaluated."""
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from fxmegatron.passes.attention_rewrites import _ancestors, is_causal_value
from fxmegatron.passes.mask_intervals import key_intervals, proven_causal

OPS = [torch.le, torch.lt, torch.ge, torch.gt, torch.eq]


def _trace(fn, s):
    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(1))
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return gm, out


def _decide(fn, s):
    """(the interval proof's verdict, the verdict of the whole evaluated mask)."""
    gm, out = _trace(fn, s)
    return proven_causal(out, _ancestors(out), s, s), is_causal_value(fn(torch.zeros(1)), s, s)


@st.composite
def masks(draw):
    s = draw(st.integers(2, 9))
    b = draw(st.sampled_from([1, 2]))
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(OPS))
        # a row (query positions) and a column (key positions): arange, shifted, a step (packed
        # sequences), or positions modulo something (a column that decreases somewhere)
        kind_r = draw(st.sampled_from(["pos", "shift", "step", "mod"]))
        kind_c = draw(st.sampled_from(["pos", "shift", "step", "mod"]))
        shift = draw(st.integers(-3, 3))
        cut = draw(st.integers(0, s))
        mod = draw(st.integers(2, 5))
        flip = draw(st.booleans())
        terms.append((op, kind_r, kind_c, shift, cut, mod, flip))

    def values(kind, shift, cut, mod):
        pos = torch.arange(s)
        return {"pos": pos, "shift": pos + shift, "step": (pos >= cut).long(), "mod": (pos * 3) % mod}[kind]

    def fn(x):
        m = torch.arange(1).new_ones([], dtype=torch.bool)
        for op, kr, kc, shift, cut, mod, flip in terms:
            row = values(kr, shift, cut, mod)[:, None].expand(b, s, 1)[:, None]     # [b, 1, s, 1]
            col = values(kc, 0, cut, mod)[None, :][None, None].expand(b, 1, 1, s)   # [b, 1, 1, s]
            term = op(col, row) if flip else op(row, col)
            m = m & term.to(torch.bool)
        return m.expand(b, 1, s, s)
    return fn, s


@settings(max_examples=150, deadline=None)
@given(masks())
def test_where_the_intervals_hold_the_mask_they_are_the_mask(case):
    """Not the verdict alone (a wrong interval is seldom causal): the intervals, made dense,
    are the evaluated mask entry for entry, and the verdicts agree."""
    fn, s = case
    gm, out = _trace(fn, s)
    got = key_intervals(out, _ancestors(out), s, s)
    want = fn(torch.zeros(1)).numpy()
    if got is not None:
        assert (got.dense() == want).all()     # their leading dims broadcast to the mask's
    proven, evaluated = _decide(fn, s)
    assert proven is None or proven == evaluated


def test_the_intervals_decide_most_of_the_drawn_masks():
    """The property above would hold vacuously if the intervals never decided: count them."""
    decided = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(masks())
    def run(case):
        fn, s = case
        gm, out = _trace(fn, s)
        decided.append(key_intervals(out, _ancestors(out), s, s) is not None)
    run()
    assert sum(decided) >= len(decided) // 3, (sum(decided), len(decided))


def test_they_decide_causal_packed_sliding_and_refuse_a_decreasing_column():
    s = 8
    pos = lambda: torch.arange(s)      # noqa: E731

    def causal(x):
        return (pos()[None, :] <= pos()[:, None])[None, None].expand(2, 1, s, s)

    def packed(x):       # two documents: not causal (a query does not see the first document)
        seg = (pos() >= 3).long()
        return ((pos()[None, :] <= pos()[:, None]) & (seg[:, None] == seg[None, :]))[None, None]

    def sliding(x):      # a window of 3 keys: not causal
        return ((pos()[None, :] <= pos()[:, None]) & (pos()[None, :] > pos()[:, None] - 3))[None, None]

    def decreasing(x):   # keys in reverse order: no interval
        return (pos().flip(0)[None, :] <= pos()[:, None])[None, None]
    assert _decide(causal, s) == (True, True)
    assert _decide(packed, s) == (False, False)
    assert _decide(sliding, s) == (False, False)
    assert _decide(decreasing, s)[0] is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_128k_context_parallel_layout_plans_in_seconds_without_evaluating_the_mask(family, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    import fxmegatron.passes.attention_rewrites as ar
    from fxmegatron.train.plan import plan_run

    def never(*a, **k):
        raise AssertionError("the 128k mask was evaluated")
    monkeypatch.setattr(ar, "_constant_value", never)
    s = 131072
    if family == "llama":
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=256, vocab_size=512, max_position_embeddings=s, use_cache=False)
        cls = LlamaForCausalLM
    else:
        cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=s, use_cache=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cls = GPT2LMHeadModel
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    # CPU seconds of this process: the suite runs two files at a time, so wall time would count
    # the other file's work too
    t0 = time.process_time()
    plan = plan_run(model, {"input_ids": ids, "labels": ids}, cp=2, device="cpu")
    took = time.process_time() - t0
    assert took < 60, took
    assert plan is not None
