"""What leaves the process: checkpoints, stage folders, dumps."""
