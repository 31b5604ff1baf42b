"""Resolving a MODEL argument: a built-in name, a Hugging Face checkpoint folder, or a model.py.

- built-in: `opweave/models/configs/<name>.json` (Hugging Face config.json format, with a
  `_source` naming where the numbers come from); no weights.
- checkpoint folder: `config.json` (+ `*.safetensors`, read lazily by `CheckpointReader`).
- model.py: a Python file defining `build_model()` that returns a `CausalLM` built from OpWeave's
  operator modules (on the meta device for shapes only, or with real weights).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import torch

from opweave.errors import OpWeaveError
from opweave.models.config import ModelConfig
from opweave.models.hf_config import config_from_hf
from opweave.models.model import CausalLM, build_model

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


def builtin_names() -> list[str]:
    return sorted(n[: -len(".json")] for n in os.listdir(CONFIG_DIR) if n.endswith(".json"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A resolved MODEL argument."""

    name: str
    kind: str                      # builtin | checkpoint | file
    path: str                      # config file, checkpoint folder or model.py
    cfg: ModelConfig
    module: CausalLM | None = None  # built by a model.py

    @property
    def has_weights(self) -> bool:
        if self.kind == "checkpoint":
            return any(n.endswith(".safetensors") for n in os.listdir(self.path))
        return False

    def build(self, device: str | torch.device = "meta", dtype: str | None = None,
              kv_cache_dtype: str = "auto") -> CausalLM:
        """The model with this source's config (weights uninitialised unless it came from a model.py),
        its attention caching keys and values as `kv_cache_dtype` (`ModelConfig.kv_cache_dtype`)."""
        if self.module is not None:
            if kv_cache_dtype != "auto":
                raise OpWeaveError(f"{self.name}: --kv-cache-dtype {kv_cache_dtype} needs a built-in model or a "
                                   "checkpoint folder (a model.py builds its own caches)")
            return self.module
        cfg = self.cfg if dtype is None else self.cfg.with_dtype(dtype)
        return build_model(dataclasses.replace(cfg, kv_cache_dtype=kv_cache_dtype), device)

    def load(self, dtype: str | None = None) -> CausalLM:
        """The model on CPU with the checkpoint's weights."""
        from opweave.models.checkpoint import CheckpointReader

        if self.kind != "checkpoint":
            raise OpWeaveError(f"{self.name}: no weights to load (give a checkpoint folder)")
        model = self.build("cpu", dtype)  # a published fp8 / MXFP4 checkpoint reads dequantized
        model.load_weights(CheckpointReader(self.path))
        return model


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise OpWeaveError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise OpWeaveError(f"{path}: cannot read ({e.strerror})") from None


def _from_file(path: str) -> ModelSource:
    spec = importlib.util.spec_from_file_location("opweave_user_model", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report, don't crash
        raise OpWeaveError(f"{path}: failed to import ({type(e).__name__}: {e})") from None
    builder = getattr(module, "build_model", None)
    if not callable(builder):
        raise OpWeaveError(f"{path}: defines no build_model() function")
    try:
        model = builder()
    except Exception as e:
        raise OpWeaveError(f"{path}: build_model() failed ({type(e).__name__}: {e})") from None
    if not isinstance(model, CausalLM):
        raise OpWeaveError(f"{path}: build_model() returned {type(model).__name__}, not an opweave CausalLM "
                           "built from opweave.models operator modules")
    name = os.path.splitext(os.path.basename(path))[0]
    return ModelSource(name=model.cfg.name or name, kind="file", path=path, cfg=model.cfg, module=model)


def resolve(spec: str) -> ModelSource:
    """Resolves a MODEL argument (see module docstring). Raises OpWeaveError with a one-line reason."""
    if spec.endswith(".py"):
        if not os.path.isfile(spec):
            raise OpWeaveError(f"{spec}: no such file")
        return _from_file(spec)
    if os.path.isdir(spec):
        config = os.path.join(spec, "config.json")
        if not os.path.isfile(config):
            raise OpWeaveError(f"{spec}: not a model folder (no config.json)")
        name = os.path.basename(os.path.normpath(spec))
        cfg = config_from_hf(_read_json(config), name, where=config)
        return ModelSource(name=name, kind="checkpoint", path=spec, cfg=cfg)
    if spec.endswith(".json") and os.path.isfile(spec):
        name = os.path.splitext(os.path.basename(spec))[0]
        return ModelSource(name=name, kind="builtin", path=spec, cfg=config_from_hf(_read_json(spec), name, spec))
    key = spec.lower()
    if key in builtin_names():
        path = os.path.join(CONFIG_DIR, key + ".json")
        return ModelSource(name=key, kind="builtin", path=path, cfg=config_from_hf(_read_json(path), key))
    if os.path.sep in spec or os.path.exists(spec):
        raise OpWeaveError(f"{spec}: not a model folder, config.json or model.py")
    raise OpWeaveError(f"unknown model '{spec}' (known: {', '.join(builtin_names())}; "
                       "or give a checkpoint folder or a model.py)")
