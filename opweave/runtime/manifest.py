"""`manifest.json`: what an artifact holds and the checksum of every file in it.

Format version, OpWeave version, model and plan hashes, and the sha256 of each file. Every
worker verifies the manifest (and the files it reads) before running, so a tampered or truncated
artifact is refused with the name of the file that fails.
"""

from __future__ import annotations

import hashlib
import json
import os

from opweave import __version__
from opweave.errors import OpWeaveError

MANIFEST = "manifest.json"
FORMAT = "opweave-artifact/1"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(folder: str, model_hash: str, plan_hash: str) -> None:
    files = {name: sha256_file(os.path.join(folder, name)) for name in sorted(os.listdir(folder)) if name != MANIFEST}
    manifest = {"format": FORMAT, "opweave_version": __version__, "model_hash": model_hash,
                "plan_hash": plan_hash, "files": files}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def verify_manifest(folder: str, names: list[str] | None = None) -> dict:
    """Checks the format and the checksums (of `names`, or of every file); returns the manifest."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise OpWeaveError(f"{folder}: not an OpWeave artifact (no {MANIFEST}; run opweave compile)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError:
        raise OpWeaveError(f"{path}: truncated or not JSON") from None
    if manifest.get("format") != FORMAT:
        raise OpWeaveError(f"{path}: format {manifest.get('format')!r}, this opweave reads {FORMAT}")
    files = manifest.get("files", {})
    for name in names if names is not None else sorted(files):
        full = os.path.join(folder, name)
        if name not in files:
            raise OpWeaveError(f"{full}: not listed in the manifest")
        if not os.path.isfile(full):
            raise OpWeaveError(f"{full}: missing from the artifact")
        if sha256_file(full) != files[name]:
            raise OpWeaveError(f"{full}: fails its checksum (tampered or truncated); recompile")
    return manifest
