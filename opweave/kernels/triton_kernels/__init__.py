"""Triton decode kernels: the CUDA path of the runtime, same interface as `reference`.

Each `@triton.jit` kernel has a host wrapper with the reference's name and signature; the wrapper
asserts shapes, dtypes and strides, allocates the outputs and computes the grid. Arithmetic is in
float32; where an operator module rounds an intermediate to the model dtype (an activation before
the `* up`, an expert's output before its routing weight) the kernel rounds it too, so the two
backends agree to a few units in the last place of the model dtype (`tests/test_kernels.py`).

On CPU the kernels run under `TRITON_INTERPRET=1` (set before triton is imported).

Note: the interpreter computes `tl.dot` on bfloat16 operands from their raw bit patterns, so
decode attention casts its `tl.dot` operands to float32 when interpreting bfloat16 (`_dot_fp32`);
float32 operands use IEEE precision (not TF32) on the GPU too, so float32 runs match the reference.

The kernels live by family (`rows`, `attention`, `moe`, `paged`: the paged KV cache's attention and
writes, `paged_mla`: latent attention over paged latent rows, `quant`: block-scaled GEMMs over fp8 and
MXFP4 weights in their stored formats; shared helpers in `common`); this
package re-exports the backend's functions. Launch tunables are patched on the module that
defines them (`attention.ATTN_BLOCK_N`), not here.
"""

from __future__ import annotations

from opweave.kernels.triton_kernels import attention, moe, paged, paged_mla, quant, rows
from opweave.kernels.triton_kernels.attention import (attention_plan, decode_attention, gdn_step,
                                                      mla_decode_attention, mla_plan)
from opweave.kernels.triton_kernels.moe import (gated_act, moe_block_table, moe_experts, moe_experts_fp8,
                                                moe_experts_swiglu, moe_experts_swiglu_mxfp4, moe_route)
from opweave.kernels.triton_kernels.paged import paged_cache_write, paged_chunk_attention, paged_decode_attention
from opweave.kernels.triton_kernels.paged_mla import paged_mla_decode_attention, paged_mla_plan
from opweave.kernels.triton_kernels.quant import fp8_block_linear, mxfp4_linear
from opweave.kernels.triton_kernels.rows import add_rms_norm, argmax, rms_norm, rope

FAMILIES = (rows, attention, moe, paged, paged_mla, quant)
"""The modules that define the `@triton.jit` kernels (`aot.record` patches them there)."""

__all__ = ["FAMILIES", "add_rms_norm", "argmax", "attention_plan", "decode_attention", "fp8_block_linear",
           "gated_act", "gdn_step", "mla_decode_attention", "mla_plan", "moe_block_table", "moe_experts",
           "moe_experts_fp8", "moe_experts_swiglu", "moe_experts_swiglu_mxfp4", "moe_route", "mxfp4_linear",
           "paged_cache_write", "paged_chunk_attention", "paged_decode_attention", "paged_mla_decode_attention",
           "paged_mla_plan", "rms_norm", "rope"]
