"""Where the CLI writes: checking output paths before the work, and writing them whole.

    check_output_file     --trace, --plot, profile -o: a file name in an existing, writable folder
    check_output_folder   demo --out: a folder that is there (or can be made) and writable
    check_artifact_dir    compile -o: a new folder, an empty one, or a previous OpWeave artifact
    atomic_file           a file written to a temporary sibling, then renamed over the target
    replace_folder        a finished temporary folder swapped in for the target folder

Note: every check runs before the work it guards (a search or a profile can take minutes), and the
writers check again at the end. An interrupted or failed write leaves the previous file or folder
as it was and nothing hidden beside it: temporaries are removed on any exception, and the few
renames that swap a folder into place run with signals held back (`opweave.signals.deferred`).

Replacing a folder loses what it holds, so `compile -o DIR` replaces only an empty folder or a
previous artifact: a `manifest.json` whose "format" starts with "opweave-artifact" and that lists
every file of the folder. Anything else needs `--force`, and some folders are refused even then:
the root, the home folder, the current folder and those above it, and any folder holding one of
the command's inputs (the model's checkpoint folder or file, a profile, a catalog).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import IO, Iterable, Iterator

from opweave.errors import OpWeaveError
from opweave.signals import deferred

ARTIFACT_FORMAT_PREFIX = "opweave-artifact"
MANIFEST = "manifest.json"
ARTIFACT_EXTRAS = ("manifest.json", "manifest.sig", "compile-info.json", "__pycache__")
"""Names an artifact holds besides the files its manifest lists (compile-info.json: the compile's
time and host, outside the manifest; older runtimes imported the rank modules, leaving __pycache__)."""
MAX_MANIFEST_BYTES = 16 << 20  # a real manifest is a few kB; anything bigger is not one
SHOWN_NAMES = 3                # entries named in a refusal


def _is_within(path: str, folder: str) -> bool:
    """Whether real path `path` is `folder` or lies inside it (both real, absolute paths)."""
    return os.path.commonpath([path, folder]) == folder


def _writable_folder(folder: str, what: str) -> None:
    if not os.path.exists(folder):
        raise OpWeaveError(f"{what}: folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise OpWeaveError(f"{what}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OpWeaveError(f"{what}: folder {folder} is not writable")


def check_output_file(path: str, flag: str, inputs: Iterable[str | None] = ()) -> str:
    """Checks that `path` can be written as a file; returns its real path (symlinks followed, so
    that a link keeps pointing at the written file). OpWeaveError naming `flag` otherwise.

    `inputs` are the files and folders the command reads: the output may not be one of them, nor
    overwrite a file inside one (a new file beside a checkpoint's is fine)."""
    if not path.strip():
        raise OpWeaveError(f"{flag} needs a file name, got {path!r}")
    target = os.path.realpath(path)
    what = f"{flag} {path}"
    if os.path.isdir(target):
        raise OpWeaveError(f"{what}: is a folder (give a file name)")
    if os.path.exists(target) and not os.path.isfile(target):
        raise OpWeaveError(f"{what}: exists and is not a regular file")
    _writable_folder(os.path.dirname(target), what)
    for given in inputs:
        if given and os.path.exists(given) and os.path.exists(target) and _is_within(target, os.path.realpath(given)):
            which = f"a file of {given}" if os.path.isdir(given) else given
            raise OpWeaveError(f"{what}: would overwrite {which}, an input of this command; choose another file")
    return target


def check_output_folder(path: str, flag: str) -> str:
    """Checks that files can be written inside folder `path` (made later if missing); returns its
    real path."""
    if not path.strip():
        raise OpWeaveError(f"{flag} needs a folder name, got {path!r}")
    target = os.path.realpath(path)
    what = f"{flag} {path}"
    if os.path.exists(target):
        _writable_folder(target, what)
    else:
        _writable_folder(os.path.dirname(target), what)
    return target


def artifact_extras(folder: str) -> list[str] | None:
    """The entries of `folder` that are not part of the OpWeave artifact it holds, or None when it
    holds none (no manifest.json of an artifact)."""
    path = os.path.join(folder, MANIFEST)
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_MANIFEST_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith(ARTIFACT_FORMAT_PREFIX):
        return None
    files = manifest.get("files")
    listed = set(files) if isinstance(files, dict) else set()
    return sorted(set(os.listdir(folder)) - listed - set(ARTIFACT_EXTRAS))


def _shown(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > SHOWN_NAMES else ""
    return ", ".join(names[:SHOWN_NAMES]) + more


def _refuse_protected(target: str, what: str, inputs: Iterable[str]) -> None:
    """Folders no output may replace, --force or not (module Note)."""
    home = os.path.realpath(os.path.expanduser("~"))
    if target == os.path.dirname(target):
        raise OpWeaveError(f"{what}: refusing to replace the root folder")
    if target == home:
        raise OpWeaveError(f"{what}: refusing to replace the home folder")
    cwd = os.path.realpath(os.getcwd())
    if _is_within(cwd, target):
        which = "the current folder" if cwd == target else f"a folder holding the current folder ({cwd})"
        raise OpWeaveError(f"{what}: refusing to replace {which}; choose a new folder")
    for given in inputs:
        real = os.path.realpath(given)
        if _is_within(real, target):
            which = "is" if real == target else "holds"
            raise OpWeaveError(f"{what}: {which} {given}, an input of this command; choose another folder")


def check_artifact_dir(out_dir: str, *, force: bool = False, inputs: Iterable[str | None] = (),
                       flag: str = "-o") -> str:
    """Checks that an artifact may be written to `out_dir` (module Note); returns its real path.

    Args:
        out_dir: the folder as the user gave it.
        force: replace a non-empty folder that holds no artifact (never a protected one).
        inputs: files and folders the command reads; a folder holding one is never replaced.
        flag: the option named in error messages.
    """
    if not out_dir.strip():
        raise OpWeaveError(f"{flag} needs a folder name, got {out_dir!r}")
    target = os.path.realpath(out_dir)
    what = f"{flag} {out_dir}"
    _refuse_protected(target, what, [p for p in inputs if p and os.path.exists(p)])
    _writable_folder(os.path.dirname(target), what)  # the new folder is renamed into place there
    if not os.path.exists(target):
        return target
    if not os.path.isdir(target):
        raise OpWeaveError(f"{what}: exists and is not a folder")
    try:
        entries = sorted(os.listdir(target))
    except OSError as e:
        raise OpWeaveError(f"{what}: cannot list the folder ({e.strerror})") from None
    extras = artifact_extras(target) if entries else []
    if not entries or extras == [] or force:
        return target
    hint = "choose a new folder, or add --force to replace it" if flag == "-o" else "choose another folder"
    if extras is None:
        raise OpWeaveError(f"{what}: folder is not empty and holds no OpWeave artifact ({_shown(entries)}); {hint}")
    raise OpWeaveError(f"{what}: holds files that are not part of its OpWeave artifact ({_shown(extras)}); {hint}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


ARTIFACT_MODES = {False: (0o755, 0o644), True: (0o700, 0o600)}
"""(folder, file) modes of an artifact, by whether it is signed: readable by all, or, next to a
signature, by its owner only. Set explicitly: no umask makes the code of an artifact writable
by others."""


def set_artifact_modes(folder: str, private: bool = False) -> None:
    """Gives `folder` and its files `ARTIFACT_MODES` (mkdtemp and mkstemp make them private)."""
    folder_mode, file_mode = ARTIFACT_MODES[private]
    os.chmod(folder, folder_mode)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        os.chmod(path, folder_mode if os.path.isdir(path) else file_mode)


def remove_tree(path: str) -> None:
    """Removes a temporary folder whole, even if a signal arrives meanwhile."""
    with deferred():
        shutil.rmtree(path, ignore_errors=True)


def replace_folder(new: str, target: str) -> None:
    """Renames finished folder `new` to `target`, replacing what is there (checked beforehand).

    The previous folder is first renamed aside inside the same parent, then deleted; if the second
    rename fails it is put back. Signals are held back meanwhile, so no interruption leaves
    `target` missing or the previous folder hidden beside it."""
    with deferred():
        if not os.path.isdir(target) or not os.listdir(target):
            os.rename(new, target)  # over an empty folder, rename replaces it in one step
            return
        aside = tempfile.mkdtemp(prefix=".opweave-old-", dir=os.path.dirname(target))
        try:
            os.rename(target, aside)
        except OSError:
            os.rmdir(aside)
            raise
        try:
            os.rename(new, target)
        except OSError:
            os.rename(aside, target)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        if os.path.exists(aside):
            raise OpWeaveError(f"wrote {target}, but could not delete the previous folder moved to {aside}")


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False, flag: str = "") -> Iterator[IO]:
    """Opens a temporary file beside `path` for writing; when the block ends without an exception
    it replaces `path` (its real path) in one rename, otherwise it is deleted.

    An OSError (disk full, a folder removed meanwhile) becomes an OpWeaveError naming `flag` and
    `path`."""
    what = f"{flag} {path}".strip()
    target = os.path.realpath(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.",
                                   suffix=".tmp")
    except OSError as e:
        raise OpWeaveError(f"{what}: cannot write ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as e:
        with deferred(), contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OpWeaveError(f"{what}: cannot write ({e.strerror or e})") from None
        raise
