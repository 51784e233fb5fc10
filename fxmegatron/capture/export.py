"""Capture: an unmodified nn.Module + an example batch -> an ATen fx.GraphModule.

torch.export (non-strict) gives the training IR with the loss inside the
graph. We "unlift" it: parameters, buffers and constants become ``get_attr``
nodes named by their module path, so the graph reads like the model and the
only placeholders are the batch. Tied parameters (one tensor under two names)
become one ``get_attr``. Shapes are in ``node.meta["val"]``, module paths in
``node.meta["nn_module_stack"]``. Nothing is materialised: a model built on
the meta device is captured without allocating its weights.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from fxmegatron.capture.inputs import check_scalar_loss, distinct_inputs, training_kwargs
from fxmegatron.errors import CaptureError


class LossOnly(nn.Module):
    """Keeps only the loss as the graph's output (HF models return a ModelOutput)."""

    def __init__(self, model: nn.Module, extra_kwargs=None):
        super().__init__()
        self.model = model
        self.extra_kwargs = dict(extra_kwargs or {})

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs, **self.extra_kwargs)
        if isinstance(out, torch.Tensor):
            return out
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            loss = out[0]
        if loss is None:
            raise CaptureError(
                f"{type(self.model).__name__}.forward returned {type(out).__name__} with no loss: "
                "fxmegatron trains a model whose forward(batch) returns the loss "
                "(a scalar tensor, or an output with a .loss field, e.g. HF models given labels=)")
        return loss


_PREFIX = "model."


@dataclass
class Captured:
    gm: fx.GraphModule                 # unlifted graph; placeholders = flattened batch
    params: Dict[str, torch.Tensor]     # canonical name -> the model's parameter
    buffers: Dict[str, torch.Tensor]    # name -> buffer or lifted constant
    aliases: Dict[str, str]             # tied name -> canonical name
    in_spec: Any                        # pytree spec of (args, kwargs)
    device: torch.device                # where the example was captured
    model_cls: str = ""
    input_names: List[str] = field(default_factory=list)
    example_inputs: List[Any] = field(default_factory=list)   # flat example batch (shapes, dtypes)
    notes: List[str] = field(default_factory=list)           # what capture changed, for the plan


def batch_args(batch):
    """(args, kwargs) from a batch given as a tuple, a dict or one tensor."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _user_location(exc: BaseException) -> str:
    """The innermost frame of the traceback that is the user's code (not torch's)."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(torch_dir) and not f.filename.startswith(here)]
    text = str(exc)
    # export reports the user frame of a data-dependent guard in its message
    for line in text.splitlines():
        if "File " in line and ", line " in line and torch_dir not in line:
            return line.strip()
    if frames:
        f = frames[-1]
        return f'File "{f.filename}", line {f.lineno}, in {f.name}: {f.line}'
    return "(location unknown)"


def _tied_names(model: nn.Module) -> Dict[str, str]:
    first: Dict[int, str] = {}
    alias: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        alias[name] = first.setdefault(id(p), name)
    return alias


def capture(model: nn.Module, example_batch) -> Captured:
    args, kwargs = batch_args(example_batch)
    model_dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    if model_dev.type == "meta":
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    args, kwargs, cloned = distinct_inputs(args, kwargs)
    extra = training_kwargs(model, kwargs)
    notes = [f"example input {c} shares storage with an earlier input: captured as a distinct input"
             for c in cloned]
    notes += [f"captured with {k}={v!r} (a training graph keeps no inference cache)" for k, v in extra.items()]
    try:
        ep = torch.export.export(LossOnly(model, extra), args, kwargs, strict=False)
    except CaptureError:
        raise
    except Exception as exc:  # export raises many types; we add the place and re-raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
            hint = (" fxmegatron needs a forward without data-dependent Python control flow "
                    "(use torch.where / torch.cond instead of `if tensor:`).")
        raise CaptureError(
            f"could not trace {type(model).__name__}.forward to a graph at {_user_location(exc)}: "
            f"{type(exc).__name__}: {first}.{hint}") from exc
    cap = _unlift(ep, model, args, kwargs, model_dev)
    out = next(n for n in cap.gm.graph.nodes if n.op == "output")
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(out.args[0])]
    check_scalar_loss(model, vals[0] if len(vals) == 1 else tuple(vals))
    cap.example_inputs = pytree.tree_leaves((args, kwargs))
    cap.notes = notes
    return cap


def _unlift(ep, model, args, kwargs, device) -> Captured:
    alias = _tied_names(model)
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_bufs = dict(model.named_buffers(remove_duplicate=False))
    sig = ep.graph_signature
    spec_of = {s.arg.name: s for s in sig.input_specs}
    for o in sig.output_specs:
        if o.kind not in (OutputKind.USER_OUTPUT,):
            raise CaptureError(f"forward mutates {o.target!r} ({o.kind.name}): fxmegatron does not "
                               "support in-place updates of buffers/inputs during training")

    src = ep.graph_module
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    root: Dict[str, Any] = {}
    params: Dict[str, torch.Tensor] = {}
    buffers: Dict[str, torch.Tensor] = {}
    input_names: List[str] = []
    for node in src.graph.nodes:
        if node.op == "placeholder":
            s = spec_of[node.name]
            if s.kind == InputKind.USER_INPUT:
                new = graph.placeholder(node.name)
                input_names.append(node.name)
            elif s.kind == InputKind.PARAMETER:
                name = alias[s.target[len(_PREFIX):]]
                if name in params:      # a tied weight: one node for the one tensor
                    env[node] = next(n for n in graph.nodes if n.op == "get_attr" and n.target == name)
                    continue
                params[name] = named_params[name]
                root[name] = named_params[name]
                new = graph.get_attr(name)
            elif s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                if s.kind == InputKind.BUFFER:
                    name = s.target[len(_PREFIX):]
                    val = named_bufs[name]
                else:
                    name = "_constants." + s.target.replace(".", "_")
                    val = ep.constants[s.target]
                buffers[name] = val
                root[name] = val
                new = graph.get_attr(name)
            else:
                raise CaptureError(f"unsupported graph input {node.name} of kind {s.kind.name}")
            new.meta = dict(node.meta)
        elif node.target is torch.ops.aten._assert_tensor_metadata.default:
            continue    # export's runtime dtype/device checks: no users, and they pin activations
        else:
            new = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                sub = getattr(src, node.target)
                if isinstance(sub, fx.GraphModule):   # body of a higher-order op (e.g. a no_grad region)
                    sub = _drop_metadata_asserts(sub)
                root[node.target] = sub
        env[node] = new
    gm = fx.GraphModule(root, graph)
    in_spec = pytree.tree_flatten((args, kwargs))[1]
    return Captured(gm, params, buffers, {k: v for k, v in alias.items() if k != v}, in_spec,
                    device, type(model).__name__, input_names)


def module_path(node: fx.Node) -> str:
    """The module a node was traced in, as a dotted path (``""`` for the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path[len(_PREFIX):] if path.startswith(_PREFIX) else ("" if path == "model" else path)


def retarget_device(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Point device constants baked in at capture (arange(device=...), ...) at ``device``, and
    give the ops a model chose by the device it was captured on (``_histc_on_cpu``) what
    ``device`` has a kernel for."""
    device = torch.device(device)

    def fix(a):
        return device if isinstance(a, torch.device) and a != device else a

    for mod in gm.modules():     # also the bodies of higher-order ops
        if not isinstance(mod, fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if node.op == "call_function":
                node.args = fx.node.map_aggregate(node.args, fix)
                node.kwargs = fx.node.map_aggregate(node.kwargs, fix)
        if device.type in ("cpu", "mps"):
            _histc_on_cpu(mod.graph)
        mod.recompile()
    return gm


def _histc_on_cpu(graph: fx.Graph) -> None:
    """``histc`` of integers has no CPU (or MPS) kernel. transformers' MoE experts count their rows
    with ``histc(ids.int())`` on other devices and ``histc(ids.float())`` on those two, chosen by the
    device they are traced on: a model captured on meta (the trainer's) holds the int form. Read the
    ids as fp32 (exact for any expert id) and the counts back in the captured dtype."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.histc.default:
            continue
        x = node.args[0]
        v = x.meta.get("val") if isinstance(x, fx.Node) else None
        out = node.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or not isinstance(out, torch.Tensor):
            continue
        with graph.inserting_before(node):
            xf = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
        xf.meta["val"] = v.to(torch.float32)
        node.args = (xf, *node.args[1:])
        node.meta["val"] = out.to(torch.float32)
        with graph.inserting_after(node):
            back = graph.call_function(aten._to_copy.default, (node,), {"dtype": out.dtype})
        back.meta["val"] = out
        node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


def _drop_metadata_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
