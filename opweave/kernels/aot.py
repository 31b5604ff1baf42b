"""Ahead-of-time compilation of the Triton kernels for real GPUs, on a machine without one.

Each kernel is compiled with the specialisations its launcher really uses: the wrappers of
`triton_kernels` are called on meta tensors of model-sized shapes (head dims 64/128/256, the dtypes
bf16/fp16/fp32) with every `@triton.jit` kernel replaced by a recorder, so the constexprs, block
sizes, num_warps and num_stages are the launcher's own choice for the target (`targets.for_target`).
Arguments are specialised like a real launch: pointers 16-byte aligned, integers divisible by 16
marked `tt.divisibility` 16, integers equal to 1 made constants. The compiled kernel gives the
shared memory per block; the bundled `ptxas -v` gives registers and spill bytes (None where no
bundled ptxas accepts the PTX).

    python -m opweave.kernels.aot [--summary] [--arch 80,89,90] [--dtype bf16,fp16,fp32]
                                  [--kernel NAME,...] [--json PATH]

prints one row per compilation and exits 1 when a kernel exceeds its target's per-block shared
memory or spills registers (`docs/kernels.md`, "Ahead-of-time checks"). Needs TRITON_INTERPRET
unset: the interpreter's kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

from opweave import config
from opweave.errors import OpWeaveError
from opweave.kernels import targets

ARCHS = {80: (8, 0), 89: (8, 9), 90: (9, 0)}  # sm_XX -> compute capability (A100; L40S, L4; H100, H200)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
_PTR_TYPES = {torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
              torch.int32: "i32", torch.uint8: "u8"}
_DEFAULT_WARPS, _DEFAULT_STAGES = 4, 3  # Triton's CUDA defaults when a launcher passes none


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch: the kernel and its bound arguments."""

    kernel: object  # triton JITFunction
    args: dict  # parameter name -> value (tensors, ints, floats, constexprs)
    num_warps: int
    num_stages: int


@dataclasses.dataclass
class Result:
    """One compilation: what, for which target, and the compiler's figures."""

    kernel: str
    case: str
    dtype: str
    sm: int
    num_warps: int
    num_stages: int
    constexprs: str
    shared: int  # bytes per block
    smem_limit: int  # bytes per block the target allows
    registers: int | None  # per thread (None: no ptxas ran)
    spill_bytes: int | None  # spill stores + loads
    seconds: float

    def problems(self) -> list[str]:
        out = []
        if self.shared > self.smem_limit:
            out.append(f"shared memory {self.shared / 1024:.1f} KiB > {self.smem_limit // 1024} KiB")
        if self.spill_bytes:
            out.append(f"{self.spill_bytes} bytes of register spills")
        return out


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, sink: list[Launch]):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, num_warps=_DEFAULT_WARPS, num_stages=_DEFAULT_STAGES, **kwargs):
            names = self.kernel.arg_names
            bound = dict(zip(names, args))
            bound.update(kwargs)
            assert set(bound) == set(names), f"{self.kernel.__name__}: arguments {sorted(bound)} != {names}"
            self.sink.append(Launch(self.kernel, bound, num_warps, num_stages))
        return launch


def record(call: Callable[[], object]) -> list[Launch]:
    """The kernel launches `call` makes (it calls `triton_kernels` wrappers, typically on meta tensors)."""
    import triton

    from opweave.kernels import triton_kernels as tk

    sink: list[Launch] = []
    jitted = [(module, name, obj) for module in tk.FAMILIES for name, obj in vars(module).items()
              if isinstance(obj, triton.runtime.jit.KernelInterface)]
    try:
        for module, name, obj in jitted:
            setattr(module, name, _Recorder(obj, sink))
        call()
    finally:
        for module, name, obj in jitted:
            setattr(module, name, obj)
    return sink


def _params(kernel) -> list[tuple[str, bool]]:
    """(name, is constexpr) per parameter, from the annotations Triton reads (JIT or interpreted)."""
    params = inspect.signature(kernel.fn).parameters.values()
    return [(p.name, "constexpr" in str(p.annotation)) for p in params]


def specialise(launch: Launch) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `launch` for `triton.compiler.ASTSource`, specialised the
    way Triton's launcher specialises real arguments."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, is_constexpr) in enumerate(_params(launch.kernel)):
        value = launch.args[name]
        if is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _PTR_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constexprs, attrs


def compile_launch(launch: Launch, sm: int):
    """`triton.compile` of `launch` for sm_`sm` (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialise(launch)
    src = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", sm, 32),
                          options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})


def _ptxas_candidates(sm: int) -> list[str]:
    """Bundled ptxas binaries, the one Triton itself uses for sm_`sm` first (API differs by version)."""
    found = []
    try:  # triton >= 3.7
        from triton.backends.nvidia.compiler import get_ptxas
        found.append(get_ptxas(sm).path)
    except (ImportError, AttributeError, TypeError):
        pass
    try:  # triton 3.x knobs
        from triton import knobs
        found.append(knobs.nvidia.ptxas.path)
    except (ImportError, AttributeError):
        pass
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found += [os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")]
    return [p for i, p in enumerate(found) if p and os.path.isfile(p) and p not in found[:i]]


def ptxas_usage(ptx: str, sm: int) -> tuple[int, int] | None:
    """(registers per thread, spill bytes) from `ptxas -v`, or None when no bundled ptxas accepts it."""
    arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w", encoding="utf-8") as f:
            f.write(ptx)
        for ptxas in _ptxas_candidates(sm):
            proc = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True, check=False)
            regs = re.search(r"Used (\d+) registers", proc.stderr + proc.stdout)
            if proc.returncode == 0 and regs:
                text = proc.stderr + proc.stdout
                spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
                return int(regs.group(1)), spills
    return None


def _meta(*shape, dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def cases(dtype: torch.dtype, head_dims=HEAD_DIMS) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call) per launcher use at model-sized shapes: batch 8, hidden 4096, 32 query and
    8 kv heads, a 4096-slot cache (and batch 1 at 131072 slots), Qwen3-Next's Gated-DeltaNet and MoE (512 experts, top 10),
    vocabulary 151936; the paged KV cache's kernels on pools of 16-slot pages, 256 table entries a
    row (a decode step, a 512-token prefill chunk, a cache write; GPT-OSS's sinks at head dim 64);
    DeepSeek-V3's latent attention (128 heads, rank 512, rope 64) on a ring and on 16-slot pages;
    block-scaled GEMMs over weights in their stored formats (DeepSeek-V3's fp8 gate/up projection,
    GPT-OSS's MXFP4 expert gate/up projection) and the grouped experts over them."""
    from opweave.kernels import triton_kernels as tk

    m = lambda *shape, dt=dtype: _meta(*shape, dtype=dt)  # noqa: E731
    pos = m(8, dt=torch.int64)
    f32 = torch.float32
    pool = lambda d: m(8 * 256 + 1, 16, 8, d)  # noqa: E731  paged KV: 8 rows of 256 pages of 16 slots, + null
    table = m(8, 256, dt=torch.int32)
    yield "hidden 4096", lambda: tk.rms_norm(m(8, 4096), m(4096), 1e-6, True)
    yield "add + norm hidden 4096", lambda: tk.add_rms_norm(m(8, 4096), m(8, 4096), m(4096), 1e-6, True)
    for d in head_dims:
        yield f"qk-norm D {d}", lambda d=d: tk.rms_norm(m(8, 32, d), m(d), 1e-6, False)
        yield f"D {d}", lambda d=d: tk.rope(m(8, 32, d), m(8, 8, d), pos, m(d // 2, dt=f32), d)
        yield f"D {d}, GQA 4, L 4096", lambda d=d: tk.decode_attention(
            m(8, 32, d), m(8, 4096, 8, d), m(8, 4096, 8, d), pos, d ** -0.5, None)
        # batch 1 at 128K: several KV splits per head (the batch-8 case may take one), so the merge
        # kernel is also compiled for a split count known only at launch
        yield f"D {d}, GQA 4, L 131072, batch 1", lambda d=d: tk.decode_attention(
            m(1, 32, d), m(1, 131072, 8, d), m(1, 131072, 8, d), pos[:1], d ** -0.5, None)
        # paged KV cache: 16-slot pages, 256 table entries (4096 positions) per row; a decode step,
        # a prefill chunk of 512 tokens over a cached prefix, and a decode step's cache write
        yield f"paged D {d}, GQA 4, page 16, W 256", lambda d=d: tk.paged_decode_attention(
            m(8, 32, d), pool(d), pool(d), table, pos, d ** -0.5, 256)
        yield f"paged D {d}, GQA 4, page 16, W 256, chunk 512", lambda d=d: tk.paged_chunk_attention(
            m(2, 512, 32, d), m(2, 512, 8, d), m(2, 512, 8, d), pool(d), pool(d), table[:2],
            m(2, 512, dt=torch.int64), d ** -0.5, 256)
        yield f"paged D {d}, Hkv 8, page 16, W 256, write", lambda d=d: tk.paged_cache_write(
            pool(d), pool(d), table, m(8, 1, 8, d), m(8, 1, 8, d), m(8, 1, dt=torch.int64))
    # GPT-OSS on the paged cache: sink logits in the decode merge and the chunk's softmax
    yield "paged D 64, GQA 8, page 16, W 256, sinks", lambda: tk.paged_decode_attention(
        m(8, 64, 64), pool(64), pool(64), table, pos, 64 ** -0.5, 256, m(64))
    yield "paged D 64, GQA 8, page 16, W 256, chunk 512, sinks", lambda: tk.paged_chunk_attention(
        m(2, 512, 64, 64), m(2, 512, 8, 64), m(2, 512, 8, 64), pool(64), pool(64), table[:2],
        m(2, 512, dt=torch.int64), 64 ** -0.5, 256, m(64))
    if dtype != torch.float32:  # `--kv-cache-dtype fp8`: the pools in float8 e4m3 (sm_89 and later, `run`)
        f8 = lambda *shape: _meta(*shape, dtype=torch.float8_e4m3fn)  # noqa: E731
        fpool = f8(8 * 256 + 1, 16, 8, 128)
        yield "fp8 KV paged D 128, GQA 4, page 16, W 256", lambda: tk.paged_decode_attention(
            m(8, 32, 128), fpool, fpool, table, pos, 128 ** -0.5, 256)
        yield "fp8 KV paged D 128, GQA 4, page 16, W 256, chunk 512", lambda: tk.paged_chunk_attention(
            m(2, 512, 32, 128), m(2, 512, 8, 128), m(2, 512, 8, 128), fpool, fpool, table[:2],
            m(2, 512, dt=torch.int64), 128 ** -0.5, 256)
        yield "fp8 KV paged D 128, Hkv 8, page 16, W 256, write", lambda: tk.paged_cache_write(
            fpool, fpool, table, m(8, 1, 8, 128), m(8, 1, 8, 128), m(8, 1, dt=torch.int64))
        yield "fp8 KV D 128, GQA 4, L 4096, window 1024", lambda: tk.decode_attention(
            m(8, 32, 128), f8(8, 4096, 8, 128), f8(8, 4096, 8, 128), pos, 128 ** -0.5, 1024)
        yield "fp8 KV MLA H 128, R 512, P 64, L 4096", lambda: tk.mla_decode_attention(
            m(8, 128, 576), f8(8, 4096, 576), pos, 192 ** -0.5, 512)
        yield "fp8 KV paged MLA H 128, R 512, P 64, page 16, W 256", lambda: tk.paged_mla_decode_attention(
            m(8, 128, 576), f8(8 * 256 + 1, 16, 576), table, pos, 192 ** -0.5, 512, 256)
    yield "partial rotary D 256 / 64", lambda: tk.rope(m(8, 16, 256), m(8, 2, 256), pos, m(32, dt=f32), 64)
    yield "Dk 128, Dv 128", lambda: tk.gdn_step(m(8, 16, 128), m(8, 16, 128), m(8, 32, 128), m(8, 32, dt=f32),
                                                m(8, 32, dt=f32), m(8, 32, 128, 128, dt=f32), pos)
    yield "I 14336", lambda: tk.gated_act(m(8, 14336), m(8, 14336), "silu")
    yield "E 512, top 10", lambda: tk.moe_route(m(8, 512), 10, True)
    yield "H 2048, I 512, E 512, top 10", lambda: tk.moe_experts(
        m(8, 2048), m(8, 10), m(8, 10, dt=torch.int64), m(512, 1024, 2048), m(512, 2048, 512))
    # Mixtral's 8 experts, top 2: the grouped kernels' larger blocks (16 pairs an expert at batch
    # 64: blocks of 32; 64 at batch 256: blocks of 128, `moe_block_m`)
    for batch in (64, 256):
        yield f"H 4096, I 14336, E 8, top 2, batch {batch}", lambda b=batch: tk.moe_experts(
            m(b, 4096), m(b, 2), m(b, 2, dt=torch.int64), m(8, 28672, 4096), m(8, 4096, 14336))
    yield "V 151936", lambda: tk.argmax(m(8, 151936))
    # GPT-OSS: sink logits in the split merge (window 128), clamped-SwiGLU experts with biases
    yield "D 64, GQA 8, L 4096, window 128, sinks", lambda: tk.decode_attention(
        m(8, 64, 64), m(8, 4096, 8, 64), m(8, 4096, 8, 64), pos, 64 ** -0.5, 128, m(64))
    yield "H 2880, I 2880, E 128, top 4, biases", lambda: tk.moe_experts_swiglu(
        m(8, 2880), m(8, 4), m(8, 4, dt=torch.int64), m(128, 2880, 5760), m(128, 5760), m(128, 2880, 2880),
        m(128, 2880), 1.702, 7.0)
    # DeepSeek-V3's latent attention: 128 heads, latent 512 + rope key 64 per cached position
    yield "MLA H 128, R 512, P 64, L 4096", lambda: tk.mla_decode_attention(
        m(8, 128, 576), m(8, 4096, 576), pos, 192 ** -0.5, 512)
    # the same over paged latent rows: 16-slot pages, 256 table entries (4096 positions) per row
    yield "paged MLA H 128, R 512, P 64, page 16, W 256", lambda: tk.paged_mla_decode_attention(
        m(8, 128, 576), m(8 * 256 + 1, 16, 576), table, pos, 192 ** -0.5, 512, 256)
    # weights in their published quantized formats, dequantized in registers: DeepSeek-V3's fp8
    # (bytes) with 128 x 128 block scales, GPT-OSS's MXFP4 (two 4-bit values a byte, a scale per 32)
    u8 = torch.uint8
    yield "fp8 weights N 18432, K 7168", lambda: tk.fp8_block_linear(m(8, 7168), _meta(18432, 7168, dtype=u8),
                                                                     _meta(144, 56, dtype=f32))
    yield "MXFP4 weights N 5760, K 2880", lambda: tk.mxfp4_linear(m(8, 2880), _meta(5760, 90, 16, dtype=u8),
                                                                  _meta(5760, 90, dtype=u8))
    # the grouped experts over the same stored formats: a DeepSeek-V3 expert-parallel shard (32 of
    # 256 experts, top 8), GPT-OSS-120B's 128 MXFP4 experts (top 4):
    # a decode step (8 tokens: blocks of 16 pairs, 64-wide tiles) and a prefill chunk (512 tokens: 128
    # pairs, the widest blocks) of the fp8 shard; GPT-OSS at 8 and 4096 tokens (16 and 128 pairs)
    for batch in (8, 512):
        yield f"fp8 experts H 7168, I 2048, E 32, top 8, batch {batch}", lambda b=batch: tk.moe_experts_fp8(
            m(b, 7168), m(b, 8), m(b, 8, dt=torch.int64), _meta(32, 4096, 7168, dtype=u8),
            _meta(32, 32, 56, dtype=f32), _meta(32, 7168, 2048, dtype=u8), _meta(32, 56, 16, dtype=f32))
    for batch in (8, 4096):
        yield (f"MXFP4 experts H 2880, I 2880, E 128, top 4, biases" + (f", batch {batch}" if batch != 8 else ""),
               lambda b=batch: tk.moe_experts_swiglu_mxfp4(
                   m(b, 2880), m(b, 4), m(b, 4, dt=torch.int64), _meta(128, 5760, 90, 16, dtype=u8),
                   _meta(128, 5760, 90, dtype=u8), m(128, 5760), _meta(128, 2880, 90, 16, dtype=u8),
                   _meta(128, 2880, 90, dtype=u8), m(128, 2880), 1.702, 7.0))


def _describe_constexprs(launch: Launch) -> str:
    keep = [n for n, is_constexpr in _params(launch.kernel) if is_constexpr and n.startswith("BLOCK")]
    return " ".join(f"{n.removeprefix('BLOCK_')}={launch.args[n]}" for n in keep)


def kernel_names() -> list[str]:
    """The `@triton.jit` kernels the launchers call (helpers they inline are not compiled alone)."""
    import triton

    from opweave.kernels import triton_kernels as tk

    return sorted(name for module in tk.FAMILIES for name, obj in vars(module).items()
                  if isinstance(obj, triton.runtime.jit.KernelInterface) and name.endswith("_kernel"))


def _check_request(archs, dtypes, kernels) -> None:
    for sm in archs:
        if sm not in ARCHS:
            raise OpWeaveError(f"unknown target sm_{sm} (supported: {', '.join(f'sm_{a}' for a in ARCHS)})")
    for dname in dtypes:
        if dname not in DTYPES:
            raise OpWeaveError(f"unknown dtype '{dname}' (supported: {', '.join(DTYPES)})")
    unknown = sorted(set(kernels or ()) - set(kernel_names()))
    if unknown:
        raise OpWeaveError(f"unknown kernel {', '.join(unknown)} (kernels: {', '.join(kernel_names())})")


def run(archs=tuple(ARCHS), dtypes=tuple(DTYPES), head_dims=HEAD_DIMS, kernels: set[str] | None = None,
        progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Compile every kernel launch of `cases` for each target; one `Result` per distinct compilation."""
    _check_request(archs, dtypes, kernels)
    if config.triton_interpret():
        raise OpWeaveError("ahead-of-time compilation needs real Triton kernels: unset TRITON_INTERPRET")
    results, seen = [], set()
    for sm in archs:
        limit = targets.smem_limit(ARCHS[sm])
        for dname in dtypes:
            for label, call in cases(DTYPES[dname], head_dims):
                if label.startswith("fp8 KV") and ARCHS[sm] < targets.FP8_CAPABILITY:
                    continue  # no float8 conversions there: compile refuses such a plan
                with targets.for_target(ARCHS[sm]):
                    launches = record(call)
                for launch in launches:
                    name = launch.kernel.__name__
                    if kernels is not None and name not in kernels:
                        continue
                    key = (sm, name, repr(specialise(launch)), launch.num_warps, launch.num_stages)
                    if key in seen:
                        continue
                    seen.add(key)
                    start = time.perf_counter()
                    compiled = compile_launch(launch, sm)
                    usage = ptxas_usage(compiled.asm["ptx"], sm)
                    res = Result(name, label, dname, sm, launch.num_warps, launch.num_stages,
                                 _describe_constexprs(launch), int(compiled.metadata.shared), limit,
                                 usage[0] if usage else None, usage[1] if usage else None,
                                 time.perf_counter() - start)
                    results.append(res)
                    if progress:
                        progress(res)
    return results


def format_table(results: list[Result]) -> str:
    """A Markdown table: one row per compilation, shared memory against the target's limit."""
    rows = ["| kernel | case | dtype | target | warps/stages | blocks | shared KiB (limit) | registers | spills |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        regs = "n/a" if r.registers is None else str(r.registers)
        spills = "n/a" if r.spill_bytes is None else str(r.spill_bytes)
        flag = " **over**" if r.shared > r.smem_limit else ""
        rows.append(f"| `{r.kernel}` | {r.case} | {r.dtype} | sm_{r.sm} | {r.num_warps}/{r.num_stages} | "
                    f"{r.constexprs} | {r.shared / 1024:.1f} ({r.smem_limit // 1024}){flag} | {regs} | {spills} |")
    return "\n".join(rows)


def format_summary(results: list[Result]) -> str:
    """A Markdown table of shared memory (KiB) with one column per target, per kernel, case and
    dtype (dtypes with equal figures share a row); a target's block choice where targets differ;
    the most registers and spill bytes over the row's compilations."""
    archs = sorted({r.sm for r in results})
    by_row: dict[tuple[str, str], dict[str, dict[int, Result]]] = {}
    for r in results:
        by_row.setdefault((r.kernel, r.case), {}).setdefault(r.dtype, {})[r.sm] = r
    head = ("| kernel | case | dtype | " + " | ".join(f"sm_{a} (limit {targets.smem_limit(ARCHS[a]) // 1024})"
                                                    for a in archs) + " | registers | spills |")
    rows = [head, "|" + "---|" * (5 + len(archs))]
    order = list(dict.fromkeys(r.kernel for r in results))
    for (kernel, case), by_dtype in sorted(by_row.items(), key=lambda item: order.index(item[0][0])):
        groups: dict[tuple, list[Result]] = {}
        for dtype, per_arch in by_dtype.items():
            rs = [per_arch[a] for a in archs if a in per_arch]
            choices = {(r.constexprs, r.num_warps, r.num_stages) for r in rs}
            cells = tuple(f"{r.shared / 1024:.1f}" + (" **over**" if r.shared > r.smem_limit else "")
                          + (f" ({r.constexprs}, {r.num_stages} stages)" if len(choices) > 1 else "") for r in rs)
            groups.setdefault(cells, []).extend(rs)
        for cells, rs in groups.items():
            dtypes = ", ".join(dict.fromkeys(r.dtype for r in rs))
            regs = "n/a" if any(r.registers is None for r in rs) else str(max(r.registers for r in rs))
            spills = "n/a" if any(r.spill_bytes is None for r in rs) else str(max(r.spill_bytes for r in rs))
            rows.append(f"| `{kernel}` | {case} | {dtypes} | " + " | ".join(cells) + f" | {regs} | {spills} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opweave.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)), help="targets, e.g. 80,89,90")
    parser.add_argument("--dtype", default=",".join(DTYPES), help="model dtypes, e.g. bf16,fp32")
    parser.add_argument("--kernel", default=None, help="only these kernels (comma-separated names)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--summary", action="store_true", help="one column per target (docs/kernels.md)")
    args = parser.parse_args(argv)
    try:
        archs = tuple(int(a.strip().removeprefix("sm_")) for a in args.arch.split(","))
    except ValueError:
        print(f"aot: error: --arch takes numbers like 80,89,90, got '{args.arch}'", file=sys.stderr)
        return 2
    kernels = set(args.kernel.split(",")) if args.kernel else None
    try:
        results = run(archs, tuple(d.strip() for d in args.dtype.split(",")), kernels=kernels)
    except OpWeaveError as err:
        print(f"aot: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(results) if args.summary else format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    bad = [f"{r.kernel} {r.case} {r.dtype} sm_{r.sm}: {'; '.join(r.problems())}" for r in results if r.problems()]
    for line in bad:
        print(f"FAIL {line}", file=sys.stderr)
    if results and results[0].registers is None:
        print("note: no bundled ptxas ran; registers and spills not checked", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
