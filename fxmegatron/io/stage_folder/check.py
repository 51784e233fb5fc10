"""A compiled folder's manifest format and its check: the manifest records the SHA-256 of
every file written with it, and ``check_folder`` (which ``load_folder`` and
``fxmegatron.launch`` call before they import or read anything) refuses a folder whose files
changed after they were written, are missing, or were joined by a .py file.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import NamedTuple

from fxmegatron.errors import CompiledFolderError

MANIFEST = "manifest.json"
FORMAT = "fxmegatron-compiled/2"       # /2: the manifest records every file's SHA-256
_HASH_BLOCK = 1 << 20


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


class CheckedFolder(NamedTuple):
    """A folder whose files ``check_folder`` found as written, and its manifest: pass it to
    ``load_folder`` so the files are hashed once."""
    path: str
    manifest: dict


_TRUST = "a compiled folder is code (launch executes its stage.py files): only run folders you trust"


def check_folder(folder: str) -> CheckedFolder:
    """Refuse ``folder`` unless every file its manifest records is there with the recorded
    SHA-256, and no rank directory holds a .py file the manifest does not record. Reads the
    files as bytes; imports nothing."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CompiledFolderError(f"{folder} has no {MANIFEST}: not a folder written by `fxmegatron compile`")
    try:
        with open(path) as f:
            man = json.load(f)
    except ValueError as exc:
        raise CompiledFolderError(f"{path} is not JSON ({exc}): recompile the folder") from None
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise CompiledFolderError(f"{path} records no file hashes: the folder was written by an older "
                                  f"fxmegatron ({man.get('format')}); recompile it with `fxmegatron compile`")
    layout = man.get("layout", {})
    loaded = [f"pp{p}-tp{t}/{name}" for p in range(layout.get("pp", 1)) for t in range(layout.get("tp", 1))
              for name in ("stage.py", "weights.safetensors")]
    for rel in loaded:     # a manifest that forgets a file would let it load unchecked
        if rel not in files:
            raise CompiledFolderError(f"{path} records no hash for {rel}, which load_folder reads; "
                                      "recompile the folder with `fxmegatron compile`")
    for rel in sorted(files):
        parts = rel.split("/")
        if os.path.isabs(rel) or ".." in parts:
            raise CompiledFolderError(f"{path} records {rel}, which is not a path inside the folder")
        if not os.path.isfile(os.path.join(folder, *parts)):
            raise CompiledFolderError(f"{folder}: {rel} is recorded in {MANIFEST} but missing from the "
                                      "folder; recompile it or copy it again whole")
    for d in sorted({os.path.dirname(rel) for rel in files}):
        for name in sorted(os.listdir(os.path.join(folder, d))):
            rel = f"{d}/{name}" if d else name
            if name.endswith(".py") and rel not in files:
                raise CompiledFolderError(f"{folder}: {rel} is not recorded in {MANIFEST}: it was added after the "
                                          f"folder was written, and the stage code could import it; {_TRUST}")
    # the cheap refusals first: hashing reads every byte of every rank's weights
    for rel in sorted(files):
        if file_sha256(os.path.join(folder, *rel.split("/"))) != files[rel]:
            raise CompiledFolderError(f"{folder}: {rel} was modified after the folder was written (its SHA-256 "
                                      f"is not the one {MANIFEST} records); {_TRUST}. Recompile it or copy it "
                                      "again")
    return CheckedFolder(folder, man)
