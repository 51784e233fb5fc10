"""Fault injection for the trainer's fault tests (tests/test_train_faults*.py,
tests/test_train_preempt.py, tests/test_train_nonfinite.py), loaded by every process of a
torchrun job whose PYTHONPATH starts with this folder. On rank FXM_FAULT_RANK ("all": every
rank) during step FXM_FAULT_STEP (0-based, counted by train_step calls), FXM_FAULT is one of

* raise | kill | sleep: in the forward (a pipeline stage's, or the rank's graph without a
  pipeline);
* term: SIGTERM to torchrun (which forwards it to every worker), after the step's backward,
  then 1 s asleep; term_rank: SIGTERM to this rank alone;
* kill_in_save: SIGKILL half-way through writing this rank's shard of checkpoint step-K,
  K = FXM_FAULT_STEP (the file cut to half its size first);
* nan: a NaN in one gradient before the gradient norm, in the last parameter replicated over
  tp (its square is counted on tp rank 0 alone) or else the last parameter;

the faults a real job meets, injected where they happen, with the package itself unchanged.
FXM_FAULT_MARK: a file that gets the time of the fault. With or without a fault, FXM_WRITES
(tests/test_train_multinode.py): a file that gets a line "RANK PATH" per checkpoint shard written; FXM_EXIT_DIR: a folder that gets
a file rank-R holding the status rank R's ``main`` returned (none: it never returned)."""
import os

if "RANK" in os.environ and any(os.environ.get(v) for v in ("FXM_FAULT", "FXM_WRITES", "FXM_EXIT_DIR")):
    import math
    import signal
    import time

    import fxmegatron.io.checkpoint as _ckpt
    import fxmegatron.train.main as _main_module
    from fxmegatron.placement import Replicate
    from fxmegatron.runtime.model import ParallelModel
    from fxmegatron.schedules.runtime import StageRunner

    _kind = os.environ.get("FXM_FAULT", "")
    _on = os.environ.get("FXM_FAULT_RANK") in ("all", os.environ["RANK"])
    _step = int(os.environ.get("FXM_FAULT_STEP", "-2"))
    _steps = [-1]
    _train_step, _forward, _grad_norm, _save_file, _main = (
        ParallelModel.train_step, StageRunner._forward, ParallelModel.grad_norm, _ckpt.save_file, _main_module.main)

    def _mark():
        if os.environ.get("FXM_FAULT_MARK"):
            with open(os.environ["FXM_FAULT_MARK"], "w") as f:     # when the fault happened
                f.write(repr(time.time()))

    def _now(kinds):
        return _kind in kinds and _on and _steps[0] == _step

    def _in_forward(where):
        if not _now(("raise", "kill", "sleep")):
            return
        _mark()
        if _kind == "raise":
            raise RuntimeError(f"injected fault in {where} at step {_step}")
        if _kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10 ** 6)

    def train_step(self, *args, **kwargs):
        _steps[0] += 1
        if self.pp_size == 1 and not getattr(self, "_fault_hooked", False):
            # no pipeline: the fault goes in the rank's graph (each GraphModule has a class of its own)
            cls = type(self.graph_module)
            graph_forward = cls.forward

            def hooked(gm, *a, **k):
                _in_forward("the forward")
                return graph_forward(gm, *a, **k)
            cls.forward = hooked
            self._fault_hooked = True
        out = _train_step(self, *args, **kwargs)
        if _now(("term", "term_rank")):
            _mark()
            os.kill(os.getppid() if _kind == "term" else os.getpid(), signal.SIGTERM)
            if _kind == "term":
                time.sleep(1.0)     # torchrun forwards it to every rank meanwhile: all stop at this step
        return out

    def forward(self, *args, **kwargs):
        _in_forward("a pipeline stage's forward")
        return _forward(self, *args, **kwargs)

    def grad_norm(self):
        if _now(("nan",)):
            named = [(n, p) for n, p in self.named_parameters() if p.grad is not None]
            replicated = [(n, p) for n, p in named if isinstance(self.placement(n), Replicate)]
            name, p = (replicated or named)[-1]
            p.grad.view(-1)[0] = math.nan
            _mark()
        return _grad_norm(self)

    def save_file(tensors, filename, *args, **kwargs):
        _save_file(tensors, filename, *args, **kwargs)
        if os.environ.get("FXM_WRITES"):
            with open(os.environ["FXM_WRITES"], "a") as f:
                f.write(f"{os.environ['RANK']} {filename}\n")
        if _kind == "kill_in_save" and _on and f"step-{_step:08d}.tmp" in filename:
            os.truncate(filename, os.path.getsize(filename) // 2)
            _mark()
            os.kill(os.getpid(), signal.SIGKILL)

    def main(*args, **kwargs):
        code = _main(*args, **kwargs)
        if os.environ.get("FXM_EXIT_DIR"):
            with open(os.path.join(os.environ["FXM_EXIT_DIR"], f"rank-{os.environ['RANK']}"), "w") as f:
                f.write(str(code))
        return code

    ParallelModel.train_step = train_step
    StageRunner._forward = forward
    ParallelModel.grad_norm = grad_norm
    _ckpt.save_file = save_file
    _main_module.main = main
