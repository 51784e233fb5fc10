"""What runs a rank's program: stages, materialisation, data parallelism, gradient
accumulation, torch.compile, memory accounting."""
