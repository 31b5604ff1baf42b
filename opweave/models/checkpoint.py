"""Reading Hugging Face safetensors checkpoints, one tensor at a time.

`CheckpointReader` maps tensor names to files (from `model.safetensors.index.json` when the
checkpoint is sharded, else by listing each `*.safetensors` file's keys) and reads a tensor only
when asked, so a worker that owns a few operators reads only their weights.

Every file is checked to be a regular file before it is opened: a FIFO or a device named like a
weight file would block `open` (or read forever), so it is refused by name instead. Every error
names the file (and the tensor) concerned.
"""

from __future__ import annotations

import json
import os
import re
import stat

import torch

from opweave.errors import OpWeaveError

INDEX_FILE = "model.safetensors.index.json"

HUB_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.block_sparse_moe\.gate\.weight$", ".mlp.gate.weight"),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$", r".mlp.experts.\1.gate_proj.weight"),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.weight$", r".mlp.experts.\1.up_proj.weight"),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.weight$", r".mlp.experts.\1.down_proj.weight"),
))
"""Checkpoint tensor names of Mixtral's hub layout (router `block_sparse_moe.gate`, expert `w1`
gate, `w3` up, `w2` down) and the per-expert names OpWeave's operators read them by."""

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def require_regular_file(path: str, what: str) -> None:
    """Refuses `path` unless it is a regular file (symbolic links followed), without opening it.

    Args:
        path: the file about to be opened.
        what: what the file is, for the message ("weights file", "shard index", ...).
    Raises:
        OpWeaveError: missing, unreadable metadata, or a folder, FIFO, device or socket.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise OpWeaveError(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise OpWeaveError(f"{path}: the {what} is {kind}, not a regular file")


def _read_index(folder: str) -> dict[str, str]:
    """The shard index's weight_map (tensor -> file name), every file it names checked."""
    path = os.path.join(folder, INDEX_FILE)
    require_regular_file(path, "shard index")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise OpWeaveError(f"{path}: cannot read the shard index ({e.strerror})") from None
    except (ValueError, RecursionError) as e:  # truncated, not JSON, not UTF-8
        raise OpWeaveError(f"{path}: the shard index is not valid JSON ({str(e).splitlines()[0]})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise OpWeaveError(f"{path}: the shard index has no 'weight_map' object (tensor name -> file)")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise OpWeaveError(f"{path}: weight_map maps '{key}' to {name!r}, not a file name in the checkpoint folder")
    for name in sorted(set(weight_map.values())):
        if not os.path.lexists(os.path.join(folder, name)):
            raise OpWeaveError(f"{path}: weight_map lists {name}, which is not in the checkpoint folder")
        require_regular_file(os.path.join(folder, name), f"weights file listed in {INDEX_FILE}")
    return dict(weight_map)


class CheckpointReader:
    def __init__(self, folder: str):
        from safetensors import safe_open  # imported here: only weight loading needs it

        self._safe_open = safe_open
        self.folder = folder
        self.key_to_file: dict[str, str] = {}
        if os.path.lexists(os.path.join(folder, INDEX_FILE)):
            self.key_to_file = _read_index(folder)
        else:
            try:
                files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            except OSError as e:
                raise OpWeaveError(f"{folder}: cannot list the checkpoint folder ({e.strerror})") from None
            if not files:
                raise OpWeaveError(f"{folder}: no *.safetensors files (weights) in the checkpoint folder")
            for name in files:  # all checked before any is opened
                require_regular_file(os.path.join(folder, name), "weights file")
            for name in files:
                with self._open(name) as f:
                    for key in f.keys():
                        self.key_to_file[key] = name
        self.num_reads = 0
        # some checkpoints prefix the text model (e.g. multimodal Gemma-3: language_model.model.*)
        self._aliases = self._find_aliases()

    def _open(self, name: str):
        """safe_open on one of the checkpoint's files; a file that is not safetensors is named."""
        from safetensors import SafetensorError

        path = os.path.join(self.folder, name)
        try:
            return self._safe_open(path, framework="pt")
        except OSError as e:
            raise OpWeaveError(f"{path}: cannot read the weights file ({e.strerror})") from None
        except SafetensorError as e:
            raise OpWeaveError(f"{path}: not a safetensors file ({str(e).splitlines()[0]})") from None

    def _find_aliases(self) -> dict[str, str]:
        """OpWeave's name of a tensor -> the checkpoint's, for checkpoints that name it otherwise
        (a prefixed text model; Mixtral's hub layout, `HUB_RENAMES`)."""
        out = {}
        for key in self.key_to_file:
            for prefix in ("language_model.", "model.language_model."):
                if key.startswith(prefix):
                    rest = key[len(prefix):]
                    out[rest if rest.startswith(("model.", "lm_head")) else "model." + rest] = key
            for pattern, ours in HUB_RENAMES:
                if pattern.search(key):
                    out[pattern.sub(ours, key)] = key
        return out

    def _resolve(self, key: str) -> str | None:
        if key in self.key_to_file:
            return key
        return self._aliases.get(key)

    def has(self, key: str) -> bool:
        return self._resolve(key) is not None

    def _open_holding(self, real: str):
        """The file the map places tensor `real` in, opened; refused if it does not hold it."""
        name = self.key_to_file[real]
        f = self._open(name)
        if real not in f.keys():
            raise OpWeaveError(f"{os.path.join(self.folder, name)}: has no tensor '{real}' "
                               f"(the shard index {INDEX_FILE} places it there)")
        return f

    def shape(self, key: str) -> tuple[int, ...]:
        real = self._require(key)
        with self._open_holding(real) as f:
            return tuple(f.get_slice(real).get_shape())

    def get_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Reads only rows [start, stop) of dimension `dim` (a tensor-parallel shard)."""
        real = self._require(key)
        with self._open_holding(real) as f:
            part = f.get_slice(real)
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            tensor = part[index]
        self.num_reads += 1
        return self._floating(real, tensor)

    def _require(self, key: str) -> str:
        real = self._resolve(key)
        if real is None:
            raise OpWeaveError(f"{self.folder}: checkpoint has no tensor '{key}'")
        return real

    def _floating(self, real: str, tensor: torch.Tensor) -> torch.Tensor:
        """Refuses weights of an integer, boolean or complex dtype: cast to the model's floating
        dtype they would run and produce garbage (integer weights give all-0 tokens)."""
        if not tensor.dtype.is_floating_point:
            path = os.path.join(self.folder, self.key_to_file[real])
            raise OpWeaveError(f"{path}: tensor '{real}' has dtype {str(tensor.dtype).removeprefix('torch.')}; "
                               "weights must be of a floating-point dtype")
        return tensor

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Reads one tensor; checks its shape when `shape` is given."""
        real = self._require(key)
        with self._open_holding(real) as f:
            tensor = f.get_tensor(real)
        self.num_reads += 1
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise OpWeaveError(f"{self.folder}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                               f"the config implies {tuple(shape)}")
        return self._floating(real, tensor)
