"""The Llama-derived families: Llama-2 (multi-head attention), Mistral (sliding window), Qwen2 (q/k/v
bias), Qwen3 dense (q/k norm) and Mixtral (8 experts, top-2).

For each: the built-in config of a real model (parameter count against the published one, partition
blocks, the ops that make the family), token parity of one process (`DecodeStep`) with transformers
on a tiny random checkpoint saved by `save_pretrained`, and compiled plans on CPU ranks: colocated
with TP 2 and one disaggregated template, token-identical to transformers.
"""

import functools

import pytest
import torch

from hf_fixtures import hf_generate, hf_step_logits
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.ir.kinds import OpKind
from opweave.passes.trace import build_graph
from opweave.models.checkpoint import CheckpointReader
from opweave.models.config import FULL, SLIDING
from opweave.models.hf_config import config_from_hf
from opweave.models.model import DecodeStep, generate
from opweave.models.registry import resolve
from opweave.passes.blocks import find_blocks
from opweave.runtime.launch import RunConfig, run_detailed
from opweave.runtime.scheduler import Request

PROMPT = [(7 * i + 3) % 100 for i in range(20)]  # longer than the fixtures' sliding window of 8
NEW_TOKENS = 8
ATOL = 1e-4
FAMILIES = ("llama2", "mistral", "qwen2", "qwen3", "mixtral")

# Published parameter counts: exact where the hub's safetensors metadata gives them, else the model
# card's figures (total, non-embedding) at the precision printed there.
EXACT = {"llama-2-7b": 6_738_415_616, "mistral-7b-v0.1": 7_241_732_096, "mixtral-8x7b": 46_702_792_704}
CARD = {"qwen2.5-7b-instruct": (7.61e9, 6.53e9), "qwen2-72b": (72.71e9, 70.21e9), "qwen3-8b": (8.2e9, 6.95e9),
        "qwen3-32b": (32.8e9, 31.2e9)}


@functools.cache
def graph_of(name: str):
    return build_graph(resolve(name).build("meta"))


def _digits(value: float) -> float:
    """One unit of the last printed digit of a model card's figure (7.61e9 -> 0.01e9): the cards
    round some figures and truncate others (Qwen2.5-7B: 7,615,616,512 printed as 7.61B)."""
    mantissa = f"{value / 1e9:g}"
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10 ** -decimals * 1e9


@pytest.mark.parametrize("name", sorted(EXACT))
@pytest.mark.slow
def test_parameter_count_is_the_published_one(name):
    assert graph_of(name).num_parameters == EXACT[name]


@pytest.mark.parametrize("name", sorted(CARD))
@pytest.mark.slow
def test_parameter_count_matches_the_model_card(name):
    g, cfg = graph_of(name), resolve(name).cfg
    total, non_embedding = CARD[name]
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert abs(g.num_parameters - total) <= _digits(total)
    assert abs(g.num_parameters - embeddings - non_embedding) <= _digits(non_embedding)


def test_mixtral_reads_two_of_eight_experts_per_token():
    g = graph_of("mixtral-8x7b")
    assert g.num_active_parameters == pytest.approx(12.9e9, abs=0.05e9)  # "12.9B active parameters"
    experts = [op for op in g.ops if op.kind == OpKind.MOE_EXPERTS]
    assert len(experts) == 32 and all(op.active_weight_fraction == 2 / 8 for op in experts)


@pytest.mark.parametrize("name,layers", [
    ("llama-2-7b", 32), ("mistral-7b-v0.1", 32), ("mixtral-8x7b", 32), ("qwen2.5-7b-instruct", 28),
    ("qwen2-72b", 80), ("qwen3-8b", 36), ("qwen3-32b", 64),
])
def test_partition_blocks_are_one_layer(name, layers):
    bg = find_blocks(graph_of(name))
    assert (bg.period, bg.num_blocks, bg.num_tail_layers) == (1, layers, 0)


@pytest.mark.parametrize("tp", [1, 2, 8])  # 8: beyond Qwen2.5-7B's 4 KV heads (replicated)
@pytest.mark.parametrize("name", sorted({*EXACT, *CARD}))
@pytest.mark.slow
def test_state_allocated_is_the_statespec(name, tp):
    """As for the other families (tests/test_state_alloc.py): every op allocates its StateSpec's
    bytes per slot below, at and above the window (Mistral's ring buffer of 4096 positions)."""
    import test_state_alloc

    test_state_alloc.test_state_allocated_is_the_statespec(name, tp)


def test_each_family_has_its_ops():
    kinds = {name: [op.kind for op in graph_of(name).ops] for name in
             ("llama-2-7b", "mistral-7b-v0.1", "qwen2.5-7b-instruct", "qwen3-8b", "mixtral-8x7b")}
    llama2 = resolve("llama-2-7b").cfg
    assert llama2.num_kv_heads == llama2.num_heads == 32 and llama2.rope[FULL].theta == 10000.0
    assert OpKind.ATTN_FULL not in kinds["mistral-7b-v0.1"]
    window = [op for op in graph_of("mistral-7b-v0.1").ops if op.kind == OpKind.ATTN_SLIDING]
    assert len(window) == 32 and window[0].state_bytes(4096) == window[0].state_bytes(32768) > 0
    qkv = next(op for op in graph_of("qwen2.5-7b-instruct").ops if op.kind == OpKind.QKV_PROJ)
    assert [w.shape for w in qkv.weights if w.name.endswith(".bias")] == [(3584,), (512,), (512,)]
    assert kinds["qwen3-8b"].count(OpKind.QK_NORM) == 36 and OpKind.QK_NORM not in kinds["qwen2.5-7b-instruct"]
    assert kinds["mixtral-8x7b"].count(OpKind.MOE_ROUTER) == 32 and OpKind.MLP_GATE_UP not in kinds["mixtral-8x7b"]


def test_qkv_bias_splits_with_its_heads():
    """The cost model's bytes per rank and the runtime's shard shapes read one table: at TP 2 a rank
    holds half of Qwen2's q/k/v weights and biases; at TP 8 one of its 4 KV heads (replicated)."""
    from opweave.ir.tp import of_op, weight_bytes_per_rank

    qkv = next(op for op in graph_of("qwen2.5-7b-instruct").ops if op.kind == OpKind.QKV_PROJ)
    assert weight_bytes_per_rank(qkv, 2) * 2 == qkv.weight_bytes
    view = of_op(qkv)
    shapes = {w.name.rsplit(".", 2)[-2] + "." + w.name.rsplit(".", 1)[-1]: w.shape for w in qkv.weights}
    assert view.local_shape("x.q_proj.bias", shapes["q_proj.bias"], 2) == (1792,)
    assert view.local_shape("x.k_proj.bias", shapes["k_proj.bias"], 8) == (128,)
    assert not view.legal(8)  # 28 query heads do not split over 8


def test_sliding_layers_follow_the_config():
    raw = dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    assert config_from_hf(raw, "m").layer_types == (FULL, FULL)  # no window (Mistral-7B-v0.2 on)
    windowed = config_from_hf({**raw, "sliding_window": 4096}, "m")
    assert windowed.layer_types == (SLIDING, SLIDING) and windowed.sliding_window == 4096
    assert windowed.rope[SLIDING].theta == windowed.rope[FULL].theta == 10000.0  # transformers' default


def test_qwen_sliding_layers_follow_max_window_layers():
    raw = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6)
    assert config_from_hf(raw, "t").layer_types == (FULL,) * 4
    windowed = config_from_hf({**raw, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, "t")
    assert windowed.layer_types == (FULL, FULL, SLIDING, SLIDING) and windowed.sliding_window == 16
    # a window named but switched off (Qwen2.5's hub configs) is no window
    assert config_from_hf({**raw, "sliding_window": 131072}, "t").sliding_window is None


def test_family_config_errors_are_one_line():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(OpWeaveError, match="missing required field 'num_local_experts'"):
        config_from_hf({**base, "model_type": "mixtral", "num_experts_per_tok": 2}, "m")
    with pytest.raises(OpWeaveError, match=r"num_experts_per_tok \(3\) must be between 1 and the number of experts \(2\)"):
        config_from_hf({**base, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "m")
    with pytest.raises(OpWeaveError, match="'sliding_window' must be a positive integer or null, got '4k'"):
        config_from_hf({**base, "model_type": "mistral", "sliding_window": "4k"}, "m")
    with pytest.raises(OpWeaveError, match="attention_bias is not supported"):
        config_from_hf({**base, "model_type": "qwen3", "attention_bias": True}, "q")
    with pytest.raises(OpWeaveError, match="unsupported rope_type 'dynamic'"):
        config_from_hf({**base, "model_type": "qwen2", "rope_scaling": {"type": "dynamic", "factor": 4.0}}, "q")
    with pytest.raises(OpWeaveError, match="yarn rope needs 'original_max_position_embeddings'"):
        config_from_hf({**base, "model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4.0}}, "q")


# ---------------------------------------------------------------- one process vs transformers


@pytest.mark.parametrize("family,overrides", [
    *((family, {}) for family in FAMILIES),
    pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                 id="qwen2-sliding"),
])
@pytest.mark.slow
def test_decode_step_matches_transformers(tiny_checkpoint, family, overrides):
    folder = tiny_checkpoint(family, **overrides)
    model = resolve(folder).load()
    if overrides:
        assert model.cfg.layer_types == (FULL, SLIDING, SLIDING)
    logits, _ = generate(model, PROMPT, NEW_TOKENS)
    ref_prompt_logits, ref_tokens = hf_generate(folder, PROMPT, NEW_TOKENS)
    ref_step_logits = hf_step_logits(folder, PROMPT, NEW_TOKENS)
    torch.testing.assert_close(logits[: len(PROMPT)], ref_prompt_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[len(PROMPT) - 1:], ref_step_logits, atol=ATOL, rtol=0)

    # the traced unit: prefill, then one DecodeStep (greedy sampler included) per new token
    step = DecodeStep(model)
    model.allocate_state(1, len(PROMPT) + NEW_TOKENS)
    with torch.no_grad():
        tokens = [int(step(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])[0])]
        for i in range(NEW_TOKENS - 1):
            tokens.append(int(step(torch.tensor([[tokens[-1]]]), torch.tensor([[len(PROMPT) + i]]))[0]))
    assert tokens == ref_tokens
    assert len(set(tokens)) > 2, "degenerate fixture: greedy decoding repeats a token"


def test_mixtral_hub_layout_is_read(tiny_checkpoint):
    """save_pretrained writes Mixtral as the hub does (block_sparse_moe, experts' w1/w2/w3): the
    reader gives them under the per-expert names the operators ask for, whole or sliced."""
    reader = CheckpointReader(tiny_checkpoint("mixtral"))
    hub, ours = "model.layers.1.block_sparse_moe.experts.5.w3.weight", "model.layers.1.mlp.experts.5.up_proj.weight"
    assert hub in reader.key_to_file and ours not in reader.key_to_file
    assert torch.equal(reader.get(ours), reader.get(hub))
    assert torch.equal(reader.get_slice(ours, 0, 16, 32), reader.get(hub)[16:32])
    assert reader.has("model.layers.1.mlp.gate.weight") and reader.has("model.layers.1.mlp.experts.5.down_proj.weight")


# ---------------------------------------------------------------- compiled plans on CPU ranks

PROMPTS = [PROMPT, [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42], [60, 61, 62, 63, 64, 65]]
RUN_TOKENS = 6
CONTEXT = 64
COLOCATED = ("colocated", [("h100", 2, 1)])
DISAGGREGATED = {  # a template per family, TP 2 on the owner whose ops the family changes
    "llama2": ("cad", [("l40s", 2, 1), ("h100", 1, 1)]),     # MHA: 4 KV heads split over 2
    "mistral": ("cad", [("l40s", 1, 1), ("h100", 2, 1)]),    # sliding-window attention apart
    "qwen2": ("afd", [("h100", 2, 1), ("l40s", 1, 1)]),      # q/k/v biases split with their heads
    "qwen3": ("afd", [("h100", 2, 1), ("l40s", 1, 1)]),      # q/k norm on a TP 2 attention owner
    "mixtral": ("afd", [("h100", 1, 1), ("l40s", 2, 1)]),    # experts split over 2
}


@functools.cache
def reference(folder: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_generate(folder, p, RUN_TOKENS)[1]) for p in PROMPTS)


@pytest.mark.parametrize("plan", ["colocated", "disaggregated"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_plan_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family, plan):
    folder = tiny_checkpoint(family)
    template, owners = COLOCATED if plan == "colocated" else DISAGGREGATED[family]
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    compiled = pinned_plan(run_front_end(folder), cluster, template, owners, batch=4, microbatches=2,
                           context=CONTEXT)
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(PROMPTS))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests,
                                            timeout_s=300))
    assert all(r.error is None for r in outputs)
    assert min(stats["checked_rounds"]) >= RUN_TOKENS - 2
    assert [tuple(r.output) for r in outputs] == list(reference(folder))


@pytest.mark.parametrize("family", ["mistral"])
@pytest.mark.slow
def test_triton_kernel_path_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family):
    """The CUDA path's kernels (Triton, here under TRITON_INTERPRET=1 on CPU): decode attention
    within Mistral's window on every layer (the other families' ops have the kernels the four
    earlier families test in tests/test_runtime.py; projections stay torch)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("OPWEAVE_KERNELS", "triton")
    folder = tiny_checkpoint(family)
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    template, owners = DISAGGREGATED[family]
    out = str(tmp_path / "art")
    write_artifact(out, pinned_plan(run_front_end(folder), cluster, template, owners, batch=4, microbatches=2,
                                    context=CONTEXT))
    short = tuple(Request(index=i, prompt=p, max_new_tokens=3) for i, p in enumerate(PROMPTS[:2]))
    outputs, _ = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=short, timeout_s=300))
    assert [tuple(r.output) for r in outputs] == [t[:3] for t in reference(folder)[:2]]
