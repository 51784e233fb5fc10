"""``python -m fxmegatron.train CONFIG.toml``: see ``fxmegatron.train.main``."""
import sys

from fxmegatron.train.launcher import report_status
from fxmegatron.train.main import main

sys.exit(report_status(main()))
