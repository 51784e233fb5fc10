"""fxmegatron: Megatron-LM's parallelism as a compiler on torch.fx."""
from fxmegatron.api import ParallelModel, parallelize
from fxmegatron.layout import Layout
from fxmegatron.verify import VerifyReport, verify
from fxmegatron.errors import (BatchError, CaptureError, FxMegatronError, MeshError, ShardingError,
                               VerificationError)
from fxmegatron.placement import Partial, Replicate, Shard

__all__ = ["parallelize", "ParallelModel", "Layout", "verify", "VerifyReport", "BatchError", "VerificationError", "Replicate", "Shard", "Partial",
           "FxMegatronError", "CaptureError", "ShardingError", "MeshError"]
__version__ = "0.1.0"
