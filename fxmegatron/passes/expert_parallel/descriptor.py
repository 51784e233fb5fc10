"""What the recogniser returns for one mixture-of-experts block (``ExpertsBlock``), and the one
check expert parallelism can make from it alone (``check_divisible``).

Nodes are the captured graph's own; a rewrite reads them on that graph. Shapes below: T tokens
(the batch's rows after the block flattens [b, s, h] to [T, h]), E experts, k experts per
token, h the hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch.fx as fx

from fxmegatron.errors import ExpertParallelError

# how rows reach their experts (docs/EXPERT_PARALLEL.md)
SORTED = "sorted"        # T*k rows sorted by expert id, grouped matmuls over offsets (transformers' grouped_mm)
GATHERED = "gathered"    # T*k rows in token order, each multiplied by its expert's weight gathered by id (batched_mm)
DENSE = "dense"          # every token through every expert: E*T rows scaled by [T, E] scores, 0 off the top-k (Llama 4)


@dataclass(frozen=True)
class ExpertMatmul:
    """A matmul over the experts' weights: ``weight`` is the parameter, dim ``experts_dim`` of
    it indexes the experts (expert parallelism splits it along that dim). ``bias``: an expert
    bias parameter [E, out] gathered per row by expert id (``bias_gather``) and added to the
    output (gpt-oss)."""
    node: fx.Node
    weight: str
    experts_dim: int
    bias: Optional[str] = None
    bias_gather: Optional[fx.Node] = None


@dataclass(frozen=True)
class Router:
    """The choice of experts. ``topk``: the aten.topk that picks them; ``scores``: its input
    (what is ranked, [T, E] or grouped); ``expert_ids``: ``topk[1]`` reshaped as the block reads it
    ([T, k]); ``weights``: the routing weights the rows are scaled by ([T, k]; for a dense
    dispatch the [T, E] scores), None where no scale was found; ``matmul`` and ``weight``: the
    linear that makes the logits and its parameter, where found."""
    topk: fx.Node
    scores: fx.Node
    expert_ids: fx.Node
    weights: Optional[fx.Node]
    matmul: Optional[fx.Node] = None
    weight: Optional[str] = None


@dataclass(frozen=True)
class SharedExperts:
    """Experts every token goes through, added to the routed result at ``join``: their matmuls
    (node, parameter) and, where the shared output is scaled by ``sigmoid(gate)``, the gate's
    matmul (Qwen2-MoE)."""
    join: fx.Node
    matmuls: Tuple[Tuple[fx.Node, str], ...]
    gate: Optional[fx.Node] = None


@dataclass(frozen=True)
class ExpertsBlock:
    """One mixture-of-experts block as found in the graph.

    * ``module``: the module holding the router and the experts (``model.layers.0.mlp``);
      ``num_experts`` (E), ``top_k`` (k), ``dispatch`` (``SORTED``, ``GATHERED``, ``DENSE``).
    * ``tokens``: the [T, h] hidden states the rows are taken from; ``rows``: the dispatched
      rows the first expert matmul reads ([T*k, h] ``index(tokens, [perm // k])`` for sorted,
      ``repeat_interleave(tokens, k)`` for gathered, the [E, T, h] view for dense).
    * ``grouped_by``: the expert id of each row (sorted: the sorted ids; gathered: the flat ids;
      dense: None, row block e is expert e); ``permutation`` (sorted: sort's indices, row i is
      pair ``permutation[i]`` = token ``permutation[i] // k``), ``counts`` (the histogram of
      rows per expert) and ``offsets`` (their cumsum, as the grouped matmuls read it).
    * ``matmuls``: the expert matmuls in graph order, the last one's result reaching the combine.
    * ``unpermute``: sorted only, the index by the inverse permutation that returns rows to
      (token, choice) order; ``combine``: the sum over each token's k rows (E rows for dense)
      whose [T, h] result leaves the experts.
    * ``shared``: shared experts added to the combine, where recognised.
    """
    module: str
    num_experts: int
    top_k: int
    dispatch: str
    tokens: fx.Node
    router: Router
    rows: fx.Node
    grouped_by: Optional[fx.Node]
    permutation: Optional[fx.Node]
    counts: Optional[fx.Node]
    offsets: Optional[fx.Node]
    matmuls: Tuple[ExpertMatmul, ...]
    unpermute: Optional[fx.Node]
    combine: fx.Node
    shared: Optional[SharedExperts] = None

    @property
    def weights(self) -> Tuple[str, ...]:
        """The expert weight parameters, in matmul order."""
        return tuple(m.weight for m in self.matmuls)

    @property
    def biases(self) -> Tuple[str, ...]:
        return tuple(m.bias for m in self.matmuls if m.bias is not None)

    def summary(self) -> str:
        shared = f", shared experts {[p for _, p in self.shared.matmuls]}" if self.shared else ""
        return (f"{self.module}: {self.num_experts} experts, top-{self.top_k}, {self.dispatch} dispatch, "
                f"weights {list(self.weights)}{', biases ' + str(list(self.biases)) if self.biases else ''}, "
                f"combine {self.combine.name}{shared}")


def check_divisible(blocks: Sequence[ExpertsBlock], ep: int) -> None:
    """Expert parallelism places E/ep whole experts on each of ``ep`` ranks: raises
    ``ExpertParallelError`` naming the first block whose E ep does not divide."""
    if not isinstance(ep, int) or ep < 1:
        raise ExpertParallelError(f"ep must be a positive integer, got {ep!r}")
    for b in blocks:
        if b.num_experts % ep:
            raise ExpertParallelError(
                f"ep={ep} does not divide the {b.num_experts} experts of {b.module or '(top level)'} "
                f"(weights {', '.join(b.weights)}): expert parallelism places {b.num_experts}/ep whole "
                f"experts on each rank; use an ep that divides {b.num_experts}")
