"""Fault injection for tests/test_train_faults.py, loaded by every process of a torchrun job whose
PYTHONPATH starts with this folder. FXM_FAULT = raise | kill | sleep, on rank FXM_FAULT_RANK, in
the forward of a pipeline stage during step FXM_FAULT_STEP (0-based, counted by train_step calls):
the faults a real job meets, injected where they happen, with the package itself unchanged."""
import os

if os.environ.get("FXM_FAULT") and "RANK" in os.environ:
    import signal
    import time

    from fxmegatron.runtime.model import ParallelModel
    from fxmegatron.schedules.runtime import StageRunner

    _kind = os.environ["FXM_FAULT"]
    _rank, _step = int(os.environ["FXM_FAULT_RANK"]), int(os.environ["FXM_FAULT_STEP"])
    _steps = [-1]
    _train_step, _forward = ParallelModel.train_step, StageRunner._forward

    def train_step(self, *args, **kwargs):
        _steps[0] += 1
        return _train_step(self, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if int(os.environ["RANK"]) == _rank and _steps[0] == _step:
            with open(os.environ["FXM_FAULT_MARK"], "w") as f:     # when the fault happened
                f.write(repr(time.time()))
            if _kind == "raise":
                raise RuntimeError(f"injected fault in a pipeline stage's forward at step {_step}")
            if _kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if _kind == "sleep":
                time.sleep(10 ** 6)
        return _forward(self, *args, **kwargs)

    ParallelModel.train_step = train_step
    StageRunner._forward = forward
