"""CPU kernels in C: paged decode attention and paged cache writes that read each row's pages in
place (`paged_attention.c`), and the row-wise operators of a layer in one pass each (`rows.c`:
RMSNorm with and without its residual add, RoPE, silu(gate) * up).

The torch reference (`opweave.kernels.paged`) gathers a decode row's pages into a scratch copy
with `index_select`, then attends the copy with the CPU's fused attention kernel: every key and
value crosses memory three times, and a round of the CPU serving benchmark's model spent more
time there than in the attention itself. These kernels walk each row's block table and read
every key and value once (the layout and math of `paged.py`; OpenMP over rows and KV heads when
the rank has more than one thread). The reference's norms, RoPE and activation are five to twenty
tensor operations each, whose fixed costs dominate a small decode round and whose passes over
memory weigh on a prefill chunk. A prompt's first chunk attends itself with one causal call of
torch's fused attention (`causal_attention`); later chunks keep the torch path.

This module is the kernel interface (`opweave.kernels.KERNEL_NAMES`) of a CPU rank on the torch
backend: the C kernels where they apply, the reference for the rest. The C sources are compiled
together once per source, flags, compiler and CPU by the system C compiler (`cc`, `-O3 -march=native`,
no floating-point contraction) into the user's cache (`$XDG_CACHE_HOME/opweave`, else
`~/.cache/opweave`; a temporary folder where that cannot be written) and loaded with ctypes.
Where no compiler is found or it fails, or with OPWEAVE_CPU_KERNELS=0, or for anything but
float32 on the CPU (contiguous pools for the attention), every function here runs the torch
reference: results agree to float rounding either way, RoPE and the writes bit for bit
(`tests/test_cpu_kernels.py`). `status()` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch
import torch.nn.functional as F

from opweave import config
from opweave.kernels import paged as PK
from opweave.kernels import reference as K

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCES = tuple(os.path.join(_DIR, name) for name in ("paged_attention.c", "rows.c"))
_HEADERS = (os.path.join(_DIR, "opw_math.h"),)
MAX_PAGE = 64  # positions per page the C kernels take (paged_attention.c's MAX_PAGE)
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the C kernels are not in use (None: not tried yet, or loaded)
_tried = False

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


def _cpu_key() -> str:
    """What the compiled code depends on besides its source: the CPU's model and flags (-march=native)."""
    facts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    facts.append(line.strip())
                if len(facts) >= 3:
                    break
    except OSError:
        pass
    return "\n".join(facts)


def _cache_dir() -> str:
    folder = os.path.join(config.cache_root(), "cpu-kernels")
    try:
        os.makedirs(folder, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, delete=True)
        probe.close()
        return folder
    except OSError:
        folder = os.path.join(tempfile.gettempdir(), f"opweave-cpu-kernels-{os.getuid()}")
        os.makedirs(folder, exist_ok=True)
        return folder


def _compile(compiler: str, target: str) -> str | None:
    """Builds the shared library at `target` (written beside it, then renamed: ranks that build at
    once each get a whole file). Returns None, or the compiler's complaint."""
    tmp = f"{target}.{os.getpid()}.tmp"
    base = [compiler, *_FLAGS, "-I", _DIR, *_SOURCES, "-o", tmp, "-lm"]
    for flags in (["-fopenmp"], []):  # without OpenMP where its runtime is missing: one thread
        proc = subprocess.run(base[:1] + flags + base[1:], capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, target)
            return None
    if os.path.exists(tmp):
        os.remove(tmp)
    return (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]


def _load() -> ctypes.CDLL | None:
    global _lib, _why, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        compiler = config.c_compiler() or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            _why = "no C compiler (cc or gcc) on PATH"
            return None
        source = b""
        for path in _SOURCES + _HEADERS:
            with open(path, "rb") as f:
                source += f.read()
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
        facts = " ".join(_FLAGS) + version + _cpu_key()
        key = hashlib.sha256(source + facts.encode()).hexdigest()[:16]
        target = os.path.join(_cache_dir(), f"opweave-cpu-{key}.so")
        if not os.path.exists(target):
            err = _compile(compiler, target)
            if err is not None:
                _why = f"{compiler} failed: {err}"
                return None
        lib = ctypes.CDLL(target)
        lib.opw_paged_decode_f32.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _P, _INT, _INT, _INT, _INT,
                                             _INT, _INT, _INT, ctypes.c_float, _INT]
        lib.opw_paged_decode_f32.restype = None
        lib.opw_paged_write_f32.argtypes = [_P, _P, _P, _I64, _P, _P, _I64, _P, _INT, _INT, _I64, _INT, _INT, _I64]
        lib.opw_paged_write_f32.restype = None
        lib.opw_rms_norm_f32.argtypes = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _INT, ctypes.c_float, _INT, _INT]
        lib.opw_silu_mul_f32.argtypes = [_P, _I64, _P, _I64, _P, _I64, _INT, _INT]
        lib.opw_rope_f32.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _INT, _INT, _INT, _INT]
        for fn in (lib.opw_rms_norm_f32, lib.opw_silu_mul_f32, lib.opw_rope_f32):
            fn.restype = None
        _lib = lib
        return lib


def library() -> ctypes.CDLL | None:
    """The loaded C kernels, or None (see `status`)."""
    if not config.cpu_kernels_enabled():
        return None
    return _load()


def status() -> str:
    """One line: whether the C kernels are in use on CPU ranks, and why not."""
    if not config.cpu_kernels_enabled():
        return "off (OPWEAVE_CPU_KERNELS=0)"
    lib = _load()
    return "on" if lib is not None else f"off ({_why})"


def _usable(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _pools_ok(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor) -> bool:
    return (k_pages.is_contiguous() and v_pages.is_contiguous() and k_pages.shape[1] <= MAX_PAGE
            and table.dtype == torch.int32 and table.dim() == 2 and table.stride(1) == 1)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                           positions: torch.Tensor, scale: float, span: int,
                           sinks: torch.Tensor | None = None, value_dim: int | None = None) -> torch.Tensor:
    """`paged.paged_decode_attention` (same arguments and result); `value_dim`: only the first
    `value_dim` entries of each value row (MLA's latent part), [B, Hq, value_dim] out."""
    b, hq, d = q.shape
    hkv = k_pages.shape[2]
    lib = library() if _usable(q, k_pages, v_pages) else None
    if (lib is None or not _pools_ok(k_pages, v_pages, table)
            or hq % hkv or k_pages.shape[3] != d or positions.dtype != torch.int64 or positions.dim() != 1
            or (sinks is not None and sinks.shape != (hq,))):
        out = PK.paged_decode_attention(q, k_pages, v_pages, table, positions, scale, span, sinks)
        return out if value_dim is None else out[..., :value_dim]
    dv = d if value_dim is None else value_dim
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    sink = None if sinks is None else sinks.detach().float().contiguous()
    out = torch.empty(b, hq, dv, dtype=q.dtype)
    if b:
        lib.opw_paged_decode_f32(q.data_ptr(), q.stride(0), k_pages.data_ptr(), v_pages.data_ptr(),
                                 table.data_ptr(), table.stride(0), positions.data_ptr(), positions.stride(0),
                                 None if sink is None else sink.data_ptr(), out.data_ptr(), b, hq, hkv, d, dv,
                                 k_pages.shape[1], table.shape[1], float(scale), torch.get_num_threads())
    return out


def paged_cache_write(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, positions: torch.Tensor) -> None:
    """`paged.paged_cache_write` (same arguments and effect)."""
    b, t = positions.shape
    lib = library() if _usable(k_pages, v_pages, k, v) else None
    if (lib is None or not _pools_ok(k_pages, v_pages, table)
            or positions.dtype != torch.int64 or k.shape != v.shape or k.shape[2:] != k_pages.shape[2:]):
        return PK.paged_cache_write(k_pages, v_pages, table, k, v, positions)
    width = k_pages.shape[2] * k_pages.shape[3]

    def step(x: torch.Tensor) -> int:  # floats between consecutive tokens (row-major over B, T)
        return x.stride(1) if t > 1 else x.stride(0)

    rows = []
    for x in (k, v):  # [B, T, Hkv, D] as rows of `width` floats, one stride apart
        if not (x.stride(3) == 1 and x.stride(2) == x.shape[3]
                and (b == 1 or t == 1 or x.stride(0) == t * x.stride(1))):
            x = x.contiguous()
        rows.append(x)
    k, v = rows
    if step(k) != step(v):
        k, v = k.contiguous(), v.contiguous()
    positions = positions.contiguous()
    lib.opw_paged_write_f32(k_pages.data_ptr(), v_pages.data_ptr(), table.data_ptr(), table.stride(0), k.data_ptr(),
                            v.data_ptr(), step(k), positions.data_ptr(), b, t, width, k_pages.shape[1],
                            table.shape[1], k_pages.shape[0] - 1)


paged_chunk_attention = PK.paged_chunk_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt's first chunk attending itself, causally (what `paged_chunk_attention` computes for
    a row with nothing cached): q [1, T, Hq, D], k and v [1, T, Hkv, D] -> [1, T, Hq, D]. One call
    of torch's fused attention with its causal mask (GQA without copies), instead of the paged
    reference's key blocks, explicit masks and softmax merges."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


# the rest of the kernel interface (`opweave.kernels.KERNEL_NAMES`): the torch reference
decode_attention = K.decode_attention
gdn_step = K.gdn_step
moe_route = K.moe_route
moe_experts = K.moe_experts
moe_experts_swiglu = K.moe_experts_swiglu
argmax = K.argmax
mla_decode_attention = K.mla_decode_attention


# ---------------------------------------------------------------------------------------------- row kernels

def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x` [..., H] as [rows, H] rows one stride apart with unit steps within a row (a view where
    the layout allows one), or None when it has no elements."""
    if x.numel() == 0:
        return None
    r = x.reshape(-1, x.shape[-1])
    return r if r.stride(-1) == 1 else r.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """`reference.rms_norm` (same arguments and result) in one pass (`rows.c`)."""
    lib = library() if _usable(x, weight) else None
    rows = _rows(x) if lib is not None else None
    if rows is None or weight.shape != (x.shape[-1],):
        return K.rms_norm(x, weight, eps, offset)
    w = weight.detach().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.opw_rms_norm_f32(rows.data_ptr(), rows.stride(0), None, 0, None, w.data_ptr(), out.data_ptr(), rows.shape[0],
                         rows.shape[1], float(eps), int(bool(offset)), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_rms_norm`: (normed, summed), the add and the norm in one pass (`rows.c`)."""
    lib = library() if _usable(x, residual, weight) and x.shape == residual.shape else None
    rows = _rows(x) if lib is not None else None
    if rows is None or weight.shape != (x.shape[-1],):
        return K.add_rms_norm(x, residual, weight, eps, offset)
    res = _rows(residual)
    w = weight.detach().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype)
    lib.opw_rms_norm_f32(rows.data_ptr(), rows.stride(0), res.data_ptr(), res.stride(0), summed.data_ptr(),
                         w.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], float(eps), int(bool(offset)),
                         torch.get_num_threads())
    return out, summed


def gated_act(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """`reference.gated_act`: silu(gate) * up in one pass (`rows.c`); other activations: the reference."""
    lib = library() if kind == "silu" and _usable(gate, up) and gate.shape == up.shape else None
    g = _rows(gate) if lib is not None else None
    if g is None:
        return K.gated_act(gate, up, kind)
    u = _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib.opw_silu_mul_f32(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), g.shape[0], g.shape[1],
                         torch.get_num_threads())
    return out


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         rot_dim: int, attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rope` (same arguments and result): the cos and sin of the positions' frequencies
    by torch, as the reference computes them, then q's and k's heads rotated in one pass each
    (`rows.c`), the same products and sums."""
    lib = library() if _usable(q, k) and rot_dim % 2 == 0 and q.shape[:-2] == positions.shape else None
    if lib is None or k.shape[:-2] != positions.shape or q.shape[-1] != k.shape[-1] or q.numel() == 0 or k.numel() == 0:
        return K.rope(q, k, positions, inv_freq, rot_dim, attention_factor)
    freqs = positions.reshape(-1).clamp(min=0)[:, None].float() * inv_freq.float()  # [n, rot / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    n, d = freqs.shape[0], q.shape[-1]
    outs = []
    for x in (q, k):
        heads = x.shape[-2]
        v = x.reshape(n, heads, d)  # a view where the layout allows (a fused projection's columns)
        if v.stride(-1) != 1:
            v = v.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        lib.opw_rope_f32(v.data_ptr(), v.stride(0), v.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), n,
                         heads, d, rot_dim, torch.get_num_threads())
        outs.append(out)
    return outs[0], outs[1]


def paged_mla_decode_attention(q: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor,
                               positions: torch.Tensor, scale: float, rank: int, span: int) -> torch.Tensor:
    """`paged.paged_mla_decode_attention`: one pool as keys and values, the values' first `rank` entries."""
    pool = kv_pages[:, :, None, :]
    return paged_decode_attention(q, pool, pool, table, positions, scale, span, value_dim=rank)


def paged_mla_cache_write(kv_pages: torch.Tensor, table: torch.Tensor, kv: torch.Tensor,
                          positions: torch.Tensor) -> None:
    """`paged.paged_mla_cache_write`."""
    pool, rows = kv_pages[:, :, None, :], kv[:, :, None, :]
    paged_cache_write(pool, pool, table, rows, rows, positions)
