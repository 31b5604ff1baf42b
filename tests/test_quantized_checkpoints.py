"""Published quantized checkpoints load dequantized (`opweave.models.quantized`, `CheckpointReader`):
fp8 with 128 x 128 block scales (DeepSeek-V3, Kimi-K2) and GPT-OSS's MXFP4 experts.

- the dequantizers equal transformers' own (`Fp8Dequantize`, `_dequantize_fp8_weight`,
  `convert_moe_packed_tensors`; a re-derivation here where those are not importable), and a
  slice read equals the slice of the whole, also when it starts or ends inside a block;
- a sliced read reads only the rows it needs and their scales; bad scales are one-line errors;
- a tiny DeepSeek-V3 (fp8) and GPT-OSS (MXFP4) checkpoint written in the published layout
  generates the same greedy tokens as its dequantized float32 twin, and every TP 2 / EP 2 shard
  the runtime materialises from it (`runtime.shard.materialize`, sliced reads) equals the twin's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hf_fixtures import QUANTIZED_CASES as CASES
from opweave.errors import OpWeaveError
from opweave.models import ops
from opweave.models import quantized as Q
from opweave.models.checkpoint import CheckpointReader
from opweave.models.model import DecodeStep, build_model, generate
from opweave.models.registry import resolve
from opweave.runtime.shard import materialize

PROMPT = [(7 * i + 3) % 100 for i in range(20)]
NEW_TOKENS = 8


# ---------------------------------------------------------------- references
def _transformers_fp8():
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    except ImportError:
        return None
    return Fp8Dequantize, _dequantize_fp8_weight


def _transformers_mxfp4():
    try:
        from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
    except ImportError:
        return None
    return FP4_VALUES, convert_moe_packed_tensors


def _derived_fp8(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Block (r // 128, c // 128)'s scale on every value, written out element by element's block."""
    rows, cols = w.shape
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return w.float() * full


def _derived_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Nibbles low-first through the e2m1 table, times 2^(s - 127), as [..., in, out]."""
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(table + [-v for v in table])
    codes = torch.stack((blocks & 15, blocks >> 4), -1).long().flatten(-2)   # [..., N, G, 32]
    values = table[codes] * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(-1, -2)


def _fp8_case(rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 1e-2 + 1e-4
    return w, scale


def _mxfp4_case(experts: int, n: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(115, 135, (experts, n, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


# ---------------------------------------------------------------- the dequantizers
@pytest.mark.parametrize("rows,cols", [(256, 384), (300, 200), (64, 40)])  # whole blocks; partial edge blocks
def test_fp8_dequantize_matches_transformers(rows, cols):
    w, scale = _fp8_case(rows, cols)
    ours = Q.dequantize_fp8(w, scale)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    torch.testing.assert_close(ours, _derived_fp8(w, scale), atol=0, rtol=0)
    hf = _transformers_fp8()
    if hf is not None:
        fp8_dequantize, dequantize_fp8_weight = hf
        torch.testing.assert_close(ours, dequantize_fp8_weight(w, scale, [128, 128], torch.float32), atol=0, rtol=0)
        if rows % 128 == 0 and cols % 128 == 0:  # the load-time converter needs whole blocks
            for dtype in (torch.float32, torch.bfloat16):
                want = fp8_dequantize(None)._dequantize_one(w, scale, output_dtype=dtype)
                torch.testing.assert_close(Q.dequantize_fp8(w, scale, dtype=dtype), want, atol=0, rtol=0)


@pytest.mark.parametrize("dim,start,stop", [(0, 0, 128), (0, 128, 300), (0, 100, 250), (0, 5, 6),
                                            (1, 0, 200), (1, 70, 190), (1, 130, 131)])
def test_fp8_slice_equals_slice_of_whole(dim, start, stop):
    w, scale = _fp8_case(300, 200, seed=1)
    whole = Q.dequantize_fp8(w, scale)
    read = Q.fp8_read(tuple(w.shape), dim, start, stop)
    assert read.values == tuple([slice(None)] * dim + [slice(start, stop)])  # exactly the rows asked for
    first, last = read.scales[dim].start, read.scales[dim].stop
    assert (first, last) == (start // 128, -(-stop // 128))                  # and the scales covering them
    kw = {"row0": read.offset} if dim == 0 else {"col0": read.offset}
    part = Q.dequantize_fp8(w[read.values], scale[read.scales], **kw)
    torch.testing.assert_close(part, whole.narrow(dim, start, stop - start), atol=0, rtol=0)


def test_mxfp4_dequantize_matches_transformers():
    blocks, scales = _mxfp4_case(3, 40, 4)
    ours = Q.dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 128, 40) == Q.mxfp4_dense_shape(tuple(blocks.shape))  # [E, in, out]
    torch.testing.assert_close(ours, _derived_mxfp4(blocks, scales), atol=0, rtol=0)
    hf = _transformers_mxfp4()
    if hf is not None:
        fp4_values, convert = hf
        assert tuple(fp4_values) == Q.FP4_E2M1
        for dtype in (torch.float32, torch.bfloat16):
            want = convert(blocks, scales, dtype=dtype)
            torch.testing.assert_close(Q.dequantize_mxfp4(blocks, scales, dtype=dtype), want, atol=0, rtol=0)


@pytest.mark.parametrize("dim,start,stop", [(0, 1, 3), (1, 32, 96), (1, 16, 48), (1, 100, 101), (2, 5, 33)])
def test_mxfp4_slice_equals_slice_of_whole(dim, start, stop):
    """Dims of the dense [E, in, out]: experts, input channels (whole groups read, then cut: a slice
    inside a group of 32 too), output rows."""
    blocks, scales = _mxfp4_case(3, 40, 4, seed=2)
    whole = Q.dequantize_mxfp4(blocks, scales)
    read = Q.mxfp4_read(tuple(blocks.shape), dim, start, stop)
    part = Q.dequantize_mxfp4(blocks[read.values], scales[read.scales])
    if read.cut is not None:
        part = part.narrow(*read.cut)
    torch.testing.assert_close(part, whole.narrow(dim, start, stop - start), atol=0, rtol=0)


# ---------------------------------------------------------------- the reader
def _write(folder, tensors: dict, config: dict | None = None) -> str:
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    if config is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    return str(folder)


class _Spy:
    """Records the stored slices a reader reads (tensor name, index)."""

    def __init__(self, reader: CheckpointReader):
        self.reads = []
        inner = reader._stored

        def stored(real, index):
            self.reads.append((real, index))
            return inner(real, index)

        reader._stored = stored


def test_reader_dequantizes_and_reads_only_the_rows_a_slice_needs(tmp_path):
    w, scale = _fp8_case(300, 200, seed=3)
    blocks, scales = _mxfp4_case(4, 40, 3, seed=4)
    folder = _write(tmp_path / "ck", {"a.weight": w, "a.weight_scale_inv": scale, "e.down_proj_blocks": blocks,
                                      "e.down_proj_scales": scales, "n.weight": torch.ones(3)})
    reader = CheckpointReader(folder)
    spy = _Spy(reader)
    fp8_whole, mx_whole = Q.dequantize_fp8(w, scale), Q.dequantize_mxfp4(blocks, scales)
    assert reader.shape("a.weight") == (300, 200) and reader.shape("e.down_proj") == (4, 96, 40)
    assert reader.has("e.down_proj")
    torch.testing.assert_close(reader.get("a.weight", (300, 200)), fp8_whole, atol=0, rtol=0)
    torch.testing.assert_close(reader.get("e.down_proj", (4, 96, 40)), mx_whole, atol=0, rtol=0)
    assert reader.get("a.weight", dtype=torch.bfloat16).dtype == torch.bfloat16
    assert reader.get("n.weight").dtype == torch.float32  # an unquantized tensor as stored

    spy.reads.clear()
    torch.testing.assert_close(reader.get_slice("a.weight", 0, 150, 300), fp8_whole[150:], atol=0, rtol=0)
    assert spy.reads == [("a.weight", (slice(150, 300),)), ("a.weight_scale_inv", (slice(1, 3),))]
    spy.reads.clear()
    torch.testing.assert_close(reader.get_slice("e.down_proj", 1, 48, 96), mx_whole[:, 48:96], atol=0, rtol=0)
    assert spy.reads == [("e.down_proj_blocks", (slice(None), slice(None), slice(1, 3))),
                         ("e.down_proj_scales", (slice(None), slice(None), slice(1, 3)))]
    torch.testing.assert_close(reader.get_slice("e.down_proj", 2, 10, 30), mx_whole[..., 10:30], atol=0, rtol=0)
    torch.testing.assert_close(reader.get_slice("e.down_proj", 0, 2, 4), mx_whole[2:], atol=0, rtol=0)
    torch.testing.assert_close(reader.get_slice("a.weight", 1, 64, 192), fp8_whole[:, 64:192], atol=0, rtol=0)


@pytest.mark.parametrize("tensors,message", [
    ({"a.weight": torch.zeros(300, 200, dtype=torch.float8_e4m3fn)},
     "tensor 'a.weight' is stored quantized .* no scale tensor 'a.weight_scale_inv'"),
    ({"a.weight": torch.zeros(300, 200, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(2, 2)},
     r"tensor 'a.weight_scale_inv' has shape \(2, 2\); the 128x128 block scales of 'a.weight' \(300, 200\) "
     r"have shape \(3, 2\)"),
    ({"a.weight": torch.zeros(300, 200, dtype=torch.float8_e5m2)}, "tensor 'a.weight' has dtype F8_E5M2"),
    ({"e.gate_up_proj_blocks": torch.zeros(2, 8, 2, 16, dtype=torch.uint8)},
     "tensor 'e.gate_up_proj' is stored quantized .* no scale tensor 'e.gate_up_proj_scales'"),
    ({"e.gate_up_proj_blocks": torch.zeros(2, 8, 2, 16, dtype=torch.uint8),
      "e.gate_up_proj_scales": torch.zeros(2, 8, 3, dtype=torch.uint8)},
     r"tensor 'e.gate_up_proj_scales' has shape \(2, 8, 3\); the scales of 'e.gate_up_proj_blocks'"),
    ({"e.gate_up_proj_blocks": torch.zeros(2, 8, 2, 16), "e.gate_up_proj_scales": torch.zeros(2, 8, 2)},
     "tensor 'e.gate_up_proj_blocks' has dtype F32; MXFP4 blocks are U8"),
    ({"e.gate_up_proj_blocks": torch.zeros(2, 8, 2, 8, dtype=torch.uint8),
      "e.gate_up_proj_scales": torch.zeros(2, 8, 2, dtype=torch.uint8)},
     r"tensor 'e.gate_up_proj_blocks' has shape \(2, 8, 2, 8\); MXFP4 blocks are \[..., rows, groups, 16\] bytes"),
], ids=["fp8-no-scale", "fp8-scale-shape", "fp8-e5m2", "mxfp4-no-scales", "mxfp4-scales-shape", "mxfp4-not-u8",
        "mxfp4-blocks-shape"])
def test_bad_quantized_tensors_are_one_line_errors(tmp_path, tensors, message):
    reader = CheckpointReader(_write(tmp_path / "bad", tensors))
    key = next(iter(tensors)).removesuffix("_blocks")
    for read in (lambda: reader.get(key), lambda: reader.get_slice(key, 0, 0, 1)):
        with pytest.raises(OpWeaveError, match=message) as e:
            read()
        assert "\n" not in str(e.value) and str(e.value).startswith(reader.folder)


# ---------------------------------------------------------------- tiny published checkpoints
@pytest.mark.parametrize("family", sorted(CASES))
def test_fixture_has_the_published_layout(published, family):
    source, quantized, twin = published(family)
    reader = CheckpointReader(quantized)
    cfg = resolve(quantized).cfg
    assert cfg.weight_format.method == CASES[family][0]
    if family == "deepseek_v3":
        key = "model.layers.0.mlp.gate_proj.weight"
        assert reader.shape(key) == (320, 64) and reader.shape(key + "_scale_inv") == (3, 1)
        assert reader._header(key)[1] == "F8_E4M3"
        assert reader._header("model.layers.1.mlp.experts.3.down_proj.weight")[1] == "F8_E4M3"
        assert reader._header("model.layers.1.mlp.gate.weight")[1] == "F32"  # the router is not converted
    else:
        key = "model.layers.1.mlp.experts.gate_up_proj"
        assert reader.shape(key + "_blocks") == (8, 64, 3, 16) and reader.shape(key + "_scales") == (8, 64, 3)
        assert reader.shape("model.layers.1.mlp.experts.down_proj_blocks") == (8, 96, 1, 16)
        assert reader.shape(key) == (8, 96, 64)
        assert reader._header("model.layers.1.self_attn.q_proj.weight")[1] == "F32"  # modules_to_not_convert
    # the twin holds what the quantized weights decode to: close to the source's, not equal
    dense, original = CheckpointReader(twin).get(key), CheckpointReader(source).get(key)
    torch.testing.assert_close(reader.get(key), dense, atol=0, rtol=0)
    assert not torch.equal(dense, original)
    torch.testing.assert_close(dense, original, atol=0.25 * original.abs().max().item(), rtol=0)


def _loaded(folder: str):
    model = build_model(resolve(folder).cfg, "cpu")  # build + load_weights: `registry.load` refuses quantized configs
    model.load_weights(CheckpointReader(folder))
    return model


@pytest.mark.parametrize("family", sorted(CASES))
def test_quantized_checkpoint_generates_its_twins_tokens(published, family):
    _, quantized, twin = published(family)
    model, reference = _loaded(quantized), resolve(twin).load()
    logits, tokens = generate(model, PROMPT, NEW_TOKENS)
    twin_logits, twin_tokens = generate(reference, PROMPT, NEW_TOKENS)
    assert tokens == twin_tokens
    assert len(set(tokens)) > 2, "degenerate fixture: greedy decoding repeats a token"
    torch.testing.assert_close(logits, twin_logits, atol=1e-5, rtol=0)

    step = DecodeStep(model)  # the traced unit: prefill, then one step per new token
    model.allocate_state(1, len(PROMPT) + NEW_TOKENS)
    with torch.no_grad():
        stepped = [int(step(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])[0])]
        for i in range(NEW_TOKENS - 1):
            stepped.append(int(step(torch.tensor([[stepped[-1]]]), torch.tensor([[len(PROMPT) + i]]))[0]))
    assert stepped == twin_tokens


@pytest.mark.parametrize("experts", ["tp", "ep"])
@pytest.mark.parametrize("family", sorted(CASES))
def test_tp2_shards_of_the_quantized_checkpoint_equal_the_twins(published, family, experts):
    """Every op as TP rank 0 and 1 of 2 materialises it (`runtime.shard.materialize`: the table's
    sliced reads) holds, from the quantized checkpoint, exactly the twin's weights; a sharded
    quantized matrix reads only its half of the stored values."""
    _, quantized, twin = published(family)
    cfg = resolve(quantized).cfg
    named = [(n, m) for n, m in DecodeStep(build_model(cfg, "meta")).named_modules() if isinstance(m, ops.OpModule)]
    sliced = []

    def reader_of(folder, spy=False):
        def make(_shapes):
            reader = CheckpointReader(folder)
            if spy:
                inner = reader.get_slice

                def get_slice(key, dim, start, stop, dtype=None):
                    sliced.append((key, dim, start, stop))
                    return inner(key, dim, start, stop, dtype)

                reader.get_slice = get_slice
            return reader
        return make

    for rank in range(2):
        got = materialize(dict(enumerate(m for _, m in named)), reader_of(quantized, spy=True), 2, rank,
                          torch.device("cpu"), experts=experts)
        want = materialize(dict(enumerate(m for _, m in named)), reader_of(twin), 2, rank, torch.device("cpu"),
                           experts=experts)
        for i, (name, _) in enumerate(named):
            for attr, p in got[i].named_parameters():
                torch.testing.assert_close(p, getattr(want[i], attr), atol=0, rtol=0, msg=f"{name}.{attr}")
    quantized_keys = CheckpointReader(quantized).key_to_file
    halves = [(k, d, a, b) for k, d, a, b in sliced
              if k + "_scale_inv" in quantized_keys or k + "_blocks" in quantized_keys]
    assert halves, "no quantized matrix was read sliced"
    assert {k for k, *_ in halves} >= ({"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"}
                                       if family == "deepseek_v3" else {"model.layers.0.mlp.experts.gate_up_proj"})


# ---------------------------------------------------------------- a compiled plan on CPU ranks
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.slow
def test_plan_of_the_quantized_checkpoint_generates_its_twins_tokens(published, tmp_path, monkeypatch, family,
                                                                     kernels):
    """On one CPU rank (the tiny fixtures' matrices are smaller than a 128 x 128 block, so the
    planner keeps them whole; the sliced TP 2 reads are `test_tp2_shards_...` above): read
    dequantized on the torch kernels, held as stored on the Triton kernels (the GPU's path, here
    under TRITON_INTERPRET=1: block-scaled GEMMs and grouped experts over the stored bytes)."""
    monkeypatch.setenv("OPWEAVE_KERNELS", kernels)
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.runtime.launch import RunConfig, run_detailed
    from opweave.runtime.scheduler import Request

    _, quantized, twin = published(family)
    prompts = [PROMPT, [5, 6, 7], [42]] if kernels == "torch" else [PROMPT, [5, 6, 7]]
    new = 4 if kernels == "torch" else 3
    reference = resolve(twin).load()
    want = [generate(reference, p, new)[1] for p in prompts]
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    out = str(tmp_path / "art")
    write_artifact(out, pinned_plan(run_front_end(quantized), cluster, "colocated", [("h100", 1, 1)], batch=4,
                                    microbatches=2, context=64))
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=new) for i, p in enumerate(prompts))
    outputs, _ = run_detailed(RunConfig(artifact=out, weights=quantized, device="cpu", requests=requests,
                                        timeout_s=300))
    assert [list(r.output) for r in outputs] == want


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_gpu_rank_on_the_torch_kernels_refuses_a_quantized_checkpoint_in_one_line(published, family, monkeypatch):
    """On CUDA the torch kernels would hold the weights dequantized, above the planned memory:
    refused before anything is read or allocated (no GPU needed to check it)."""
    from opweave.models.hf_config import config_from_hf
    from opweave.models.model import DecodeStep, build_model
    from opweave.runtime.shard import materialize

    monkeypatch.setenv("OPWEAVE_KERNELS", "torch")
    _, quantized, _ = published(family)
    with open(os.path.join(quantized, "config.json")) as f:
        cfg = config_from_hf(json.load(f), family)
    modules = {i: m for i, (_, m) in enumerate(DecodeStep(build_model(cfg, "meta")).named_modules()) if m is not None}
    with pytest.raises(OpWeaveError, match="the torch kernels would hold them dequantized") as err:
        materialize({0: modules[1]}, quantized, 1, 0, torch.device("cuda"))
    assert "\n" not in str(err.value)


def test_run_on_cuda_checks_the_quantized_checkpoint_before_any_rank(published, monkeypatch):
    """DeepSeek-V3's fp8 matrices and GPT-OSS's MXFP4 experts run as stored on the Triton kernels
    (CUDA's default); the torch kernels would hold them dequantized: a one-line refusal before any
    rank starts (an operator with no kernel over its stored format: `test_stored_weights`)."""
    from opweave.runtime.checks import check_weight_format

    for family in CASES:
        source, quantized, _ = published(family)
        check_weight_format(quantized, "cpu")   # read dequantized there
        check_weight_format(source, "cuda")     # a dense checkpoint runs anywhere
        check_weight_format(quantized, "cuda")  # held as stored
    monkeypatch.setenv("OPWEAVE_KERNELS", "torch")
    for family in CASES:
        with pytest.raises(OpWeaveError, match="the torch kernels would hold them dequantized") as err:
            check_weight_format(published(family)[1], "cuda")
        assert "\n" not in str(err.value)
