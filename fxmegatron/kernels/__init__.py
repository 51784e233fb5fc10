"""Hand-written Triton kernels: fused vocab-parallel cross-entropy, AdamW's multi-tensor step,
multi-tensor tables."""
