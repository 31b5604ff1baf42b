"""A published quantized checkpoint held as stored on the Triton path (`opweave.models.stored`):
GPT-OSS's MXFP4 experts keep their blocks and scales, byte for byte, in exactly the bytes the
planner counted; expert-parallel shards and expert copies read only their experts' stored rows; a
cut that is not whole quantization blocks, and an operator with no kernel over its stored format,
are one-line errors; the stored experts compute what the dequantized twin's do."""

from __future__ import annotations

import pytest
import torch

from opweave.errors import OpWeaveError
from opweave.ir.kinds import OpKind
from opweave.models import ops
from opweave.models.checkpoint import CheckpointReader
from opweave.models.model import DecodeStep, build_model
from opweave.models.registry import resolve
from opweave.passes.trace import build_graph
from opweave.runtime.shard import materialize

EXPERTS = "model.layers.{}.mlp.experts."


def _named(folder: str):
    cfg = resolve(folder).cfg
    return cfg, [(n, m) for n, m in DecodeStep(build_model(cfg, "meta")).named_modules() if isinstance(m, ops.OpModule)]


def _experts(got: dict) -> list:
    return [m for m in got.values() if m.kind == OpKind.MOE_EXPERTS_SWIGLU]


def _raw(reader: CheckpointReader, key: str) -> torch.Tensor:
    return reader._stored(key, None)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("OPWEAVE_KERNELS", "triton")


def test_gpt_oss_experts_hold_the_stored_blocks_in_the_planned_bytes(published, triton_path):
    _, quantized, _ = published("gpt_oss")
    cfg, named = _named(quantized)
    got = materialize(dict(enumerate(m for _, m in named)), quantized, 1, 0, torch.device("cpu"))
    reader = CheckpointReader(quantized)
    planned = {op.name: sum(w.nbytes for w in op.weights) for op in build_graph(build_model(cfg, "meta")).ops}
    experts = _experts(got)
    assert len(experts) == cfg.num_layers
    for (name, _), m in zip(named, got.values()):
        if m.kind != OpKind.MOE_EXPERTS_SWIGLU:
            assert m.stored is None  # attention stays dense (modules_to_not_convert)
            continue
        assert m.stored == "mxfp4" and m.held_stored == ("gate_up", "down")
        assert {n for n, _ in m.named_parameters()} == {"gate_up_bias", "down_bias"}
        prefix = EXPERTS.format(m.layer)
        for attr, key in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            assert torch.equal(getattr(m, attr + "_values"), _raw(reader, prefix + key + "_blocks"))
            assert torch.equal(getattr(m, attr + "_scales"), _raw(reader, prefix + key + "_scales"))
        held = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        assert held == planned[name]


@pytest.mark.parametrize("layout", ["ep", "slots"])
def test_expert_shards_read_only_their_experts_stored_rows(published, triton_path, layout):
    _, quantized, _ = published("gpt_oss")
    cfg, named = _named(quantized)
    modules = {i: m for i, (_, m) in enumerate(named) if m.kind == OpKind.MOE_EXPERTS_SWIGLU}
    reader = CheckpointReader(quantized)
    e = cfg.moe.num_experts
    if layout == "ep":  # rank 1 of an expert group of 2: the second half of the experts
        got, want = materialize(modules, quantized, 1, 0, torch.device("cpu"), experts="dp", ep=(2, 1)), \
            list(range(e // 2, e))
    else:               # copies: slots holding experts 5, 0, 5's copy is another slot's
        want = [5, 0, 3]
        got = materialize(modules, quantized, 1, 0, torch.device("cpu"), slots={m.layer: tuple(want)
                                                                                  for m in modules.values()})
    for m in got.values():
        prefix = EXPERTS.format(m.layer)
        blocks = _raw(reader, prefix + "down_proj_blocks")
        assert torch.equal(m.down_values, blocks[want]) and m.down_values.shape[0] == len(want)
        assert torch.equal(m.gate_up_scales, _raw(reader, prefix + "gate_up_proj_scales")[want])


def test_a_stored_cut_inside_a_group_is_a_one_line_error(published):
    """The tiny fixture's 32 expert channels split over TP 2 are half an MXFP4 group each: the
    planner never cuts there (`ir.tp`), and a read that would is refused, not dequantized."""
    _, quantized, _ = published("gpt_oss")
    reader = CheckpointReader(quantized)
    key = EXPERTS.format(0) + "down_proj"
    values, scales = reader.get_stored(key, (1, 0, 32))  # dense [E, I, H]: I = 32, one whole group
    assert values.shape[-2] == 1
    with pytest.raises(OpWeaveError, match="not whole groups of 32") as err:
        reader.get_stored(key, (1, 0, 16))
    assert "\n" not in str(err.value) and str(err.value).startswith(quantized)
    with pytest.raises(OpWeaveError, match="is not stored quantized"):
        reader.get_stored(EXPERTS.format(0) + "gate_up_proj_bias")


def test_deepseek_v3_holds_its_fp8_matrices_as_stored(published, triton_path):
    """Every converted matrix, in the planned bytes plus the partial blocks' scales; latent
    attention's absorbed W_UK / W_UV dense (never converted), the experts' scales the gate's then
    the up's block rows."""
    _, quantized, _ = published("deepseek_v3")
    cfg, named = _named(quantized)
    got = materialize(dict(enumerate(m for _, m in named)), quantized, 1, 0, torch.device("cpu"))
    reader = CheckpointReader(quantized)
    held = {(type(m).__name__, attr) for m in got.values() for attr in m.held_stored}
    assert held == {("MLAProj", "q_a_weight"), ("MLAProj", "q_b_weight"), ("MLAProj", "kv_a_weight"),
                    ("MLAOProj", "weight"), ("MLPGateUp", "gate_weight"), ("MLPGateUp", "up_weight"),
                    ("MLPDown", "weight"), ("PlainSharedExpert", "gate_weight"), ("PlainSharedExpert", "up_weight"),
                    ("PlainSharedExpert", "down_weight"), ("MoEExperts", "gate_up"), ("MoEExperts", "down")}
    for m in got.values():
        if type(m).__name__ == "MLAProj":
            assert m.w_uk.dtype == torch.float32 and "w_uk" in dict(m.named_parameters())
            raw = reader._stored(m.weight_keys["q_a_weight"], None)
            assert torch.equal(m.q_a_weight_values, raw.view(torch.uint8))
        if type(m).__name__ == "MoEExperts":
            p = m.prefix
            i = cfg.moe.intermediate_size
            for local, e in enumerate(m.expert_ids):
                gate, up = (reader._stored(f"{p}{e}.{n}_proj.weight", None).view(torch.uint8) for n in ("gate", "up"))
                assert torch.equal(m.gate_up_values[local], torch.cat([gate, up]))
                scales = [reader._stored(f"{p}{e}.{n}_proj.weight_scale_inv", None) for n in ("gate", "up")]
                assert torch.equal(m.gate_up_scales[local], torch.cat(scales)) and i % 128
            assert m.stored == "fp8"


def test_an_op_without_a_kernel_over_its_stored_format_is_refused_in_one_line(tiny_checkpoint, tmp_path,
                                                                              triton_path):
    """Qwen3-Next's Gated-DeltaNet projections in fp8: no kernel computes them from the stored bytes."""
    from hf_fixtures import quantize_checkpoint

    quantized, _ = quantize_checkpoint(tiny_checkpoint("qwen3_next", num_hidden_layers=4), "fp8",
                                       str(tmp_path / "fp8"), str(tmp_path / "twin"))
    _, named = _named(quantized)
    with pytest.raises(OpWeaveError, match="is stored fp8 .* compute it from dense weights only") as err:
        materialize(dict(enumerate(m for _, m in named)), quantized, 1, 0, torch.device("cpu"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stored_experts_compute_what_the_twins_do(published, triton_path, backend):
    """The experts of every layer, held as stored, on the torch reference (dequantized on the fly)
    and the Triton kernel (dequantized in registers, under the interpreter) against the twin's
    dense experts: float32, so equal up to the order of float32 sums."""
    from opweave.kernels import get_backend
    from opweave.models.ops_gpt_oss import experts_swiglu

    _, quantized, twin = published("gpt_oss")
    cfg, named = _named(quantized)
    modules = {i: m for i, (_, m) in enumerate(named) if m.kind == OpKind.MOE_EXPERTS_SWIGLU}
    stored = materialize(modules, quantized, 1, 0, torch.device("cpu"))
    _, twin_named = _named(twin)
    dense = materialize({i: m for i, (_, m) in enumerate(twin_named) if m.kind == OpKind.MOE_EXPERTS_SWIGLU},
                        "random", 1, 0, torch.device("cpu"), load=False)
    k = get_backend(backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.moe.num_experts, generator=g)[:cfg.moe.top_k] for _ in range(5)])[:, None]
    weights = torch.softmax(torch.randn(5, 1, cfg.moe.top_k, generator=g), -1)
    twin_reader = CheckpointReader(twin)
    for s, d in zip(stored.values(), dense.values()):
        assert s.stored == "mxfp4" and d.stored is None
        d.load_weights(twin_reader)
        with torch.no_grad():
            got = experts_swiglu(k, s, x, weights, ids)
            want = experts_swiglu(get_backend("torch"), d, x, weights, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
