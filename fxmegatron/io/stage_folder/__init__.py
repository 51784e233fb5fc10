"""Compiled folders: each rank's chunks as Python source plus safetensors weights.

``write_folder(pm, folder)`` (one call per (pp, tp) rank, data-parallel replica 0)
writes::

    FOLDER/manifest.json                 layout, schedule, chunks, boundaries, placements, file hashes
    FOLDER/pp{p}-tp{t}/stage.py          class Chunk{k}(nn.Module) per chunk: readable forward code
    FOLDER/pp{p}-tp{t}/weights.safetensors

``stage.py`` imports torch and fxmegatron only, never the original model's code.
The weights are safetensors, loaded with no pickles. The collectives in the
generated code name their group symbolically ("@tp"), and ``load_folder``
binds that name to the launching job's process group in the source it loads.

A compiled folder is code: ``load_folder`` executes its ``stage.py`` files. The manifest
records the SHA-256 of every file written with it, and ``check_folder`` (which
``load_folder`` and ``fxmegatron.launch`` call before they import or read anything) refuses
a folder whose files changed after they were written, are missing, or were joined by a .py
file. That catches a corrupt copy or a hand edit, not a
malicious author: whoever can rewrite the files can rewrite the manifest too.

Three modules: ``emit`` (the source of ``stage.py`` and ``write_folder``), ``check`` (the
manifest's format, file hashes and ``check_folder``) and ``load`` (``load_folder``, and
``attach``, which the generated code calls). Generated ``stage.py`` files import ``attach``
from this package: compiled folders on disk name this path, so it stays.
"""
from fxmegatron.io.stage_folder.check import FORMAT, MANIFEST, CheckedFolder, check_folder, file_sha256
from fxmegatron.io.stage_folder.emit import stage_source, write_folder
from fxmegatron.io.stage_folder.load import attach, load_folder

__all__ = ["FORMAT", "MANIFEST", "CheckedFolder", "attach", "check_folder", "file_sha256", "load_folder",
           "stage_source", "write_folder"]
