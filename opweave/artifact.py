"""An artifact folder's files on disk: `manifest.json` (what the artifact holds and the checksum of
every file in it), its optional signature, `compile-info.json`, and reading them back verified.
The compiler writes through this module, and every read of an artifact's files by the runtime and
the server goes through `load_artifact` (the files' bytes, checked against the manifest).

The manifest holds the format version, OpWeave version, model and plan hashes, and the sha256 of
each file. Every file but one is a function of the compile's inputs (model, cluster, catalog,
profile, flags, OpWeave version): two identical compiles write byte-identical folders. The
exception is `compile-info.json` (`INFO`): the search's wall-clock time, the host, Python and
library versions. It is not listed in the manifest (so the manifest and its signature stay the
same between identical compiles), nothing reads it at run time, and it carries no trust.

Note: an artifact is executable code. `opweave run` executes its `rank_XX.py` modules, so an
artifact must be trusted like a program. The checksums detect accidental damage (a truncated copy,
an edited file whose manifest was not updated) but not a deliberate edit: whoever can write the
module can also rewrite its checksum. Against that, `opweave compile --sign-key FILE` writes
`manifest.sig`, an HMAC-SHA256 of the exact bytes of `manifest.json` under a secret key, and
`opweave run --verify-key FILE` refuses an artifact whose signature is missing or does not match.
Every file the runtime uses is read once, hashed, and then used from those same bytes
(`load_artifact`): nothing is re-opened between the check and its use, so swapping a file after
the check changes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re

from opweave import __version__
from opweave.datafile import read_regular
from opweave.errors import OpWeaveError

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
INFO = "compile-info.json"  # wall-clock and host facts: outside the manifest and the byte-identity promise
FORMAT = "opweave-artifact/1"
MIN_KEY_BYTES = 16  # an HMAC key shorter than this is guessable; 32 random bytes is the norm
_SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode())


MAKE_KEY = "(umask 077; head -c 32 /dev/urandom > key)"


def read_key(path: str, flag: str) -> bytes:
    """The secret key in file `path` (its bytes as they are), for `--sign-key` / `--verify-key`:
    a regular file of at least `MIN_KEY_BYTES` that neither group nor others may read (as ssh
    requires of a private key)."""
    try:
        key = read_regular(path, f"{flag} {path}", 1 << 16)
        mode = os.stat(path).st_mode & 0o777
    except OSError as e:
        raise OpWeaveError(f"{flag} {path}: cannot read ({e.strerror})") from None
    if len(key) < MIN_KEY_BYTES:
        raise OpWeaveError(f"{flag} {path}: a key needs at least {MIN_KEY_BYTES} bytes, the file has {len(key)} "
                           f"(make one with: {MAKE_KEY})")
    if mode & 0o077:
        raise OpWeaveError(f"{flag} {path}: permissions {mode:04o} for {path} are too open: a key must not be "
                           f"readable by group or others (chmod 600 {path})")
    return key


def signature(manifest_bytes: bytes, key: bytes) -> str:
    return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()


def write_manifest(folder: str, model_hash: str, plan_hash: str, sign_key: bytes | None = None) -> None:
    """Writes manifest.json listing every file of `folder`, and manifest.sig when `sign_key` is given."""
    files = {name: sha256_file(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
             if name not in (MANIFEST, SIGNATURE, INFO)}
    manifest = {"format": FORMAT, "opweave_version": __version__, "model_hash": model_hash,
                "plan_hash": plan_hash, "signed": sign_key is not None, "files": files}
    data = json.dumps(manifest, indent=1).encode()
    with open(os.path.join(folder, MANIFEST), "wb") as f:
        f.write(data)
    if sign_key is not None:
        with open(os.path.join(folder, SIGNATURE), "w") as f:
            f.write(f"hmac-sha256 {signature(data, sign_key)}\n")


def write_info(folder: str, search_seconds: float) -> None:
    """Writes `INFO`: what differs between identical compiles (time, host, versions)."""
    import platform
    import socket

    info = {"search_seconds": round(search_seconds, 3), "host": socket.gethostname(),
            "python": platform.python_version(), "platform": platform.platform(), "opweave_version": __version__}
    for lib in ("torch", "matplotlib", "numpy"):
        try:
            info[f"{lib}_version"] = __import__(lib).__version__
        except Exception:  # an optional library missing or broken: the info file does not need it
            pass
    with open(os.path.join(folder, INFO), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
        f.write("\n")


def _read_bytes(path: str, what: str) -> bytes:
    """The bytes of artifact file `path`; a FIFO, device or folder in its place is named as such,
    never opened (`opweave.datafile.read_regular`)."""
    try:
        return read_regular(path, path)
    except FileNotFoundError:
        raise OpWeaveError(f"{path}: missing from the artifact ({what})") from None
    except OSError as e:
        raise OpWeaveError(f"{path}: cannot read ({e.strerror})") from None


def _check_signature(folder: str, data: bytes, key: bytes) -> None:
    path = os.path.join(folder, SIGNATURE)
    if not os.path.lexists(path):
        raise OpWeaveError(f"{folder}: the artifact is not signed (no {SIGNATURE}); recompile with --sign-key, "
                           "or run without --verify-key")
    text = _read_bytes(path, "signature").decode("ascii", "replace").split()
    if len(text) != 2 or text[0] != "hmac-sha256" or not hmac.compare_digest(text[1], signature(data, key)):
        raise OpWeaveError(f"{path}: the signature does not match manifest.json under this key "
                           "(the artifact was changed, or signed with another key); do not run it")


def read_manifest(folder: str, verify_key: bytes | None = None) -> dict:
    """The manifest, its structure checked (and its signature, when `verify_key` is given)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise OpWeaveError(f"{folder}: not a folder (give an artifact folder written by opweave compile)")
    if not os.path.lexists(path):
        raise OpWeaveError(f"{folder}: not an OpWeave artifact (no {MANIFEST}; run opweave compile)")
    data = _read_bytes(path, "manifest")
    if verify_key is not None:
        _check_signature(folder, data, verify_key)
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpWeaveError(f"{path}: truncated or not JSON") from None
    if not isinstance(manifest, dict):
        raise OpWeaveError(f"{path}: not a manifest (a JSON {type(manifest).__name__}, expected an object)")
    if manifest.get("format") != FORMAT:
        raise OpWeaveError(f"{path}: format {manifest.get('format')!r}, this opweave reads {FORMAT}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise OpWeaveError(f"{path}: 'files' must map file names to sha256 checksums")
    for name, digest in files.items():
        if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
            raise OpWeaveError(f"{path}: file name {name!r} is not a plain name inside the artifact")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise OpWeaveError(f"{path}: checksum of {name!r} is not a sha256 hex digest")
    return manifest


@dataclasses.dataclass(frozen=True)
class VerifiedArtifact:
    """An artifact's files as the bytes that were checked: use these, never re-open the files."""

    folder: str
    manifest: dict
    files: dict[str, bytes]

    def bytes(self, name: str) -> bytes:
        if name not in self.files:
            raise OpWeaveError(f"{os.path.join(self.folder, name)}: not loaded from the artifact")
        return self.files[name]

    def json(self, name: str):
        try:
            return json.loads(self.bytes(name))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise OpWeaveError(f"{os.path.join(self.folder, name)}: not JSON") from None

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def view(self, prefix: str, shared: tuple[str, ...] = ("model_config.json", "ops.json")) -> "VerifiedArtifact":
        """The files named `prefix` + NAME as NAME, with the `shared` ones as they are: a
        disaggregated plan's prefill programs (`prefill_rank_00.json` as `rank_00.json`)."""
        def rename(names):
            return {n[len(prefix):]: v for n, v in names.items() if n.startswith(prefix)} | \
                {n: v for n, v in names.items() if n in shared}
        return dataclasses.replace(self, manifest=dict(self.manifest, files=rename(self.manifest["files"])),
                                   files=rename(self.files))


def load_artifact(folder: str, names: list[str] | None = None, verify_key: bytes | None = None,
                  missing_ok: bool = False) -> VerifiedArtifact:
    """Reads `names` (default: every file the manifest lists) once each, checks each against the
    manifest, and returns their bytes. A name the manifest does not list is an error, or, with
    `missing_ok`, left out (`VerifiedArtifact.has` tells)."""
    manifest = read_manifest(folder, verify_key)
    files = manifest["files"]
    out = {}
    for name in names if names is not None else sorted(files):
        full = os.path.join(folder, name)
        if name not in files:
            if missing_ok:
                continue
            raise OpWeaveError(f"{full}: not listed in the manifest")
        data = _read_bytes(full, "listed in the manifest")
        if not hmac.compare_digest(sha256_bytes(data), files[name]):
            raise OpWeaveError(f"{full}: fails its checksum (tampered or truncated); recompile")
        out[name] = data
    return VerifiedArtifact(folder=folder, manifest=manifest, files=out)


def verify_manifest(folder: str, names: list[str] | None = None, verify_key: bytes | None = None) -> dict:
    """Checks the format and the checksums (of `names`, or of every file); returns the manifest."""
    return load_artifact(folder, names, verify_key).manifest


def rank_files(rank: int) -> list[str]:
    """The artifact files one rank uses."""
    return [f"rank_{rank:02d}.py", f"rank_{rank:02d}.json", "model_config.json", "ops.json", "plan.json"]


def load_program_source(artifact: VerifiedArtifact, name: str):
    """The generated module `name` (e.g. rank_03.py) executed from its verified bytes."""
    import types

    code = compile(artifact.bytes(name), os.path.join(artifact.folder, name), "exec")
    module = types.ModuleType(os.path.splitext(name)[0])
    module.__file__ = os.path.join(artifact.folder, name)
    exec(code, module.__dict__)
    return module
