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


class BatchStructureError(BatchError, TypeError):
    """A batch whose keys or elements are not the example batch's (a TypeError too, as it
    always was)."""


class LossError(FxMegatronError, ValueError):
    """A loss that a step split into microbatches or data-parallel shares would not compute as
    the unmodified model does on the whole batch: names the node where the loss stops being a
    mean cross-entropy, its module path and why."""


class ReplicaError(FxMegatronError, ValueError):
    """Ranks that must hold the same weights (data-parallel replicas, tp ranks of a replicated
    parameter, pipeline ranks of a tied one) hold different ones: names the parameter and the ranks."""


class VerificationError(FxMegatronError):
    """The parallel program does not compute what the original model computes: names the
    first divergent node, its module path and the rule that placed it."""


class PassError(FxMegatronError):
    """A compiler pass failed or left the graph inconsistent: names the pass and the passes
    that ran before it."""


class ScheduleError(FxMegatronError, ValueError):
    """A pipeline schedule is invalid: bad (p, v, m), or a simulated run would
    compute without its input, leave a send/recv unmatched, or deadlock."""


class PipelineSplitError(FxMegatronError, ValueError):
    """A graph that cannot be cut into pipeline chunks as asked."""


class PipelineError(FxMegatronError, RuntimeError):
    """Another pipeline rank failed while this one waited for it."""


class CompileError(FxMegatronError, ValueError):
    """torch.compile options that do not fit (compile and fuse together, an unknown mode)."""


class GradAccumError(FxMegatronError, ValueError):
    """An fp32 gradient accumulation that cannot be set up as asked."""


class CheckpointError(FxMegatronError, RuntimeError):
    """A checkpoint folder that is incomplete, of another format, or does not fit the model."""


class CompiledFolderError(FxMegatronError, RuntimeError):
    """A compiled stage folder that is missing, of another layout, or cannot be emitted."""


class ConfigError(FxMegatronError, ValueError):
    """A trainer config that is wrong: an unknown or mistyped key, a layout that does not fit
    the world size, a missing file. Raised before any process group work."""


class DataError(FxMegatronError, ValueError):
    """Training data that cannot be read as asked (a missing file, a token file whose size is not
    a whole number of tokens, tokens outside the model's vocabulary, too few tokens)."""


class TrainingError(FxMegatronError, RuntimeError):
    """A training run that must stop: a non-finite loss or gradient norm, a failed or stalled rank."""


class ExportError(FxMegatronError, RuntimeError):
    """A checkpoint that cannot be written back as a Hugging Face folder."""


class PrecisionError(FxMegatronError, ValueError):
    """A low-precision (FP8) option that does not fit: an unknown recipe or policy, a policy
    that selects no linear layer, a GPU without FP8 matmuls."""


class ExpertParallelError(ShardingError):
    """A mixture-of-experts computation that expert parallelism cannot follow or split: names
    the module path, the step of the walk that failed and what it requires, and the nodes seen
    along the walk (or the number of experts that ep does not divide)."""
