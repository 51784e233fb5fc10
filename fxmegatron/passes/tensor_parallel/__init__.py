"""Tensor parallelism by placement propagation (Megatron 2019, as a graph pass).

``plan_tensor_parallel`` (propagate.py) gives every tensor a placement (Replicate /
Shard(dim) / Partial) from per-op rules (rules/, one module per op family, looked up
in one table):

* a matmul whose weight is a parameter and whose input is replicated is
  *column*-parallel (weight split on its output features, output Shard(-1));
  one whose input is split on the contraction dim is *row*-parallel (weight
  split on its input features, output Partial);
* elementwise ops, views, attention and norms carry a split through when the
  split dim survives them;
* an embedding looked up with ids from the batch is vocab-parallel (Partial);
  a cross-entropy over class-split logits is vocab-parallel.

When a split cannot be carried (a norm over the split dim, a residual add with
a replicated activation, ...) the column matmuls it came from are *demoted* to
replicated, the reason is recorded, and propagation starts again. Under sequence
parallelism (sequence.py) partial sums are reduce-scattered along the sequence
and sequence shards are gathered where they cannot go on.

``apply_tensor_parallel`` (rewrite.py) rewrites the graph for one rank from the plan.
"""
from fxmegatron.passes.tensor_parallel.plan import Decision, TPPlan
from fxmegatron.passes.tensor_parallel.propagate import plan_tensor_parallel
from fxmegatron.passes.tensor_parallel.rewrite import apply_tensor_parallel
from fxmegatron.passes.tensor_parallel.sequence import SEQ

__all__ = ["Decision", "SEQ", "TPPlan", "apply_tensor_parallel", "plan_tensor_parallel"]
