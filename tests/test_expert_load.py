"""The rows per expert that expert parallelism records for the trainer's load-imbalance figure
(``fxmegatron.ops.expert_load``, put in the graph by passes/expert_parallel/rewrite.py, read by
fxmegatron/train/moe_load.py): the op sums what each forward gives and does nothing on fake
tensors, survives dead-code elimination and torch.compile; in a training step at dp2 x pp2 with
ep2 and two microbatches each rank records, per block of its stage, its experts' rows over the
ep group's tokens, which are the unmodified model's router top-2 counts on the global batch; the
trainer's figure is their max / mean, the worst block of both stages, on every rank."""
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmegatron.ops.expert_load import RECORD, take_expert_counts
from fxmegatron.passes.runner import check_shapes
from tests.distributed import run_distributed
from tests.workers.expert_load import ep_counts, ep_counts_of


def _graph():
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(torch.ops.aten.histc.default, (x, 4, 0, 3))
    g.call_function(RECORD, (h, "blk"))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)))
    x.meta["val"] = torch.empty(4)
    return fx.GraphModule(torch.nn.Module(), g)


def test_records_sums_and_is_a_no_op_on_fake_tensors():
    take_expert_counts()
    gm = _graph()
    gm.graph.eliminate_dead_code()          # nothing reads it, and it stays
    assert RECORD in [n.target for n in gm.graph.nodes]
    gm.recompile()
    with FakeTensorMode():
        gm(torch.empty(4))
    check_shapes(gm)                       # the passes' shape check: fake tensors, nothing recorded
    assert take_expert_counts() == {}
    gm(torch.tensor([0.0, 1, 1, 3]))
    gm(torch.tensor([2.0, 2, 3]))
    got = take_expert_counts()
    assert list(got) == ["blk"] and got["blk"].tolist() == [1, 2, 2, 2] and got["blk"].dtype == torch.int64
    assert take_expert_counts() == {}


def test_compiled_records_too():
    take_expert_counts()
    x = torch.tensor([0.0, 1, 1, 3], requires_grad=True)
    out = torch.compile(_graph(), backend="aot_eager")(x)
    out.sum().backward()
    assert take_expert_counts()["blk"].tolist() == [1, 2, 0, 1] and x.grad.tolist() == [2.0] * 4


def test_dp2_pp2_ep2_microbatches_record_the_routers_counts():
    results = run_distributed(ep_counts, 4, {"dp": 2, "pp": 2}, {"ep": 2, "microbatches": 2})
    ref = results[0]["ref"]
    for r in results:
        assert r["ref"] == ref
        er, ep = r["ep"]
        assert ep == 2 and r["again"] == {}
        # the stage's block only, its two experts of four, over both dp ranks' tokens and microbatches
        layer = r["pp"]
        assert r["recorded"] == {f"model.layers.{layer}.mlp": ref[layer][2 * er:2 * er + 2]}, (r, ref)
    # step 2's figure: every rank the worst block's max / mean of both stages
    want = max(max(c) / (sum(c) / 4) for c in results[0]["ref2"])
    assert all(r["figure"] == want for r in results), ([r["figure"] for r in results], want)


def test_integer_histc_captured_on_meta_runs_on_the_cpu():
    """transformers counts expert rows with histc of ints off the CPU, and a model captured on the
    meta device (the trainer's) keeps that form, which has no CPU kernel: ``retarget_device`` to
    the CPU reads the ids as fp32 and gives the counts back in the captured dtype."""
    from fxmegatron.capture import retarget_device
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(6, dtype=torch.int32, device="meta")
    h = g.call_function(torch.ops.aten.histc.default, (x, 4, 0, 3))
    h.meta["val"] = torch.empty(4, dtype=torch.int32, device="meta")
    g.output((h, g.call_function(torch.ops.aten.cumsum.default, (h, 0))))
    ids = torch.tensor([3, 0, 1, 1, 3, 5], dtype=torch.int32)      # 5: past max, left out as a sentinel
    gm = fx.GraphModule(torch.nn.Module(), g)
    try:
        gm(ids)
        raise AssertionError("histc of int32 ran on the CPU: this test no longer shows anything")
    except (NotImplementedError, RuntimeError):
        pass
    counts, offsets = retarget_device(gm, torch.device("cpu"))(ids)
    assert counts.dtype == torch.int32 and counts.tolist() == [1, 2, 0, 2] and offsets.tolist() == [1, 3, 3, 5]
    floats = retarget_device(_graph(), torch.device("cpu"))        # histc of floats: left as it is
    assert torch.ops.aten._to_copy.default not in [n.target for n in floats.graph.nodes]


def test_gathered_and_dense_dispatches_record_their_rows_too():
    """Without a histogram in the graph the rewrite counts the rows itself: transformers'
    batched_mm experts (the gathered dispatch) record what its grouped_mm experts record on the
    same weights and batch, and every dispatch's rows add up to tokens × k over the ep ranks (Llama
    4's dense dispatch: the scores that are not 0)."""
    results = run_distributed(ep_counts_of, 2, ["gpt_oss", "gpt_oss@batched_mm", "llama4_text"])
    for r in results:
        assert r["gpt_oss@batched_mm"]["recorded"] == r["gpt_oss"]["recorded"], r
    for name in ("gpt_oss", "gpt_oss@batched_mm", "llama4_text"):
        blocks = results[0][name]["recorded"]
        assert blocks, (name, results)
        want = results[0][name]["tokens"] * results[0][name]["k"]
        for block in blocks:
            rows = [c for r in results for c in r[name]["recorded"][block]]
            assert sum(rows) == want and len(rows) == 4, (name, block, rows, want)
