"""Compiled folders (see ``emit``). Generated ``stage.py`` files import ``attach`` from this
package: compiled folders on disk name this path, so it stays."""
from fxmegatron.io.stage_folder.emit import (FORMAT, MANIFEST, CheckedFolder, attach, check_folder, file_sha256,
                                             load_folder, stage_source, write_folder)

__all__ = ["FORMAT", "MANIFEST", "CheckedFolder", "attach", "check_folder", "file_sha256", "load_folder",
           "stage_source", "write_folder"]
