"""Errors that name the place: the module path or graph node and the constraint."""


class FxMegatronError(Exception):
    """Base class for every error fxmegatron raises on bad input."""


class CaptureError(FxMegatronError):
    """The model's forward could not be traced to a graph."""


class ShardingError(FxMegatronError):
    """A tensor-parallel constraint does not hold (e.g. tp does not divide heads)."""


class MeshError(FxMegatronError):
    """The device mesh does not fit the job (missing dims, wrong size)."""


class BatchError(FxMegatronError):
    """A batch given at run time does not match what the graph was captured for, or the
    ranks that must see the same batch got different ones."""


class VerificationError(FxMegatronError):
    """The parallel program does not compute what the original model computes: names the
    first divergent node, its module path and the rule that placed it."""
