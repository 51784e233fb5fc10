"""``python -m fxmegatron.train CONFIG.toml``: see ``fxmegatron.train.main``."""
import sys

from fxmegatron.train.main import main

sys.exit(main())
