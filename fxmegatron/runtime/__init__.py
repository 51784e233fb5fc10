"""What runs a rank's program: ParallelModel, microbatch splitting and weights, data
parallelism, gradient accumulation, memory accounting. What builds the program's modules
(materialisation, stages, torch.compile) is ``fxmegatron.lower``."""
