"""GPT-OSS parity with transformers: learned attention sinks, alternating sliding / full layers,
biased q/k/v/o projections, YaRN rope (truncate off), the biased top-k router and the
clamped-SwiGLU experts with biases, through OpWeave's generic model and its compiled plans.

A tiny random float32 checkpoint (`hf_fixtures`, family "gpt_oss") is saved with transformers'
save_pretrained; OpWeave reads it as a Hugging Face folder. One process (`generate`, `DecodeStep`)
must match transformers' logits; compiled plans of every template family (colocated, AFD, CAD and
a mixed one, with TP 2 owners) on gloo CPU ranks, and the Triton kernel path under the
interpreter, must give transformers' greedy tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from hf_fixtures import hf_generate, hf_step_logits, make_tiny_checkpoint  # noqa: E402
from opweave.compiler.compile import write_artifact  # noqa: E402
from opweave.compiler.frontend import run_front_end  # noqa: E402
from opweave.compiler.pinned import pinned_plan  # noqa: E402
from opweave.errors import OpWeaveError  # noqa: E402
from opweave.hardware.catalog import load_catalog  # noqa: E402
from opweave.hardware.cluster import parse_cluster  # noqa: E402
from opweave.ir.kinds import OpKind  # noqa: E402
from opweave.models.config import FULL, SLIDING  # noqa: E402
from opweave.models.hf_config import config_from_hf
from opweave.models.model import DecodeStep, generate  # noqa: E402
from opweave.models.ops_gpt_oss import GptOssExperts  # noqa: E402
from opweave.models.registry import resolve  # noqa: E402
from opweave.runtime.launch import RunConfig, run_detailed  # noqa: E402
from opweave.runtime.scheduler import Request  # noqa: E402

PROMPT = [(7 * i + 3) % 100 for i in range(20)]  # longer than the fixture's sliding window of 8
NEW_TOKENS = 8
ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("gpt_oss", str(tmp_path_factory.mktemp("gpt_oss")))


@pytest.fixture(scope="module")
def model(ckpt):
    return resolve(ckpt).load()


@functools.cache
def _hf(folder: str, prompt: tuple[int, ...], tokens: int):
    return hf_generate(folder, list(prompt), tokens)


def test_config_exercises_every_gpt_oss_feature(model):
    cfg = model.cfg
    assert cfg.family == "gpt_oss" and cfg.dtype == "float32"
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL) and cfg.sliding_window == 8
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias
    rope = cfg.rope[FULL]
    assert rope.rope_type == "yarn" and not rope.truncate and rope.attention_factor > 1
    assert cfg.moe.expert_style == "swiglu_clamped" and cfg.moe.swiglu_limit == 7.0
    kinds = [m.kind for m in model.op_modules()]
    assert kinds.count(OpKind.MOE_EXPERTS_SWIGLU) == 4 and OpKind.MOE_EXPERTS not in kinds
    assert kinds.count(OpKind.ATTN_SLIDING) == kinds.count(OpKind.ATTN_FULL) == 2
    biases = [torch.count_nonzero(m.down_bias) for m in model.op_modules() if isinstance(m, GptOssExperts)]
    assert all(b > 0 for b in biases)  # the fixture's expert biases are not the zeros of its init


def test_logits_and_tokens_match_transformers(ckpt, model):
    """Prefill (chunks of 128 and of 3: the sliding cache wraps between chunks) and decode
    against transformers' uncached forward and cached generation; the traced `DecodeStep` gives
    the same greedy tokens."""
    hf_prompt, hf_ids = _hf(ckpt, tuple(PROMPT), NEW_TOKENS)
    hf_steps = hf_step_logits(ckpt, PROMPT, NEW_TOKENS)
    t = len(PROMPT)
    for chunk in (128, 3):
        logits, tokens = generate(model, PROMPT, NEW_TOKENS, prefill_chunk=chunk)
        torch.testing.assert_close(logits[:t], hf_prompt, atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[t - 1:], hf_steps, atol=ATOL, rtol=0)
        assert tokens == hf_ids
    step = DecodeStep(model)
    model.allocate_state(1, t + NEW_TOKENS)
    with torch.no_grad():
        tokens = [int(step(torch.tensor([PROMPT]), torch.arange(t)[None])[0])]
        for i in range(NEW_TOKENS - 1):
            tokens.append(int(step(torch.tensor([[tokens[-1]]]), torch.tensor([[t + i]]))[0]))
    assert tokens == hf_ids
    assert len(set(tokens)) > 2, "degenerate fixture: greedy decoding repeats a token"


def test_mxfp4_weights_and_other_quantizations_are_refused(model):
    class Mxfp4Reader:  # what a published GPT-OSS checkpoint holds for the experts
        def has(self, key):
            return key.endswith(("_blocks", "_scales"))

    experts = next(m for m in model.op_modules() if isinstance(m, GptOssExperts))
    with pytest.raises(OpWeaveError, match="MXFP4-quantised.*dequantise"):
        experts.load_weights(Mxfp4Reader())
    raw = dict(model_type="gpt_oss", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
               rope_theta=150000.0)
    assert config_from_hf({**raw, "quantization_config": {"quant_method": "mxfp4"}}, "g").moe.num_experts == 4
    with pytest.raises(OpWeaveError, match="unsupported quantization_config quant_method 'gptq'"):
        config_from_hf({**raw, "quantization_config": {"quant_method": "gptq"}}, "g")
    with pytest.raises(OpWeaveError, match="'sliding_window' must be a positive integer"):
        config_from_hf({**raw, "sliding_window": 0}, "g")


# ---------------------------------------------------------------- compiled plans on CPU ranks

PROMPTS = [PROMPT, [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42]]
RUN_TOKENS = 5
CONTEXT = 64
PLANS = {  # every template family, TP 2 on the owners whose ops GPT-OSS changes
    "colocated": ("colocated", [("h100", 2, 1)]),                              # everything split over 2
    "afd": ("afd", [("h100", 2, 1), ("l40s", 2, 1, "ep")]),                    # sinks TP 2 / experts whole, EP 2
    "cad": ("cad", [("l40s", 1, 1), ("h100", 2, 1)]),                          # sink attention apart, TP 2
    "mixed": ("S:pre_attn+post_attn|F:mid+end", [("h100", 2, 1), ("l40s", 1, 1)]),  # CAD sliding, AFD full
}


def _run(folder, tmp_path, template, owners, requests):
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    out = str(tmp_path / "art")
    write_artifact(out, pinned_plan(run_front_end(folder), cluster, template, owners, batch=4, microbatches=2,
                                    context=CONTEXT))
    return run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests, timeout_s=300))


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.slow
def test_plan_generates_reference_tokens(ckpt, tmp_path, plan):
    template, owners = PLANS[plan]
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(PROMPTS))
    outputs, _ = _run(ckpt, tmp_path, template, owners, requests)
    assert all(r.error is None for r in outputs)
    assert [tuple(r.output) for r in outputs] == [tuple(_hf(ckpt, tuple(p), RUN_TOKENS)[1]) for p in PROMPTS]


@pytest.mark.slow
def test_triton_kernel_path_generates_reference_tokens(ckpt, tmp_path, monkeypatch):
    """The CUDA path's kernels under TRITON_INTERPRET=1: sink-aware decode attention (sliding and
    full), the biased router and the clamped-SwiGLU experts, on a TP 2 colocated plan whose
    experts are expert-parallel (each rank's kernel runs its own experts' pairs)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("OPWEAVE_KERNELS", "triton")
    template, owners = "colocated", [("h100", 2, 1, "ep")]
    prompt = PROMPTS[2]  # 10 tokens: the decode steps attend past the window of 8
    outputs, _ = _run(ckpt, tmp_path, template, owners, (Request(index=0, prompt=prompt, max_new_tokens=2),))
    assert [tuple(r.output) for r in outputs] == [tuple(_hf(ckpt, tuple(prompt), RUN_TOKENS)[1][:2])]


# ---------------------------------------------------------------- built-in configs

# OpenAI's model card: total and active parameters. Active counts what one token reads: every
# weight but the embedding table (a lookup) and the unselected experts, with the unembedding
# (LM head) counted. OpWeave's `num_active_parameters` also counts the embedding table (its op
# is resident and read per token), so the card's figure is that minus the table.
CARD = {"gpt-oss-120b": (116.8e9, 5.1e9), "gpt-oss-20b": (20.9e9, 3.6e9)}


@pytest.mark.parametrize("name", sorted(CARD))
@pytest.mark.slow
def test_builtin_config_reproduces_the_published_parameter_counts(name):
    from opweave.passes.trace import build_graph

    graph = build_graph(resolve(name).build("meta"))
    total, active = CARD[name]
    embed = next(op for op in graph.ops if op.kind == OpKind.EMBED).num_parameters
    assert abs(graph.num_parameters - total) < 0.05e9
    assert abs(graph.num_active_parameters - embed - active) < 0.05e9
    # the sliding layers' KV is capped at the window: half the layers hold 128 positions
    cfg = resolve(name).cfg
    assert cfg.sliding_window == 128 and cfg.layer_types.count(SLIDING) == cfg.num_layers // 2
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype_bytes
    half = cfg.num_layers // 2
    assert graph.state_bytes(8192) == per_token * half * (8192 + 128)
