"""Memory truth of the operators: state allocated == the planner's StateSpec; bounded prefill.

- Per family (the built-in configs, on the meta device) and per stateful op, the state a slot
  gets is exactly `StateSpec.bytes_at(context) / state_shards(op, tp)`, at contexts below and
  above Gemma's sliding window, at TP 1 to 8.
- Sliding-window caches are ring buffers: against a naive full-history oracle over more steps than
  the window, with chunks longer than the window, padding anywhere, and a slot reused for a new
  request without clearing it.
- Chunked prefill gives transformers' tokens (through `generate` and through the scheduler,
  with prefilling and decoding rows sharing steps and slots refilled).
- A prefill step's largest transient tensor does not grow with the context, and its live peak
  stays under the planner's formula (`opweave.cost.memory.activation_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from local_loop import drive
from opweave.cost.memory import activation_bytes
from opweave.cost.model import state_shards
from opweave.ir.plan import PREFILL_CHUNK
from opweave.passes.trace import build_graph
from opweave.kernels.blocks import ATTN_KEY_BLOCK
from opweave.models import ops
from opweave.models.hf_config import config_from_hf
from opweave.models.model import DecodeStep, build_model, generate
from opweave.models.registry import resolve
from opweave.runtime.scheduler import Request, Scheduler
from opweave.runtime.shard import sharded_config

FAMILY_MODELS = ["llama-3.1-8b", "gemma-3-27b", "qwen3-30b-a3b", "qwen3-next-80b-a3b"]


# ---------------------------------------------------------------------------------------------- allocation

def _as_op(module: ops.OpModule, facts):
    """What the cost model reads of an IR op: its kind and the module's facts."""
    return types.SimpleNamespace(kind=module.kind, name=module.layer,
                                 **{f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)})


def _allocated_per_slot(module: ops.OpModule, slots: int) -> int:
    total = sum(getattr(module, a).nbytes for a in module.state_attrs)
    assert total % slots == 0
    return total // slots


@pytest.mark.parametrize("tp", [1, 2, 4, 8])  # 8: more ranks than Qwen3's KV heads (replicated)
@pytest.mark.parametrize("name", FAMILY_MODELS)
@pytest.mark.slow
def test_state_allocated_is_the_statespec(name, tp):
    cfg = resolve(name).cfg
    full = build_model(cfg, "meta").op_modules()
    local = build_model(sharded_config(cfg, tp), "meta").op_modules()  # what a TP rank builds
    window = cfg.sliding_window or 4096
    stateful = 0
    for context in (window // 2, window, 4 * window + 3):  # below, at and above the window
        for op, shard in zip(full, local):
            facts = op.facts()
            if facts.state is None:
                assert not shard.state_attrs
                continue
            stateful += 1
            shard.allocate_state(3, context, "meta")
            want = facts.state.bytes_at(context) / state_shards(_as_op(op, facts), tp)
            assert _allocated_per_slot(shard, 3) == want, (name, tp, context, type(op).__name__, op.layer)
    assert stateful >= 3 * cfg.num_layers


def test_sliding_cache_is_the_window_and_full_cache_the_context():
    cfg = resolve("gemma-3-27b").cfg
    model = build_model(cfg, "meta")
    model.allocate_state(2, 32768, "meta")
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype_bytes
    for m in model.op_modules():
        if isinstance(m, ops.Attention):
            assert m.k_cache.shape[1] == (cfg.sliding_window if m.window else 32768)
            assert (m.k_cache.nbytes + m.v_cache.nbytes) == 2 * m.k_cache.shape[1] * kv


# ---------------------------------------------------------------------------------------------- ring buffer

TINY = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4, rope_theta=1e4,
            query_pre_attn_scalar=8, torch_dtype="float32")


def _oracle(q, history_k, history_v, pos, scale, window):
    """Naive attention of one query at `pos` over a sequence's whole key history (a list by position)."""
    lo = max(0, pos - window + 1) if window else 0
    keys = torch.stack(history_k[lo:pos + 1])          # [L, Hkv, D]
    vals = torch.stack(history_v[lo:pos + 1])
    group = q.shape[0] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q, keys) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, vals)


def _steps():
    """(row 0 chunk, row 1 chunk) token counts per step: prefill chunks longer than the window,
    one-token decode steps, a row idle (all padding) while the other works."""
    return [(3, 6), (6, 1), (1, 1), (0, 2), (5, 1), (1, 0), (2, 7), (1, 1), (1, 1), (4, 1)]


@pytest.mark.parametrize("block", [3, ATTN_KEY_BLOCK])
@pytest.mark.parametrize("window,context", [(4, 40), (4, 3), (None, 40)])
@pytest.mark.slow
def test_ring_buffer_matches_a_full_history(monkeypatch, window, context, block):
    from opweave.kernels import reference

    monkeypatch.setattr(reference, "ATTN_KEY_BLOCK", block)  # 3: several blocks per ring and chunk
    cfg = config_from_hf(TINY, "tiny")
    attn = ops.Attention(cfg, 0, window)
    attn.allocate_state(2, context, "cpu")
    assert attn.k_cache.shape[1] == (min(context, window) if window else context)
    attn.k_cache.normal_()  # garbage from an earlier request: must never be attended
    attn.v_cache.normal_()
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    history = [([], []), ([], [])]
    next_pos = [0, 0]
    restarts = fed = 0
    for step, counts in enumerate(_steps()):
        for row in range(2):  # a slot whose request is done takes a new one (the cache is not cleared)
            if next_pos[row] >= min(9, context):
                next_pos[row], history[row] = 0, ([], [])
                restarts += 1
        width = max(counts) if max(counts) > 0 else 1
        positions = torch.full((2, width), -1)
        for row, n in enumerate(counts):
            n = min(n, context - next_pos[row])
            pad_left = step % 2 == 0  # left padding on even steps, right padding on odd ones
            cols = range(width - n, width) if pad_left else range(n)
            for i, c in enumerate(cols):
                positions[row, c] = next_pos[row] + i
        q = torch.randn(2, width, hq, d, generator=gen)
        k = torch.randn(2, width, hkv, d, generator=gen)
        v = torch.randn(2, width, hkv, d, generator=gen)
        out = attn(q, k, v, positions).view(2, width, hq, d)
        for row in range(2):
            for c in range(width):
                p = int(positions[row, c])
                if p < 0:
                    assert torch.equal(out[row, c], torch.zeros(hq, d))
                    continue
                history[row][0].append(k[row, c])
                history[row][1].append(v[row, c])
            for c in range(width):
                p = int(positions[row, c])
                if p >= 0:
                    want = _oracle(q[row, c], *history[row], p, cfg.attn_scale, window)
                    torch.testing.assert_close(out[row, c], want, atol=1e-5, rtol=1e-5)
            next_pos[row] += int((positions[row] >= 0).sum())
            fed += int((positions[row] >= 0).sum())
    assert restarts >= 1 and fed > 3 * (window or 4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.slow
def test_decode_kernel_path_matches_the_module_on_a_wrapped_ring(monkeypatch, backend):
    """The runtime's one-token path (`KernelOp`: cache_write + the backend's decode_attention) on
    a ring that has wrapped several times equals the module (Triton: under the interpreter)."""
    from opweave.kernels import get_backend
    from opweave.runtime.kernel_ops import KernelOp

    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(get_backend("triton").attention, "ATTN_BLOCK_N", 16)
    cfg = config_from_hf(TINY, "tiny")
    a, b = ops.Attention(cfg, 0, 4), ops.Attention(cfg, 0, 4)
    a.allocate_state(3, 100, "cpu")
    b.allocate_state(3, 100, "cpu")
    wrapped = KernelOp(b, get_backend(backend))
    gen = torch.Generator().manual_seed(1)
    for pos in range(13):
        positions = torch.tensor([[pos], [pos + 20], [-1 if pos % 3 == 0 else pos]])
        q = torch.randn(3, 1, cfg.num_heads, cfg.head_dim, generator=gen)
        k, v = (torch.randn(3, 1, cfg.num_kv_heads, cfg.head_dim, generator=gen) for _ in range(2))
        want = a(q, k, v, positions)
        got = wrapped(q, k, v, positions)
        if backend == "torch":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.k_cache, b.k_cache)


# ---------------------------------------------------------------------------------------------- chunked prefill

PROMPT = [(7 * i + 3) % 100 for i in range(20)]


@functools.cache
def _hf_tokens(folder: str, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    from hf_fixtures import hf_generate

    return hf_generate(folder, list(prompt), new_tokens)[1]


@pytest.mark.parametrize("family,layers", [("gemma3", 8), ("qwen3_next", 5), ("llama", 3)])
@pytest.mark.slow
def test_chunked_prefill_matches_transformers(tiny_checkpoint, family, layers):
    from hf_fixtures import hf_generate

    folder = tiny_checkpoint(family, num_hidden_layers=layers)
    model = resolve(folder).load()
    ref_logits, ref_tokens = hf_generate(folder, PROMPT, 6)
    for chunk in (3, 7):  # both shorter than the prompt; 3 < Gemma's window of 8 < 20
        logits, tokens = generate(model, PROMPT, 6, prefill_chunk=chunk)
        torch.testing.assert_close(logits[:len(PROMPT)], ref_logits, atol=1e-4, rtol=0)
        assert tokens == ref_tokens


SCHEDULED = [PROMPT, [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13], [42], PROMPT[3:17]]


@pytest.mark.parametrize("family,layers", [("gemma3", 8), ("qwen3_next", 5)])
@pytest.mark.slow
def test_scheduler_prefills_in_chunks(tiny_checkpoint, family, layers):
    """One process drives the runtime's scheduler: 2 rows, 5 requests (slots refilled), chunk 4,
    so long prompts prefill over several steps while the other row decodes."""
    folder = tiny_checkpoint(family, num_hidden_layers=layers)
    model = resolve(folder).load()
    step = DecodeStep(model)
    model.allocate_state(2, 40)
    requests = [Request(index=i, prompt=p, max_new_tokens=5) for i, p in enumerate(SCHEDULED)]
    sched = Scheduler(requests, num_microbatches=1, rows=2, context=40, eos_ids=(), prefill_chunk=4)
    chunks, tokens, mixed = [], [], 0

    def seen(r, mb, plan, ids, positions):
        nonlocal mixed
        chunks.append(sum(len(s.tokens) for s in plan.rows))  # prompt tokens this round
        tokens.append(ids.shape[1])
        assert ids.shape[1] == sum(plan.counts)  # packed: no padding
        mixed += {"decode" if s.decode else "prefill" for s in plan.rows if not s.idle} == {"decode", "prefill"}

    with torch.no_grad():
        drive(sched, step, rows=2, on_round=seen)
    assert max(chunks) == 4 and chunks.count(4) >= 4  # the budget: 4 prompt tokens a round
    assert max(tokens) <= 4 + 1  # ... beside one decoding row's token
    assert mixed >= 2, "prefilling and decoding rows never shared a step"
    done = sorted(sched.done, key=lambda r: r.index)
    assert [r.error for r in done] == [None] * len(SCHEDULED)
    assert [r.output for r in done] == [_hf_tokens(folder, tuple(p), 5) for p in SCHEDULED]


@pytest.mark.slow
def test_scheduler_below_the_window(tiny_checkpoint):
    """Context 7 < Gemma's window of 8: the sliding caches hold the context (a ring of 7 slots);
    sequences stop at the context, their tokens a prefix of transformers'."""
    folder = tiny_checkpoint("gemma3", num_hidden_layers=8)
    model = resolve(folder).load()
    assert model.cfg.sliding_window == 8
    model.allocate_state(2, 7)
    prompts = [[5, 6, 7], [42], [60, 61, 62, 63, 64], [9, 8]]
    sched = Scheduler([Request(index=i, prompt=p, max_new_tokens=6) for i, p in enumerate(prompts)],
                      num_microbatches=1, rows=2, context=7, eos_ids=(), prefill_chunk=2)
    with torch.no_grad():
        drive(sched, DecodeStep(model), rows=2)
    done = sorted(sched.done, key=lambda r: r.index)
    for req, prompt in zip(done, prompts):
        assert req.error is None and len(req.output) == min(6, 7 - len(prompt) + 1)
        assert req.output == _hf_tokens(folder, tuple(prompt), 6)[:len(req.output)]


def test_scheduler_rejects_a_bad_chunk():
    from opweave.errors import OpWeaveError

    with pytest.raises(OpWeaveError, match="prefill chunk"):
        Scheduler([], 1, 1, 16, (), prefill_chunk=0)


# ---------------------------------------------------------------------------------------------- bounded prefill

class _Allocations(TorchDispatchMode):
    """Largest tensor and live-bytes peak of the storages created under the mode: an op's output
    on a storage not seen before is an allocation; it is freed when the last tensor object seen on
    that storage is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.refs: dict[int, list[int]] = {}  # storage -> [tensor objects alive, bytes]

    def _drop(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = func.is_view or any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key not in self.refs:
                if aliases:
                    continue  # a view of a tensor made before the step (weights, state)
                n = t.untyped_storage().nbytes()
                self.refs[key] = [0, n]
                self.largest = max(self.largest, n)
                self.live += n
                self.peak = max(self.peak, self.live)
            self.refs[key][0] += 1
            weakref.finalize(t, self._drop, key)
        return out


def _step_allocations(cfg, rows: int, tokens: int, context: int) -> _Allocations:
    """One step of `rows` x `tokens` tokens ending at the planned context, on the meta device."""
    model = build_model(cfg, "meta")
    model.allocate_state(rows, context, "meta")
    step = DecodeStep(model)
    ids = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    positions = torch.arange(context - tokens, context, device="meta").repeat(rows, 1)
    with torch.no_grad(), _Allocations() as seen:
        step(ids, positions)
    return seen


@pytest.mark.parametrize("name,layers", [("gemma-3-27b", slice(4, 6)), ("qwen3-next-80b-a3b", slice(2, 4))])
@pytest.mark.parametrize("tokens", [1, PREFILL_CHUNK])
@pytest.mark.slow
def test_step_scratch_does_not_grow_with_context(name, layers, tokens):
    """Two real layers (a sliding or linear one and a full one) with the LM head, at 1K and 64K."""
    cfg = resolve(name).cfg
    cfg = dataclasses.replace(cfg, num_layers=2, layer_types=cfg.layer_types[layers], mlp_types=cfg.mlp_types[layers])
    assert len(set(cfg.layer_types)) == 2
    short, long = (_step_allocations(cfg, 2, tokens, c) for c in (1024, 65536))
    assert short.largest == long.largest
    assert long.peak <= short.peak * 1.01 + 2 * ATTN_KEY_BLOCK * 8  # ring positions per block
    ops = build_graph(build_model(cfg, "meta")).ops
    for context, seen in ((1024, short), (65536, long)):
        bound = activation_bytes(ops, 1, 2, tokens, context)  # what the planner charges one step
        assert seen.peak <= bound, (context, seen.peak, bound)
