"""The trainer: ``fxmegatron train CONFIG.toml`` (or ``python -m fxmegatron.train``).

It sits on top of everything else (``parallelize``, the runtime, checkpoints): config,
data, model sources, the loop, evaluation, checkpoints on a cadence, logging, the
watchdog that ends a failing job, and export back to Hugging Face form."""
