"""``ParallelConfig``: the name ``parallelize``'s options had before they became ``Layout``
(``fxmegatron.layout``), the one value that holds a layout's degrees and options. Kept so that
``from fxmegatron.config import ParallelConfig`` goes on working."""
from __future__ import annotations

from fxmegatron.layout import PRECISIONS, Layout

ParallelConfig = Layout

__all__ = ["ParallelConfig", "PRECISIONS"]
