"""Every op that draws random numbers is keyed by element index (dropout) or refused by name
(issue: Mixtral's router jitter, aten.uniform_, was on no list, and tensor-parallel ranks drew
different noise: replicated weights 2e-3 apart after 3 steps at tp2)."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from fxmegatron.capture import capture
from fxmegatron.errors import ShardingError
from fxmegatron.passes.dropout_rng import KEYED, dropout_sites, random_ops
from tests.distributed import run_distributed
from tests.workers.loss_split import jitter_tp2

aten = torch.ops.aten


# arguments that, left at their defaults, make some random ops draw nothing (attention's
# dropout_p=0, rrelu's training=False): set so that the op draws
_DRAWING = {"dropout_p": 0.1, "dropout": 0.1, "train": True, "training": True}


def _one_call(op, **given):
    """A graph whose one call is ``op``, every required argument a graph input (or ``given``),
    and the arguments that turn its randomness on set to draw."""
    g = fx.Graph()
    args, kwargs, skipped = [], {}, False
    for a in op._schema.arguments:
        if a.name in given:
            v = given[a.name]
        elif a.name in _DRAWING:
            v = _DRAWING[a.name]
        elif a.has_default_value():
            skipped = True
            continue
        else:
            v = g.placeholder(a.name)
        if a.kwarg_only or skipped:
            kwargs[a.name] = v
        else:
            args.append(v)
    g.output(g.call_function(op, tuple(args), kwargs))
    return fx.GraphModule(nn.Module(), g)


def test_the_random_ops_come_from_atens_tag():
    ops = set(random_ops())
    for op in (aten.uniform_.default, aten.uniform.default, aten.normal.Tensor_float, aten.normal_.default,
               aten.exponential_.default, aten.randint.low, aten.randperm.default, aten.multinomial.default,
               aten.bernoulli.p, aten.rand_like.default, aten.native_dropout.default):
        assert op in ops, op
    assert aten.empty_like.default not in ops and aten.add.Tensor not in ops


def test_every_random_op_is_keyed_or_refused_by_name():
    refused = 0
    for op in random_ops():
        if op in KEYED:
            continue
        with pytest.raises(ShardingError, match=rf"node \w+ \({op.overloadpacket}\) draws random numbers "
                                                rf"\({op}\)"):
            dropout_sites(_one_call(op))
        refused += 1
    assert refused > 100


def test_dropout_of_probability_zero_or_off_draws_nothing():
    assert dropout_sites(_one_call(aten.native_dropout.default, p=0.0, train=True)) == []
    assert dropout_sites(_one_call(aten.native_dropout.default, p=0.1, train=False)) == []
    assert dropout_sites(_one_call(aten.rrelu_with_noise.default, training=False)) == []
    with pytest.raises(ShardingError, match=r"native_dropout"):
        dropout_sites(_one_call(aten.native_dropout.default, p=0.1, train=True))


class _NoisyRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            noise = torch.empty_like(x).normal_(1.0, 0.1)
        return (self.lin(x * noise)).pow(2).mean()


def test_noise_drawn_under_no_grad_is_refused():
    with pytest.raises(ShardingError, match=r"aten\.normal"):
        dropout_sites(capture(_NoisyRegion(), (torch.randn(2, 8),)).gm)


def test_mixtral_router_jitter_at_tp2_is_refused_by_name():
    for msg in run_distributed(jitter_tp2, 2):
        assert msg is not None and msg.startswith("node uniform_ (aten.uniform_) in model.layers.0.mlp draws random "
                                                  "numbers"), msg
