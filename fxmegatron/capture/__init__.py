"""Capture: an unmodified model and an example batch become an ATen fx.GraphModule."""
from fxmegatron.capture.export import Captured, batch_args, capture, module_path, retarget_device

__all__ = ["Captured", "batch_args", "capture", "module_path", "retarget_device"]
