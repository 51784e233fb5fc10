"""From a transformed graph to modules: materialisation of a rank's shards (materialize.py),
the build half of pipeline stages (stages.py: chunks, boundary shapes, the token counter),
torch.compile's set-up (torch_compile.py) and its inductor pass (inductor_reinplace.py).

Below ``program.py`` and ``runtime/`` (which runs what this builds), above ``passes/``:
nothing here imports ``runtime`` or ``program`` (tests/test_architecture.py)."""
