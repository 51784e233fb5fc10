"""Capture: an unmodified model and an example batch become an ATen fx.GraphModule."""
from fxmegatron.capture.export import Captured, LossOnly, batch_args, capture, module_path, retarget_device

__all__ = ["Captured", "LossOnly", "batch_args", "capture", "module_path", "retarget_device"]
