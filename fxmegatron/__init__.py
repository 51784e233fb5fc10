"""fxmegatron: Megatron-LM's parallelism as a compiler on torch.fx."""
from fxmegatron.api import ParallelModel, parallelize
from fxmegatron.errors import CaptureError, FxMegatronError, MeshError, ShardingError
from fxmegatron.placement import Partial, Replicate, Shard

__all__ = ["parallelize", "ParallelModel", "Replicate", "Shard", "Partial",
           "FxMegatronError", "CaptureError", "ShardingError", "MeshError"]
__version__ = "0.1.0"
