"""fxmegatron's part of inductor's cache keys: a changed fxmegatron source misses the caches.

A custom op reaches inductor's FX graph cache and AOT autograd's cache as one call, and its
autograd formula is not in their keys. ``lower.inductor_reinplace``'s pass adds a hash of
fxmegatron's sources to the keys. The test uses an op of its own whose backward formula reads
a value, and a folder that stands in for fxmegatron's sources.
"""
import pytest
import torch

from fxmegatron.lower import inductor_reinplace
from fxmegatron.lower.torch_compile import inductor_options

FACTOR = {0: 2.0}


@torch.library.custom_op("fxmegatron_test::scaled_grad", mutates_args=())
def scaled_grad(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@scaled_grad.register_fake
def _(x):
    return torch.empty_like(x)


scaled_grad.register_autograd(lambda ctx, g: g * FACTOR[0])


def _grad_of_a_fresh_compile():
    torch._dynamo.reset()
    f = torch.compile(lambda x: scaled_grad(x * 1.5).sum(), options=inductor_options())
    x = torch.ones(4, requires_grad=True)
    f(x).backward()
    return x.grad[0].item()


def test_the_package_hash_covers_every_source_file(tmp_path):
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("B = 1\n")
    first = inductor_reinplace.package_hash(tmp_path)
    (tmp_path / "sub" / "b.py").write_text("B = 2\n")
    assert inductor_reinplace.package_hash(tmp_path) != first
    assert inductor_reinplace.loss_grad_over_donated_logits().uuid() == inductor_reinplace.package_hash()


def test_a_changed_source_misses_the_compiled_backward_cache(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters
    src = tmp_path / "src"
    src.mkdir()
    (src / "op.py").write_text("FACTOR = 2.0\n")
    real = inductor_reinplace.package_hash
    monkeypatch.setattr(inductor_reinplace, "_installed_hash", lambda: real(src))   # the uuid's source
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(FACTOR, 0, 2.0)
    with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=True, enable_remote_autograd_cache=False):
        assert _grad_of_a_fresh_compile() == pytest.approx(3.0)
        counters.clear()
        assert _grad_of_a_fresh_compile() == pytest.approx(3.0)       # unchanged: served from the cache
        assert counters["aot_autograd"]["autograd_cache_hit"] >= 1, dict(counters["aot_autograd"])
        FACTOR[0] = 5.0                                                  # the formula changes ...
        (src / "op.py").write_text("FACTOR = 5.0\n")                     # ... and so do the sources
        assert _grad_of_a_fresh_compile() == pytest.approx(7.5)
