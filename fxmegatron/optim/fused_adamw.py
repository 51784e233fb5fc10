"""Mixed-precision AdamW in one pass over memory: ``FusedAdamW``.

Megatron's mixed precision keeps the model's parameters in bf16 (or fp16) and the
optimizer's state in fp32: a master copy of every parameter, the first moment ``m``
and the second moment ``v``. A step done with stock ops goes over memory five times
(clip the bf16 gradients, copy them into fp32 buffers, AdamW on the masters, copy
the masters back). Here one Triton kernel (``fxmegatron.kernels.adamw``) reads, per
element, the gradient (in the parameter's dtype), the master, ``m`` and ``v``;
multiplies the gradient by a scale read from a 0-d device tensor (the clip coefficient:
no host sync); does the AdamW update in fp32, as ``torch.optim.AdamW``::

    g = grad * scale
    w = w * (1 - lr * wd)                                  # decoupled weight decay
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w = w - lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

and writes the master, ``m``, ``v`` and the parameter's own storage (rounded to its
dtype). 2 + 12 bytes read and 12 + 2 written per bf16 parameter.

Layout. Masters, ``m`` and ``v`` are each one flat fp32 buffer; parameter ``i`` owns
``[offset_i, offset_i + numel_i)`` of each (offsets rounded up to 64 elements), and
``masters``/``exp_avgs``/``exp_avg_sqs`` are views of it in the parameter's shape.
The gradients are separate tensors that autograd allocates, so the kernel is a
multi-tensor apply: one launch for the parameters of one group and dtype, reading the
gradients' and parameters' addresses from a table (``fxmegatron.kernels.adamw`` says how).

The step count is kept per parameter on the host, as torch does (a parameter
without a gradient keeps its state and its count), so the bias corrections and
``lr / (1 - b1**t)`` are computed on the host, in double, and passed as scalars; in
the rare step where parameters have different counts they travel in the table too.

Where kernels run (``fxmegatron.codegen.where_kernels_run.table_kernels_run``): on CUDA
tensors, and on CPU ones under ``TRITON_INTERPRET=1``, with the same kernel and the
same pointer tables (the interpreter loads through ``int64 -> pointer`` casts of CPU
addresses). Elsewhere (CPU without the interpreter, CUDA tensors under the interpreter,
which copies tensor arguments to the host and so cannot follow device addresses, or
while torch.compile traces) the step runs as ``torch.optim.AdamW``'s single-tensor
code does, with ``torch._foreach_*`` ops on the same fp32 views: CPU training works,
and matches torch to the last bit there. The kernel's rounding matches torch's CUDA
kernels (``fxmegatron.kernels.adamw``).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from fxmegatron.codegen.where_kernels_run import table_kernels_run
from fxmegatron.kernels.adamw import AdamWLaunch, adamw_kernel, step_scalars
from fxmegatron.kernels.multi_tensor import flat_offsets


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` on the device (no host sync), the factor
    ``torch.nn.utils.clip_grad_norm_`` scales the gradients by: ``FusedAdamW.step``'s
    ``grad_scale`` for clipping inside the optimizer's pass."""
    return (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:      # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank; a plain tensor itself."""
    return t._local_tensor if _is_dtensor(t) else t


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_hyper(g: dict, where: str) -> None:
    lr, betas, eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}lr must hold one number, got shape {tuple(lr.shape)}")
    if not 0.0 <= float(lr):
        raise ValueError(f"{where}invalid learning rate {lr}")
    if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"{where}invalid betas {betas}: two numbers, each in [0, 1)")
    if not 0.0 <= eps:
        raise ValueError(f"{where}invalid eps {eps}")
    if not 0.0 <= wd:
        raise ValueError(f"{where}invalid weight_decay {wd}")


def _admitted(p: Tensor, i: int, seen: set) -> bool:
    """Whether parameter ``i`` is optimised (it requires grad); raises if it cannot be."""
    if not p.dtype.is_floating_point:    # checked first: such a tensor cannot require grad
        raise ValueError(f"parameter {i} has dtype {p.dtype}: FusedAdamW needs floating-point "
                         f"parameters ({', '.join(map(str, _DTYPES))})")
    if not p.requires_grad:
        return False
    if id(p) in seen:
        raise ValueError(f"parameter {i} appears more than once")
    seen.add(id(p))
    if p.dtype not in _DTYPES:
        raise ValueError(f"parameter {i} has dtype {p.dtype}: FusedAdamW supports {', '.join(map(str, _DTYPES))}")
    loc = _local(p)
    if not loc.is_contiguous():
        raise ValueError(f"parameter {i} (shape {tuple(loc.shape)}, stride {loc.stride()}) is not contiguous: "
                         "FusedAdamW updates the parameters' storage as flat arrays")
    return True


class FusedAdamW(torch.optim.Optimizer):
    """AdamW on fp32 master copies of ``params``, one fused pass per step (module docstring).

    A ``torch.optim.Optimizer``: ``params`` is an iterable of tensors or of parameter groups
    (dicts with "params" and any of ``lr``, ``betas``, ``eps``, ``weight_decay``; the usual
    way to exempt biases and norms from weight decay), and torch's LR schedulers drive it.
    Each group's hyperparameters are read from ``param_groups`` at every step.

    The parameters (``nn.Parameter``\\ s; DTensors are updated through their local shards) are
    float32, bfloat16 or float16, all on one device; those with ``requires_grad=False`` are
    left out. The optimizer keeps an fp32 master copy of every parameter (fp32 ones too), and
    ``m`` and ``v``: ``masters``, ``exp_avgs`` and ``exp_avg_sqs`` are fp32 views in the
    parameters' shapes, and ``steps`` the per-parameter step counts, all in ``params`` order
    (the groups' parameters one after the other).

    ``step(grad_scale)`` multiplies every gradient by ``grad_scale`` (a 0-d tensor on the
    parameters' device, e.g. the clip coefficient ``min(1, max_norm / (norm + 1e-6))``; a
    Python number is accepted too), updates the masters and writes them, rounded, into the
    parameters. A callable in its place is a closure, as in torch: it is called (with grad
    enabled) before the update and its result returned. Parameters whose ``.grad`` is None
    are skipped: their state and step count are left as they are, as torch does. With
    ``set_grads_to_none`` (default) the step then sets every parameter's ``.grad`` to None,
    which frees the gradients for the next backward.

    The parameter set is fixed at construction (the fp32 state is one flat buffer):
    ``add_param_group`` after it raises. The parameters' values are read once, here: after
    changing them outside the optimizer (loading a checkpoint), call ``reload_masters()``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, set_grads_to_none: bool = True):
        if isinstance(params, Tensor):
            raise TypeError("params must be an iterable of tensors or of parameter groups, not a tensor")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        _check_hyper(defaults, "")
        self.set_grads_to_none = set_grads_to_none
        self._built = False
        super().__init__(params, defaults)     # torch's grouping, defaults and duplicate checks
        self._built = True

        self.params: List[Tensor] = []
        self._group_of: List[int] = []
        seen, device, first, i = set(), None, None, 0
        for gi, g in enumerate(self.param_groups):
            g["betas"] = tuple(g["betas"])
            _check_hyper(g, f"parameter group {gi}: " if len(self.param_groups) > 1 else "")
            keep, names = [], []
            for k, p in enumerate(g["params"]):
                if _admitted(p, i, seen):
                    loc = _local(p)
                    if device is None:
                        device, first = loc.device, i
                    elif loc.device != device:
                        raise ValueError(f"parameter {i} is on {loc.device} but parameter {first} on {device}: "
                                         "FusedAdamW needs all parameters on one device")
                    keep.append(p)
                    if "param_names" in g:
                        names.append(g["param_names"][k])
                    self.params.append(p)
                    self._group_of.append(gi)
                i += 1
            g["params"] = keep
            if "param_names" in g:
                g["param_names"] = names
        if not self.params:
            raise ValueError("FusedAdamW got an empty parameter list (no parameter requires grad)")
        self.device = device

        data = [_local(p.detach()) for p in self.params]
        self.shapes = [tuple(d.shape) for d in data]
        self.numels = [d.numel() for d in data]
        self.offsets, total = flat_offsets(self.numels)
        self._w = torch.zeros(total, dtype=torch.float32, device=device)
        self._m = torch.zeros_like(self._w)
        self._v = torch.zeros_like(self._w)
        view = lambda buf, i: buf[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])
        self.masters = [view(self._w, i) for i in range(len(self.params))]
        self.exp_avgs = [view(self._m, i) for i in range(len(self.params))]
        self.exp_avg_sqs = [view(self._v, i) for i in range(len(self.params))]
        self.steps = [0] * len(self.params)
        self.reload_masters()

        launches: Dict[Tuple[int, torch.dtype], List[int]] = {}
        for i, p in enumerate(self.params):
            launches.setdefault((self._group_of[i], p.dtype), []).append(i)
        self._launches = [AdamWLaunch(gi, dt, idx, [self.numels[i] for i in idx], [self.offsets[i] for i in idx])
                          for (gi, dt), idx in launches.items()]

    def add_param_group(self, param_group: dict) -> None:
        if self._built:
            raise ValueError("FusedAdamW.add_param_group: the parameter set is fixed when the optimizer is "
                             "built (its fp32 state is one flat buffer); build a new FusedAdamW with every group")
        super().add_param_group(param_group)

    # ---- public helpers ----------------------------------------------------------------------
    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the parameters' current values into the fp32 masters."""
        torch._foreach_copy_(self.masters, [_local(p.detach()) for p in self.params])

    def state_bytes(self) -> int:
        """Bytes of fp32 state this optimizer holds: masters, m and v."""
        return 3 * self._w.numel() * self._w.element_size()

    @property
    def state(self) -> Dict[Tensor, dict]:
        """Per parameter: {"step" (a 0-d float tensor, as torch keeps it), "exp_avg",
        "exp_avg_sq", "master"} (views of the optimizer's buffers; not a copy)."""
        return {p: {"step": torch.tensor(float(self.steps[i])), "exp_avg": self.exp_avgs[i],
                    "exp_avg_sq": self.exp_avg_sqs[i], "master": self.masters[i]}
                for i, p in enumerate(self.params)}

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty dict; the state lives in the flat
        # buffers and ``steps`` instead, and the property above builds the per-parameter view
        pass

    def state_dict(self) -> dict:
        """``torch.optim``'s form: {"state": {index: per-parameter state, copied}, "param_groups":
        [hyperparameters (with whatever a scheduler added, e.g. "initial_lr"), "params": indices]}."""
        state = {i: {k: v.detach().clone() for k, v in st.items()} for i, st in enumerate(self.state.values())}
        groups, i = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n))})
            i += n
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict`` returned (or ``fxmegatron.io.checkpoint`` reassembled): moments,
        step counts, fp32 masters and each group's hyperparameters. A parameter whose state holds
        no "master" (a checkpoint of another optimizer) takes its master from its current value;
        one with no state at all starts afresh, as in torch."""
        groups = state_dict.get("param_groups", [])
        want = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in groups] != want:
            raise ValueError(f"FusedAdamW.load_state_dict: expected {len(want)} parameter group(s) of "
                             f"{want} parameters, got {[len(g['params']) for g in groups]}")
        for gi, (g, saved) in enumerate(zip(self.param_groups, groups)):
            new = {**g, **{k: v for k, v in saved.items() if k != "params"}}
            new["betas"] = tuple(new["betas"])
            _check_hyper(new, f"FusedAdamW.load_state_dict: parameter group {gi}: ")
            g.update(new)
        self.reload_masters()
        i = 0
        for saved in groups:
            for idx in saved["params"]:
                self._load_param_state(i, state_dict.get("state", {}).get(idx))
                i += 1

    def _load_param_state(self, i: int, st: Optional[dict]) -> None:
        if not st:
            self.steps[i] = 0
            self.exp_avgs[i].zero_()
            self.exp_avg_sqs[i].zero_()
            return
        for field, buf in (("exp_avg", self.exp_avgs[i]), ("exp_avg_sq", self.exp_avg_sqs[i]),
                           ("master", self.masters[i])):
            if field not in st:
                if field == "master":
                    continue
                raise ValueError(f"FusedAdamW.load_state_dict: parameter {i} has no {field!r} in its state")
            t = _local(st[field]) if _is_dtensor(st[field]) else st[field]
            if tuple(t.shape) != self.shapes[i]:
                raise ValueError(f"FusedAdamW.load_state_dict: parameter {i}'s {field} has shape "
                                 f"{tuple(t.shape)}, expected {self.shapes[i]}")
            buf.copy_(t)
        step = st.get("step", 0)
        self.steps[i] = int(step.item() if torch.is_tensor(step) else step)

    # ---- the step ----------------------------------------------------------------------------
    def _grad(self, i: int) -> Optional[Tensor]:
        """Parameter i's gradient as a plain tensor in the parameter's layout, or None."""
        p = self.params[i]
        g = p.grad
        if g is None:
            return None
        if _is_dtensor(g):
            if tuple(g.placements) != tuple(p.placements):   # e.g. a Partial gradient of a Replicate weight
                g = g.redistribute(p.device_mesh, p.placements)
            g = g.to_local()
        if g.layout != torch.strided:
            raise ValueError(f"parameter {i} has a {g.layout} gradient: FusedAdamW needs dense gradients")
        if tuple(g.shape) != self.shapes[i] or g.dtype != p.dtype or g.device != self.device:
            raise ValueError(f"parameter {i}'s gradient is {g.dtype}{list(g.shape)} on {g.device}; expected "
                             f"{p.dtype}{list(self.shapes[i])} on {self.device}")
        return g if g.is_contiguous() else g.contiguous()

    @torch.no_grad()
    def step(self, grad_scale: Union[Tensor, float, Callable, None] = None,
             set_grads_to_none: Optional[bool] = None):
        loss = None
        if callable(grad_scale):             # torch's step(closure)
            with torch.enable_grad():
                loss = grad_scale()
            grad_scale = None
        grads = [self._grad(i) for i in range(len(self.params))]
        live = [i for i, g in enumerate(grads) if g is not None]
        if live:
            for i in live:
                self.steps[i] += 1
            if grad_scale is not None and not isinstance(grad_scale, Tensor):
                grad_scale = torch.full((), float(grad_scale), dtype=torch.float32, device=self.device)
            if grad_scale is not None:
                if grad_scale.numel() != 1:
                    raise ValueError(f"grad_scale must hold one number, got shape {tuple(grad_scale.shape)}")
                grad_scale = grad_scale.detach().reshape(()).to(device=self.device, dtype=torch.float32)
            if self._kernels_run():
                self._kernel_step(grads, grad_scale)
            else:
                self._torch_step(grads, live, grad_scale)
        if self.set_grads_to_none if set_grads_to_none is None else set_grads_to_none:
            for p in self.params:
                p.grad = None
        return loss

    def _kernels_run(self) -> bool:
        """Whether the step runs the kernel (``table_kernels_run`` on the flat buffers)."""
        return table_kernels_run(self._w)

    def _torch_step(self, grads: List[Optional[Tensor]], live: List[int], grad_scale: Optional[Tensor]) -> None:
        """``torch.optim.AdamW``'s single-tensor step (non-capturable), over foreach lists."""
        by_step: Dict[Tuple[int, int], List[int]] = {}
        for i in live:
            by_step.setdefault((self._group_of[i], self.steps[i]), []).append(i)
        for (gi, step), idx in by_step.items():
            grp = self.param_groups[gi]
            lr, (b1, b2), eps, wd = float(grp["lr"]), grp["betas"], grp["eps"], grp["weight_decay"]
            g = [grads[i].to(torch.float32, copy=True) for i in idx]
            if grad_scale is not None:
                torch._foreach_mul_(g, grad_scale)
            w = [self.masters[i] for i in idx]
            m = [self.exp_avgs[i] for i in idx]
            v = [self.exp_avg_sqs[i] for i in idx]
            if wd != 0:
                torch._foreach_mul_(w, 1 - lr * wd)
            torch._foreach_lerp_(m, g, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, g, g, value=1 - b2)
            step_size, bc2_sqrt = step_scalars(grp, step)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(w, m, denom, value=-step_size)
            torch._foreach_copy_([_local(self.params[i].detach()) for i in idx], w)

    def _kernel_step(self, grads: List[Optional[Tensor]], grad_scale: Optional[Tensor]) -> None:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):      # Triton launches on the current device
                self._launch_kernels(grads, grad_scale)
        else:
            self._launch_kernels(grads, grad_scale)

    def _launch_kernels(self, grads: List[Optional[Tensor]], grad_scale: Optional[Tensor]) -> None:
        kernel = adamw_kernel()
        for launch in self._launches:
            launch.run(kernel, [grads[i] for i in launch.members], [_local(self.params[i]) for i in launch.members],
                       [self.steps[i] for i in launch.members], self.param_groups[launch.group],
                       (self._w, self._m, self._v), grad_scale)
