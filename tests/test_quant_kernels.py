"""Block-scaled GEMM Triton kernels over quantized weights in their stored formats
(`triton_kernels.quant`), under TRITON_INTERPRET=1 on CPU: against x @ W^T with W from the CPU
path's dequantizers (`opweave.models.quantized`: the same definition of the formats), and every
fp8 / fp4 code and e8m0 scale decoded exactly (fp8 against torch's float8_e4m3fn)."""

from __future__ import annotations

import pytest
import torch

from opweave.kernels import triton_kernels as tk
from opweave.models.quantized import FP4_E2M1, dequantize_fp8, dequantize_mxfp4, fp8_scale_shape

DTYPES = [torch.float32, torch.float16]
# |got - want| <= REL * |want| + ABS * (|x| @ |W|^T): float32 sums in another order (ABS), the
# output rounded to the model dtype (REL: half an ulp, and a margin)
REL = {torch.float32: 1e-6, torch.float16: 2 ** -10}
ABS = 1e-5


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` [M, N] (x's dtype) against x @ w^T in float64, w [N, K] the dequantized weight."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    x64, w64 = x.double(), w.double()
    want, bound = x64 @ w64.T, x64.abs() @ w64.abs().T
    err = (got.double() - want).abs()
    tol = REL[x.dtype] * want.abs() + ABS * bound
    worst = err.argmax()
    assert torch.all(err <= tol), f"max error {err.flatten()[worst]:.3g} (tolerance there {tol.flatten()[worst]:.3g})"


def _fp8_bits(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    return torch.where((bits & 0x7F) == 0x7F, bits ^ 0x01, bits)  # no NaN codes (0x7F, 0xFF)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (3, 200, 300), (17, 130, 257)])
def test_fp8_block_linear_matches_the_dequantized_weight(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    bits = _fp8_bits(n, k, gen)
    scale_inv = torch.empty(fp8_scale_shape((n, k))).uniform_(2e-5, 2e-3, generator=gen)  # weights ~ 1e-2..1
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = tk.fp8_block_linear(x, bits, scale_inv)
    _check(got, x, dequantize_fp8(bits.view(torch.float8_e4m3fn), scale_inv))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (3, 100, 160), (17, 70, 288)])
def test_mxfp4_linear_matches_the_dequantized_weight(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(117, 130, (n, k // 32), dtype=torch.uint8, generator=gen)  # 2^-10 .. 2^2
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = tk.mxfp4_linear(x, blocks, scales)
    _check(got, x, dequantize_mxfp4(blocks, scales, dtype=dtype).T)  # [K, N] -> [N, K]


def test_every_fp8_code_decodes_like_torch():
    """x = I: the output is W^T, every e4m3 code at every column of a 128-wide block (two blocks
    of K, two rows: the codes and their reverse), scales 1 and 2. NaN codes are not compared."""
    codes = torch.arange(256, dtype=torch.uint8)
    bits = torch.stack((codes, codes.flip(0)))                                   # [2, 256]
    scale_inv = torch.tensor([[1.0, 2.0]])
    got = tk.fp8_block_linear(torch.eye(256), bits, scale_inv).T                 # [2, 256]
    want = bits.view(torch.float8_e4m3fn).float() * scale_inv.repeat_interleave(128, dim=1)
    finite = ~torch.isnan(want)
    assert int(finite.sum()) == 2 * 254
    assert torch.equal(got[finite], want[finite])  # -0.0 == 0.0: a dot's + 0.0 terms drop the sign anyway


def test_every_fp4_code_and_e8m0_scale_decodes_exactly():
    """Every e2m1 code in the low and in the high nibble of a byte (x = I: the output is W^T), and
    every finite, normal e8m0 scale (s = 1..254: 2 ** (s - 127)) on the code of 1.0."""
    j = torch.arange(16, dtype=torch.uint8)
    blocks = torch.stack((j | (15 - j) << 4, (15 - j) | j << 4))[:, None, :]    # [2, 1, 16]
    scales = torch.tensor([[127], [128]], dtype=torch.uint8)                    # 1.0, 2.0
    got = tk.mxfp4_linear(torch.eye(32), blocks, scales).T                      # [2, 32]
    lut = torch.tensor(FP4_E2M1)
    nibbles = torch.stack((blocks[:, 0] & 0xF, blocks[:, 0] >> 4), dim=-1).flatten(1).long()  # low first
    want = lut[nibbles] * torch.tensor([[1.0], [2.0]])
    assert torch.equal(got, want)
    assert torch.equal(got, dequantize_mxfp4(blocks, scales).T)

    s = torch.arange(1, 255, dtype=torch.uint8)
    one = torch.full((254, 1, 16), 0x22, dtype=torch.uint8)                     # every value 1.0
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    got = tk.mxfp4_linear(x, one, s[:, None])[0]
    assert torch.equal(got, torch.ldexp(torch.ones(254), s.int() - 127))


def test_wrappers_refuse_bad_layouts():
    x = torch.randn(2, 256)
    with pytest.raises(AssertionError, match="fp8_block_linear"):
        tk.fp8_block_linear(x, torch.zeros(130, 256, dtype=torch.uint8), torch.ones(1, 2))  # want 2 x 2 scales
    with pytest.raises(AssertionError, match="fp8_block_linear"):
        tk.fp8_block_linear(x, torch.zeros(128, 256), torch.ones(1, 2))                    # not bytes
    with pytest.raises(AssertionError, match="fp8_block_linear"):
        tk.fp8_block_linear(x.int(), torch.zeros(128, 256, dtype=torch.uint8), torch.ones(1, 2))  # x not float
    with pytest.raises(AssertionError, match="mxfp4_linear"):
        tk.mxfp4_linear(x, torch.zeros(4, 8, 16, dtype=torch.uint8), torch.zeros(4, 7, dtype=torch.uint8))
    with pytest.raises(AssertionError, match="mxfp4_linear"):
        tk.mxfp4_linear(x.T.contiguous().T, torch.zeros(4, 8, 16, dtype=torch.uint8),
                        torch.zeros(4, 8, dtype=torch.uint8))                             # x not contiguous
