"""Expert parallelism (EP), first piece: recognising each mixture-of-experts block of a captured
graph from its ops (``find_experts``), as a descriptor per block (``ExpertsBlock``) that a
later rewrite uses to place experts on ranks and dispatch tokens to them; ``check_divisible``
checks that ep divides every block's experts. Nothing here changes the graph.
See docs/EXPERT_PARALLEL.md.
"""
from fxmegatron.passes.expert_parallel.descriptor import (DENSE, GATHERED, SORTED, ExpertMatmul, ExpertsBlock,
                                                          Router, SharedExperts, check_divisible)
from fxmegatron.passes.expert_parallel.recognise import describe_block, find_experts, preconditions

__all__ = ["find_experts", "check_divisible", "describe_block", "preconditions", "ExpertsBlock", "ExpertMatmul", "Router",
           "SharedExperts", "SORTED", "GATHERED", "DENSE"]
