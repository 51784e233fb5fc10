"""Functions run on each gloo (or NCCL) process by the multi-process tests, one module per
technique. Each is module-level (spawn imports it by name) and is re-exported here, so
``from tests.workers import tp_parity`` works for every one."""
from tests.workers.checkpoint import ckpt_run, full_state_roundtrip
from tests.workers.common import mesh_3d, pp_mesh, rel_err, tp_mesh, train_side_by_side
from tests.workers.copy_engine import copy_engine_agreement, copy_engine_vs_nccl
from tests.workers.data_parallel import clip_parity, dp_overlap_and_zero, dp_parity, grad_accum_errors
from tests.workers.dropout import dropout_runs, dropout_single
from tests.workers.launch import inprocess_lm_losses
from tests.workers.pipeline import pipeline_boundaries, pipeline_failure, pipeline_parity
from tests.workers.tensor_parallel import tp_parity

__all__ = [
    "ckpt_run", "clip_parity", "copy_engine_agreement", "copy_engine_vs_nccl", "dp_overlap_and_zero", "dp_parity",
    "dropout_runs", "dropout_single", "full_state_roundtrip", "grad_accum_errors", "inprocess_lm_losses", "mesh_3d",
    "pipeline_boundaries", "pipeline_failure", "pipeline_parity", "pp_mesh", "rel_err", "tp_mesh", "tp_parity",
    "train_side_by_side",
]
