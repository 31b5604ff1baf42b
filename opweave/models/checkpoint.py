"""Reading Hugging Face safetensors checkpoints, one tensor at a time.

`CheckpointReader` maps tensor names to files (from `model.safetensors.index.json` when the
checkpoint is sharded, else by listing each `*.safetensors` file's keys) and reads a tensor only
when asked, so a worker that owns a few operators reads only their weights.
"""

from __future__ import annotations

import json
import os

import torch

from opweave.errors import OpWeaveError

INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    def __init__(self, folder: str):
        from safetensors import safe_open  # imported here: only weight loading needs it

        self._safe_open = safe_open
        self.folder = folder
        self.key_to_file: dict[str, str] = {}
        index = os.path.join(folder, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                self.key_to_file = dict(json.load(f)["weight_map"])
        else:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not files:
                raise OpWeaveError(f"{folder}: no *.safetensors files (weights) in the checkpoint folder")
            for name in files:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    for key in f.keys():
                        self.key_to_file[key] = name
        self.num_reads = 0
        # some checkpoints prefix the text model (e.g. multimodal Gemma-3: language_model.model.*)
        self._aliases = self._find_aliases()

    def _find_aliases(self) -> dict[str, str]:
        out = {}
        for key in self.key_to_file:
            for prefix in ("language_model.", "model.language_model."):
                if key.startswith(prefix):
                    rest = key[len(prefix):]
                    out[rest if rest.startswith(("model.", "lm_head")) else "model." + rest] = key
        return out

    def _resolve(self, key: str) -> str | None:
        if key in self.key_to_file:
            return key
        return self._aliases.get(key)

    def has(self, key: str) -> bool:
        return self._resolve(key) is not None

    def shape(self, key: str) -> tuple[int, ...]:
        real = self._require(key)
        with self._safe_open(os.path.join(self.folder, self.key_to_file[real]), framework="pt") as f:
            return tuple(f.get_slice(real).get_shape())

    def get_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Reads only rows [start, stop) of dimension `dim` (a tensor-parallel shard)."""
        real = self._require(key)
        with self._safe_open(os.path.join(self.folder, self.key_to_file[real]), framework="pt") as f:
            part = f.get_slice(real)
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            tensor = part[index]
        self.num_reads += 1
        return tensor

    def _require(self, key: str) -> str:
        real = self._resolve(key)
        if real is None:
            raise OpWeaveError(f"{self.folder}: checkpoint has no tensor '{key}'")
        return real

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Reads one tensor; checks its shape when `shape` is given."""
        real = self._require(key)
        with self._safe_open(os.path.join(self.folder, self.key_to_file[real]), framework="pt") as f:
            tensor = f.get_tensor(real)
        self.num_reads += 1
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise OpWeaveError(f"{self.folder}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                               f"the config implies {tuple(shape)}")
        return tensor
