"""GPU targets of the Triton kernels: per-block shared memory by compute capability, and the launch
choices (block sizes, pipeline stages) that keep every kernel within it.

The per-block limit is the opt-in maximum of dynamic shared memory one thread block may use (CUDA C
Programming Guide, "Technical Specifications per Compute Capability": 163 KB on 8.0 and 8.7, 99 KB
on 8.6 and 8.9, 227 KB on 9.0 and 10.0, 99 KB on 12.0). At a launch on CUDA the limit comes from
the device (`torch.cuda.get_device_properties`: `shared_memory_per_block_optin` where torch has it,
else this table by compute capability); under the CPU interpreter there is no limit and the
launchers keep their default choice. `for_target` fixes the target for ahead-of-time compilation
(`aot.py`), which checks every choice made here against the compiler's own figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch

KIB = 1024

# opt-in shared memory per thread block, bytes, by (major, minor) compute capability
SMEM_PER_BLOCK = {
    (8, 0): 163 * KIB, (8, 6): 99 * KIB, (8, 7): 163 * KIB, (8, 9): 99 * KIB,
    (9, 0): 227 * KIB, (10, 0): 227 * KIB, (12, 0): 99 * KIB,
}

# compute capability of each GPU of the catalog (opweave/hardware/catalog.json; NVIDIA's CUDA GPU
# list: H100/H200 9.0, A100 8.0, L40S/L4 8.9, A10G 8.6, B200 10.0). `tests/test_kernels_aot.py`
# checks that every catalog GPU but "cpu" is here.
CATALOG_CAPABILITY = {
    "h100": (9, 0), "h100-pcie": (9, 0), "h200": (9, 0), "a100": (8, 0), "a100-40gb": (8, 0),
    "l40s": (8, 9), "l4": (8, 9), "a10g": (8, 6), "b200": (10, 0),
}

FP8_CAPABILITY = (8, 9)
"""float8 e4m3 conversions in Triton (`tl.float8e4nv`) need compute capability 8.9 (Ada, Hopper and
later); an `--kv-cache-dtype fp8` plan is refused on GPUs below it (A100, A10G)."""


def fp8_kv_supported(gpu: str) -> bool:
    """Whether catalog GPU `gpu` can keep an fp8 KV cache (the CPU always can: torch casts)."""
    return gpu == "cpu" or CATALOG_CAPABILITY.get(gpu, (0, 0)) >= FP8_CAPABILITY


_override: list[tuple[int, int]] = []  # the target of `for_target`, innermost last


def smem_limit(capability: tuple[int, int]) -> int:
    """Opt-in shared memory per block (bytes) of compute capability `capability`; an unknown
    capability gets the smallest limit of its major version (99 KiB if none is known)."""
    if capability in SMEM_PER_BLOCK:
        return SMEM_PER_BLOCK[capability]
    same_major = [v for (major, _), v in SMEM_PER_BLOCK.items() if major == capability[0]]
    return min(same_major) if same_major else 99 * KIB


@contextlib.contextmanager
def for_target(capability: tuple[int, int]) -> Iterator[None]:
    """Within the block, launchers choose for compute capability `capability` whatever the device."""
    _override.append(tuple(capability))
    try:
        yield
    finally:
        _override.pop()


def launch_smem_limit(device: torch.device) -> int | None:
    """The per-block shared-memory limit a launch on `device` must respect; None on a device
    without one (CPU, the interpreter), where launchers keep their default choice."""
    if _override:
        return smem_limit(_override[-1])
    if device.type != "cuda":
        return None
    return _cuda_smem_limit(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_smem_limit(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return int(optin) if optin else smem_limit((props.major, props.minor))


@dataclasses.dataclass(frozen=True)
class AttentionLaunch:
    """Decode attention's cache slots per iteration and software-pipeline depth."""

    block_n: int
    num_stages: int


# preferred first: the most cache bytes in flight, then the fewest iterations
_ATTN_CHOICES = ((64, 3), (64, 2), (32, 3), (32, 2), (16, 3), (16, 2), (16, 1))


def attention_smem_estimate(block_n: int, num_stages: int, block_d: int, elem_bytes: int) -> int:
    """Upper bound of decode attention's shared memory: K and V tiles for num_stages - 1 blocks in
    flight (one if not pipelined), plus the scratch of the tl.dot operand conversions, bounded by
    16 rows of block_d and 2048 elements (`aot.py` measures 16 rows and 1024 elements on
    sm_80/89/90: 74 KiB at block_n 64, 2 stages, head dim 256, bf16, where this gives 76 KiB;
    `tests/test_kernels_aot.py` checks the bound on every compiled choice)."""
    in_flight = max(num_stages - 1, 1)
    return ((2 * block_n * in_flight + 16) * block_d + 2048) * elem_bytes


# most bytes of one K (or V) tile [block_n, block_d] by element size: float32 operands take the
# FMA path of tl.dot, whose 32 KiB tiles spill registers on sm_80/89/90 (`aot.py`); 16-bit ones
# go to tensor cores and do not
_MAX_TILE_BYTES = {2: 32 * KIB, 4: 16 * KIB}


def attention_launch(block_d: int, elem_bytes: int, limit: int | None, max_block_n: int) -> AttentionLaunch:
    """The first choice of `_ATTN_CHOICES` whose K/V tile fits the register budget and whose
    shared-memory estimate fits `limit`. None (no GPU: the interpreter): `max_block_n` with
    Triton's default 3 stages. Block sizes never exceed `max_block_n` nor go below 16."""
    if limit is None:
        return AttentionLaunch(max_block_n, 3)
    max_tile = _MAX_TILE_BYTES.get(elem_bytes, 16 * KIB)
    for block_n, stages in _ATTN_CHOICES:
        if (block_n <= max_block_n and block_n * block_d * elem_bytes <= max_tile
                and attention_smem_estimate(block_n, stages, block_d, elem_bytes) <= limit):
            return AttentionLaunch(block_n, stages)
    return AttentionLaunch(min(16, max_block_n), 1)


# ---------------------------------------------------------------------------------------------- split-KV

# streaming multiprocessors assumed where the device has none to ask (the CPU interpreter, meta
# tensors of the ahead-of-time checks): small, so interpreted grids stay small
DEFAULT_SM_COUNT = 16
# decode-attention programs wanted per SM: several blocks in flight per SM hide HBM latency
ATTN_PROGRAMS_PER_SM = 4


def launch_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (CUDA: from its properties, read once per device and
    cached, no tensor read); `DEFAULT_SM_COUNT` anywhere else."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@dataclasses.dataclass(frozen=True)
class AttentionSplit:
    """How split-KV decode attention cuts a sequence's attended span: `splits` programs per (sequence,
    KV head), each over `split_len` consecutive positions (a multiple of the block size)."""

    splits: int
    split_len: int


def attention_split(batch: int, kv_heads: int, span: int, block_n: int, sm_count: int,
                    min_split: int) -> AttentionSplit:
    """Splits of a decode-attention launch, from static facts only (never from positions, so a
    launch reads no tensor on the host and can be captured in a CUDA graph).

    `span`: the most positions one sequence attends (cache slots, or the window if smaller). Enough
    splits for `ATTN_PROGRAMS_PER_SM` programs per SM over batch x KV heads, but no split shorter
    than `min_split` positions (each split writes a partial result the merge reads back); the split
    length is rounded up to a multiple of `block_n`, and the splits cover the span."""
    assert span > 0 and block_n > 0 and min_split > 0, (span, block_n, min_split)
    wanted = -(-ATTN_PROGRAMS_PER_SM * sm_count // max(batch * kv_heads, 1))
    splits = max(1, min(wanted, -(-span // min_split)))
    split_len = -(-(-(-span // splits)) // block_n) * block_n
    return AttentionSplit(-(-span // split_len), split_len)


# ---------------------------------------------------------------------------------------------- MLA decode

@dataclasses.dataclass(frozen=True)
class MLALaunch:
    """Latent-attention decode's cache slots per iteration, pipeline depth and warps."""

    block_n: int
    num_stages: int
    num_warps: int


def mla_smem_estimate(block_n: int, num_stages: int, block_r: int, elem_bytes: int) -> int:
    """Upper bound of `_mla_decode_kernel`'s shared memory: the latent + rope-key tiles of
    num_stages - 1 blocks in flight (one if not pipelined; the rope key bounded by block_r / 4
    columns, 64 at rank 512, never below 16), the 16-head query tile and the probability tile."""
    in_flight = max(num_stages - 1, 1)
    rope = max(16, block_r // 4)
    return (block_n * (block_r + rope) * in_flight + 16 * (block_r + rope) + 16 * block_n + 2048) * elem_bytes


def mla_launch(block_r: int, elem_bytes: int, limit: int | None, max_block_n: int) -> MLALaunch:
    """The largest block of cache slots (64, 32, 16) whose latent tile [block_n, block_r] fits the
    register budget of `_MAX_TILE_BYTES`, with 2 stages when `mla_smem_estimate` fits `limit` (else
    1); 8 warps at rank >= 256 (the [16, rank] float32 accumulator), else 4. None (no GPU: the
    interpreter): `max_block_n`, 3 stages, 4 warps."""
    if limit is None:
        return MLALaunch(max_block_n, 3, 4)
    warps = 8 if block_r >= 256 else 4
    max_tile = _MAX_TILE_BYTES.get(elem_bytes, 16 * KIB)
    for block_n in (64, 32, 16):
        if block_n <= max_block_n and (block_n * block_r * elem_bytes <= max_tile or block_n == 16):
            stages = 2 if mla_smem_estimate(block_n, 2, block_r, elem_bytes) <= limit else 1
            return MLALaunch(block_n, stages, warps)
    return MLALaunch(min(16, max_block_n), 1, warps)
