"""Ahead-of-time checks of the Triton kernels (opweave/kernels/aot.py), no GPU needed.

Every kernel is compiled, with the specialisations its launcher picks for the target, for sm_80
(A100), sm_89 (L40S, L4) and sm_90 (H100, H200) in bfloat16 at head dims 64/128/256; decode
attention (whose shared memory grows with the head dim and the element size) and the MoE kernels
(registers) also in float32. Each must fit its target's per-block shared memory and, where the
bundled ptxas runs, not spill registers. float16 compiles like bfloat16 (same element size);
`python -m opweave.kernels.aot` runs the full matrix (docs/kernels.md). The compilations
run in subprocesses without TRITON_INTERPRET (conftest sets it for the interpreter tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from opweave.kernels import aot, targets  # noqa: E402
from opweave.hardware.catalog import load_catalog  # noqa: E402

KIB = 1024
# float32 compiles of the kernels whose shared memory or registers grow with the element size
FP32_KERNELS = "_decode_attention_kernel,_moe_gate_up_act_kernel,_moe_down_kernel"


def _aot_env() -> dict:
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    return env


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[aot.Result]:
    """The compilation results: bf16 every kernel, fp32 FP32_KERNELS, in parallel subprocesses."""
    out = tmp_path_factory.mktemp("aot")
    procs = []
    for sm in aot.ARCHS:
        for dtype, kernels in (("bf16", None), ("fp32", FP32_KERNELS)):
            path = out / f"sm{sm}_{dtype}.json"
            cmd = [sys.executable, "-m", "opweave.kernels.aot", "--arch", str(sm), "--dtype", dtype,
                   "--json", str(path)] + (["--kernel", kernels] if kernels else [])
            procs.append((path, subprocess.Popen(cmd, env=_aot_env(), stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)))
    results = []
    for path, proc in procs:
        _, err = proc.communicate(timeout=600)
        assert path.exists(), f"aot failed (exit {proc.returncode}): {err[-2000:]}"
        results += [aot.Result(**r) for r in json.loads(path.read_text())]
    return results


@pytest.mark.slow
def test_every_kernel_compiles_for_every_target(compiled):
    kernels = set(aot.kernel_names())
    assert {"_decode_attention_kernel", "_decode_attention_merge_kernel", "_gdn_step_kernel", "_rms_norm_kernel",
            "_rope_kernel", "_argmax_kernel"} <= kernels
    for sm in aot.ARCHS:
        assert {r.kernel for r in compiled if r.sm == sm} == kernels, f"sm_{sm}"
        for d in aot.HEAD_DIMS:
            for kernel, case in (("_decode_attention_kernel", f"D {d}, GQA 4"), ("_rope_kernel", f"D {d}"),
                                 ("_decode_attention_merge_kernel", f"D {d}, GQA 4"),
                                 ("_rms_norm_kernel", f"qk-norm D {d}")):
                assert any(r.kernel == kernel and r.case.startswith(case) and r.sm == sm for r in compiled), \
                    (kernel, d, sm)


def test_shared_memory_within_each_targets_limit(compiled):
    over = [f"{r.kernel} {r.case} {r.dtype} sm_{r.sm}: {r.shared / KIB:.1f} KiB > {r.smem_limit // KIB} KiB"
            for r in compiled if r.shared > r.smem_limit]
    assert over == []
    assert {r.smem_limit for r in compiled if r.sm == 89} == {99 * KIB}


def test_no_register_spills(compiled):
    if any(r.registers is None for r in compiled):
        pytest.skip("no bundled ptxas ran on this machine: registers and spills not measured")
    assert [f"{r.kernel} {r.case} {r.dtype} sm_{r.sm}: {r.spill_bytes} B" for r in compiled if r.spill_bytes] == []
    assert all(0 < r.registers <= 255 for r in compiled)


def test_attention_estimate_bounds_the_compiled_shared_memory(compiled):
    """The launcher picks decode attention's block from `attention_smem_estimate`: it must never be
    below what the compiler allocates, or a pick could exceed a limit the estimate says it fits."""
    attn = [r for r in compiled if r.kernel == "_decode_attention_kernel"]
    # one case per head dim, and GPT-OSS's windowed attention with sinks; in bf16 and fp32; and the
    # fp8 ring cache (bf16 queries) on the targets with float8 conversions (sm_89, sm_90)
    fp8 = [r for r in attn if r.case.startswith("fp8 KV")]
    assert sorted(r.sm for r in fp8) == [89, 90]
    assert len(attn) - len(fp8) == len(aot.ARCHS) * (len(aot.HEAD_DIMS) + 1) * 2
    for r in attn:
        blocks = dict(kv.split("=") for kv in r.constexprs.split())
        est = targets.attention_smem_estimate(int(blocks["N"]), r.num_stages, int(blocks["D"]),
                                              4 if r.dtype == "fp32" else 2)
        assert r.shared <= est, r


def test_the_interpreter_choice_overflows_the_l40s_at_head_dim_256():
    """The check has teeth: the launch used before per-target choices (64 slots, 3 stages) does
    not fit sm_89, and the per-target choice does."""
    old = targets.AttentionLaunch(64, 3)
    assert targets.attention_smem_estimate(old.block_n, old.num_stages, 256, 2) > targets.smem_limit((8, 9))
    new = targets.attention_launch(256, 2, targets.smem_limit((8, 9)), 64)
    assert new != old and targets.attention_smem_estimate(new.block_n, new.num_stages, 256, 2) <= 99 * KIB


# ---------------------------------------------------------------------------------------------- no compiler

def test_every_catalog_gpu_has_a_known_shared_memory_limit():
    for name in load_catalog():
        if name == "cpu":
            continue
        assert name in targets.CATALOG_CAPABILITY, f"catalog GPU '{name}': add its compute capability to targets.py"
        assert targets.CATALOG_CAPABILITY[name] in targets.SMEM_PER_BLOCK, name
    assert targets.smem_limit((9, 0)) == 227 * KIB and targets.smem_limit((8, 0)) == 163 * KIB
    assert targets.smem_limit((8, 6)) == targets.smem_limit((8, 9)) == 99 * KIB
    assert targets.smem_limit((7, 5)) == 99 * KIB  # unknown: the conservative default


@pytest.mark.parametrize("cap", sorted(set(targets.CATALOG_CAPABILITY.values())))
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_attention_launch_fits_every_catalog_gpu(cap, head_dim, elem_bytes):
    from opweave.kernels.triton_kernels.common import _pow2

    block_d = _pow2(head_dim, 16)
    limit = targets.smem_limit(cap)
    launch = targets.attention_launch(block_d, elem_bytes, limit, 64)
    assert targets.attention_smem_estimate(launch.block_n, launch.num_stages, block_d, elem_bytes) <= limit
    assert launch.block_n >= 16 and launch.num_stages >= 1


def test_launch_limit_follows_the_target_and_not_the_cpu():
    import torch

    assert targets.launch_smem_limit(torch.device("cpu")) is None
    assert targets.attention_launch(256, 2, None, 16) == targets.AttentionLaunch(16, 3)  # interpreter: unchanged
    with targets.for_target((8, 9)):
        assert targets.launch_smem_limit(torch.device("cpu")) == 99 * KIB
        with targets.for_target((9, 0)):
            assert targets.launch_smem_limit(torch.device("cpu")) == 227 * KIB
    assert targets.launch_smem_limit(torch.device("cpu")) is None


def test_launches_are_specialised_like_triton_launches():
    import torch

    from opweave.kernels import triton_kernels as tk

    x = torch.empty(8, 4096, dtype=torch.bfloat16, device="meta")
    (launch,) = aot.record(lambda: tk.rms_norm(x, torch.empty(4096, dtype=torch.bfloat16, device="meta"), 1e-6, True))
    sig, constexprs, attrs = aot.specialise(launch)
    names = launch.kernel.arg_names
    assert sig["x_ptr"] == "*bf16" and sig["eps"] == "fp32" and sig["OFFSET"] == "constexpr"
    assert constexprs["BLOCK_H"] == 4096 and (names.index("x_ptr"),) in attrs
    assert (names.index("stride_x"),) in attrs and (names.index("H"),) in attrs  # 4096: divisible by 16
    (one_row,) = aot.record(lambda: tk.rms_norm(x[:1, :1], torch.empty(1, dtype=torch.bfloat16, device="meta"),
                                                1e-6, False))
    sig, constexprs, _ = aot.specialise(one_row)
    assert sig["H"] == "constexpr" and constexprs["H"] == 1  # Triton makes integer 1 a constant
    assert tk.rows._rms_norm_kernel is launch.kernel  # the recorder put the kernels back


def test_bad_arguments_are_one_line_errors(capsys):
    assert aot.main(["--arch", "75"]) == 2
    assert aot.main(["--arch", "sm_x"]) == 2
    assert aot.main(["--dtype", "int8"]) == 2
    assert aot.main(["--kernel", "_nope_kernel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("aot: error:") for line in err)
    assert "sm_80" in err[0] and "bf16" in err[2] and "_nope_kernel" in err[3]


@pytest.mark.parametrize("batch,kv_heads,span", [(1, 8, 131072), (8, 8, 32768), (64, 8, 32768), (1, 1, 100),
                                                 (3, 2, 4096), (256, 8, 4096), (0, 8, 4096)])
@pytest.mark.parametrize("sm_count", [16, 58, 132, 142])
def test_attention_split_covers_the_span_and_fills_the_gpu(batch, kv_heads, span, sm_count):
    """Split-KV cuts from static facts: the splits cover the span in whole blocks, none is shorter
    than the minimum unless the span is, and batch x KV heads x splits reaches the programs wanted
    per SM whenever the span is long enough to allow it."""
    block_n, min_split = 64, 256
    split = targets.attention_split(batch, kv_heads, span, block_n, sm_count, min_split)
    assert split.split_len % block_n == 0 and split.splits >= 1
    assert split.splits * split.split_len >= span > (split.splits - 1) * split.split_len  # none left empty
    assert split.split_len >= min(min_split, span)
    wanted = targets.ATTN_PROGRAMS_PER_SM * sm_count
    if batch:  # rounding the length up to whole blocks (<= 64 of >= 256 positions) costs <= 20% of the splits
        programs = batch * kv_heads * split.splits
        assert programs >= 0.8 * min(wanted, batch * kv_heads * max(span // min_split, 1))
    if batch * kv_heads >= wanted:
        assert split.splits == 1
    if (batch, kv_heads, span, sm_count) == (1, 8, 131072, 132):
        assert (split.splits, split.split_len) == (64, 2048)  # the H200 figure of docs/kernels.md
