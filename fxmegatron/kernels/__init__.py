"""Hand-written Triton kernels: fused vocab-parallel cross-entropy, multi-tensor tables."""
