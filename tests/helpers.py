"""One-process helpers: capture a model and run the tensor-parallel pass for a given rank."""
from fxmegatron.capture import capture, module_path
from fxmegatron.passes.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel


def transform(model, batch, tp, rank=0, sequence_parallel=False):
    """(captured, plan, graph) for ``rank`` of ``tp``; no process group needed."""
    cap = capture(model, batch)
    plan = plan_tensor_parallel(cap.gm, tp, cap.params.keys(), sequence_parallel)
    apply_tensor_parallel(cap.gm, plan, rank, "tp")
    return cap, plan, cap.gm


def decisions(plan):
    """module path (or node name at the top level) -> the plan's Decision for its matmul,
    embedding or loss (the last one where a module has several)."""
    return {module_path(n) or n.name: d for n, d in plan.decisions.items()}
