"""Reading Hugging Face safetensors checkpoints, one tensor at a time.

`CheckpointReader` maps tensor names to files (from `model.safetensors.index.json` when the
checkpoint is sharded, else by listing each `*.safetensors` file's keys) and reads a tensor only
when asked, so a worker that owns a few operators reads only their weights.

Every file is checked to be a regular file before it is opened: a FIFO or a device named like a
weight file would block `open` (or read forever), so it is refused by name instead. Every error
names the file (and the tensor) concerned.

Published block-quantized checkpoints are read dequantized (`opweave.models.quantized`): an fp8
`X.weight` with its `X.weight_scale_inv` block scales (DeepSeek-V3, Kimi-K2), and GPT-OSS's MXFP4
experts, whose `P_blocks` / `P_scales` the reader serves as the dense tensor `P`. `get` and
`get_slice` return float32 (exact; the operator casts it to the model's dtype on load) unless asked
for a `dtype`, and a slice reads only the values and scales its rows need.
"""

from __future__ import annotations

import json
import os
import re
import stat

import torch

from opweave.errors import OpWeaveError
from opweave.models import quantized as Q

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
    """Tensors of a safetensors checkpoint folder by name (see the module docstring).

    Args:
        folder: the checkpoint folder.
        dtype: the dtype of dequantized tensors (fp8 / MXFP4 ones; default float32, exact);
            other tensors are returned as stored.
    """

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32):
        from safetensors import safe_open  # imported here: only weight loading needs it

        self._safe_open = safe_open
        self.folder = folder
        self.dtype = dtype
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
        self._block = self._fp8_block()

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
        for key in self.key_to_file:  # MXFP4: the dense name of P_blocks / P_scales is P
            if key.endswith(Q.MXFP4_BLOCKS) and key[:-len(Q.MXFP4_BLOCKS)] not in self.key_to_file:
                out.setdefault(key[:-len(Q.MXFP4_BLOCKS)], key)
        return out

    def _fp8_block(self) -> tuple[int, int]:
        """The fp8 scale block of config.json's quantization_config (`weight_block_size`), else 128 x 128."""
        path = os.path.join(self.folder, "config.json")
        if not os.path.isfile(path):  # absent, or not a regular file (never opened: a FIFO would block)
            return Q.FP8_BLOCK
        try:
            with open(path, encoding="utf-8") as f:
                quant = json.load(f).get("quantization_config") or {}
            block = tuple(int(b) for b in quant.get("weight_block_size") or Q.FP8_BLOCK)
        except (OSError, ValueError, TypeError, AttributeError):  # no / odd config: the hub's block
            return Q.FP8_BLOCK
        return block if len(block) == 2 and min(block) > 0 else Q.FP8_BLOCK

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

    @staticmethod
    def _mxfp4(key: str, real: str) -> bool:
        """Whether `key` is read as the dense tensor of MXFP4 `real` (`P` of `P_blocks`)."""
        return real.endswith(Q.MXFP4_BLOCKS) and not key.endswith(Q.MXFP4_BLOCKS)

    def _dense_shape(self, key: str, real: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `key` is read as: the stored one, or an MXFP4 tensor's dense shape."""
        if not self._mxfp4(key, real):
            return shape
        try:
            return Q.mxfp4_dense_shape(shape, real[:-len(Q.MXFP4_BLOCKS)])
        except OpWeaveError as e:
            raise OpWeaveError(f"{self.folder}: {e}") from None

    def _header(self, real: str) -> tuple[tuple[int, ...], str]:
        """Shape and safetensors dtype name ("F8_E4M3", "U8", ...) of a stored tensor."""
        with self._open_holding(real) as f:
            part = f.get_slice(real)
            return tuple(part.get_shape()), part.get_dtype()

    def _stored(self, real: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        with self._open_holding(real) as f:
            return f.get_tensor(real) if index is None else f.get_slice(real)[index]

    def _scale_key(self, scale: str, real: str, owner: str) -> str:
        """`scale`, the scale tensor of quantized tensor `real`; a one-line error when it is missing."""
        if scale not in self.key_to_file:
            raise OpWeaveError(f"{self.folder}: tensor '{owner}' is stored quantized ('{real}') but the "
                               f"checkpoint has no scale tensor '{scale}'")
        return scale

    def shape(self, key: str) -> tuple[int, ...]:
        real = self._require(key)
        shape, _ = self._header(real)
        return self._dense_shape(key, real, shape)

    def get_slice(self, key: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reads only rows [start, stop) of dimension `dim` (a tensor-parallel shard); a quantized
        tensor reads only those rows' values and scales, and is returned dequantized (`dtype`)."""
        real = self._require(key)
        shape, stored = self._header(real)
        if self._mxfp4(key, real) or stored.startswith("F8"):
            tensor = self._dequantized(key, real, shape, stored, (dim, start, stop), dtype)
        else:
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            tensor = self._floating(real, self._stored(real, index))
        self.num_reads += 1
        return tensor

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

    def _dequantized(self, key: str, real: str, shape: tuple[int, ...], stored: str,
                     part: tuple[int, int, int] | None, dtype: torch.dtype | None) -> torch.Tensor:
        """Quantized tensor `real` (header `shape`, `stored` dtype), whole or rows [start, stop) of
        one dimension (`part`), dequantized to `dtype` (default: the reader's)."""
        try:
            return self._dequantize(key, real, shape, stored, part, dtype or self.dtype)
        except OpWeaveError as e:  # the format's one-line errors, with the checkpoint named
            message = str(e)
            raise OpWeaveError(message if message.startswith(self.folder) else f"{self.folder}: {message}") from None

    def _mxfp4_keys(self, key: str, real: str, shape: tuple[int, ...], stored: str, where: str) -> tuple[str, str]:
        """(the dense name, its scales' key) of MXFP4 blocks `real`, their dtype and shapes checked
        (`where` prefixes the dtype error)."""
        dense = real[:-len(Q.MXFP4_BLOCKS)]
        scales = self._scale_key(dense + Q.MXFP4_SCALES, real, key)
        if stored != "U8":
            raise OpWeaveError(f"{where}tensor '{real}' has dtype {stored}; MXFP4 blocks are U8 (uint8)")
        Q.check_mxfp4(dense, shape, self._header(scales)[0])
        return dense, scales

    def _dequantize(self, key: str, real: str, shape: tuple[int, ...], stored: str,
                    part: tuple[int, int, int] | None, dtype: torch.dtype) -> torch.Tensor:
        if self._mxfp4(key, real):
            dense, scales = self._mxfp4_keys(key, real, shape, stored, f"{self.folder}: ")
            if part is None:
                return Q.dequantize_mxfp4(self._stored(real, None), self._stored(scales, None), dtype=dtype, name=dense)
            read = Q.mxfp4_read(shape, *part)
            out = Q.dequantize_mxfp4(self._stored(real, read.values), self._stored(scales, read.scales),
                                     dtype=dtype, name=dense)
            return out if read.cut is None else out.narrow(*read.cut).contiguous()
        if stored != "F8_E4M3":
            raise OpWeaveError(f"{self.folder}: tensor '{real}' has dtype {stored}; OpWeave reads float8 weights "
                               "as e4m3 with 128x128 block scales (quantization_config fp8) only")
        scales = self._scale_key(real + Q.FP8_SCALE_SUFFIX, real, key)
        Q.check_fp8(real, shape, self._header(scales)[0], self._block)
        if part is None:
            return Q.dequantize_fp8(self._stored(real, None), self._stored(scales, None), self._block,
                                    dtype=dtype, name=real)
        read = Q.fp8_read(shape, *part, block=self._block)
        row0 = read.offset if read.dim == len(shape) - 2 else 0
        col0 = read.offset if read.dim == len(shape) - 1 else 0
        return Q.dequantize_fp8(self._stored(real, read.values), self._stored(scales, read.scales), self._block,
                                row0=row0, col0=col0, dtype=dtype, name=real)

    def stored(self, key: str) -> bool:
        """Whether tensor `key` (its dense name) is stored quantized: fp8 with block scales or MXFP4."""
        real = self._require(key)
        return self._mxfp4(key, real) or self._header(real)[1].startswith("F8")

    def get_stored(self, key: str, part: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized tensor `key` (its dense name) as stored, not dequantized: (values, scales).

        fp8: the e4m3 values' bytes (uint8, the dense shape) and `weight_scale_inv` (float32);
        MXFP4: `P_blocks` (uint8 [..., N, G, 16]) and `P_scales` (uint8 [..., N, G]). `part`
        (dim, start, stop) of the dense tensor reads only those rows and their scales; it must
        cover whole quantization blocks (start on a block's first row, stop on a block's end or the
        dimension's), as the TP table splits quantized weights (`ir.tp.QUANT_BLOCK`)."""
        real = self._require(key)
        shape, stored = self._header(real)
        try:
            if self._mxfp4(key, real):
                dense, scales = self._mxfp4_keys(key, real, shape, stored, "")
                read = Q.mxfp4_read(shape, *part) if part is not None else None
                if read is not None and read.cut is not None and (read.cut[1] or read.cut[2] % Q.MXFP4_GROUP):
                    raise OpWeaveError(f"tensor '{key}': rows {part[1]}..{part[2]} of dimension {part[0]} are not "
                                       f"whole groups of {Q.MXFP4_GROUP} (its scales' blocks)")
                index = (None, None) if read is None else (read.values, read.scales)
            elif stored == "F8_E4M3":
                scales = self._scale_key(real + Q.FP8_SCALE_SUFFIX, real, key)
                Q.check_fp8(real, shape, self._header(scales)[0], self._block)
                read = Q.fp8_read(shape, *part, block=self._block) if part is not None else None
                if read is not None and read.dim is not None:
                    b, (dim, start, stop) = self._block[read.dim - (len(shape) - 2)], part
                    if start % b or (stop % b and stop != shape[dim]):
                        raise OpWeaveError(f"tensor '{key}': rows {start}..{stop} of dimension {dim} are not whole "
                                           f"{self._block[0]}x{self._block[1]} blocks (its scales')")
                index = (None, None) if read is None else (read.values, read.scales)
            else:
                raise OpWeaveError(f"tensor '{key}' is not stored quantized (dtype {stored})")
        except OpWeaveError as e:
            message = str(e)
            raise OpWeaveError(message if message.startswith(self.folder) else f"{self.folder}: {message}") from None
        values = self._stored(real, index[0])
        self.num_reads += 1
        return (values.view(torch.uint8) if values.dtype == torch.float8_e4m3fn else values,
                self._stored(scales, index[1]))

    def get(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reads one tensor; checks its shape when `shape` is given. A quantized tensor (fp8 with
        block scales, MXFP4) is returned dequantized, in `dtype` (default: the reader's)."""
        real = self._require(key)
        stored_shape, stored = self._header(real)
        quantized = self._mxfp4(key, real) or stored.startswith("F8")
        full = self._dense_shape(key, real, stored_shape)
        if shape is not None and tuple(full) != tuple(shape):
            raise OpWeaveError(f"{self.folder}: tensor '{key}' has shape {tuple(full)}, "
                               f"the config implies {tuple(shape)}")
        if quantized:
            tensor = self._dequantized(key, real, stored_shape, stored, None, dtype)
        else:
            tensor = self._floating(real, self._stored(real, None))
        self.num_reads += 1
        return tensor
