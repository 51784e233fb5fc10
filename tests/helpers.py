"""One-process helpers: capture a model and run the tensor-parallel pass for a given rank."""
from fxmegatron.capture import capture
from fxmegatron.passes.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel


def transform(model, batch, tp, rank=0):
    """(captured, plan, graph) for ``rank`` of ``tp``; no process group needed."""
    cap = capture(model, batch)
    plan = plan_tensor_parallel(cap.gm, tp, cap.params.keys())
    apply_tensor_parallel(cap.gm, plan, rank, "tp")
    return cap, plan, cap.gm
