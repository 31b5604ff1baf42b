"""Prefill/decode disaggregation at run time (`opweave.runtime.pd`, `opweave.runtime.kvtransfer`):
the routes of a state split by heads between TP groups of different degrees, the transfer key,
the decode scheduler's reserved rows and import steps, and plans served by prefill sets on CPU
ranks, token-identical to transformers."""

import dataclasses
import functools

import pytest
import torch

from hf_fixtures import hf_generate
from opweave.ir.kinds import OpKind
from opweave.ir.tp import Split
from opweave.runtime import kvtransfer as KV
from opweave.runtime import pages as P
from opweave.runtime.scheduler import Request, Scheduler


# ---------------------------------------------------------------- routes between TP degrees
def _reshard(part: KV.Part, send_tp: int, recv_tp: int) -> None:
    """Every receiver assembles exactly its own indices from the senders' messages."""
    whole = torch.arange(part.size * 3, dtype=torch.float32).view(3, part.size).t().contiguous()  # axis 0
    part = dataclasses.replace(part, axis=0)
    shards = [whole[KV.held(part, send_tp, s)] for s in range(send_tp)]
    for r in range(recv_tp):
        mine = KV.held(part, recv_tp, r)
        got = torch.full((len(mine), 3), -1.0)
        for s, segments in KV.routes([part], send_tp, recv_tp, r).items():
            for _, src, dst, n in segments:
                got[dst:dst + n] = shards[s][src:src + n]
        assert torch.equal(got, whole[mine]), (part, send_tp, recv_tp, r)


@pytest.mark.parametrize("send_tp,recv_tp", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 4)])
def test_routes_reassemble_each_receivers_heads(send_tp, recv_tp):
    kv2 = KV.Part(0, 0, 1, 2, Split((2,), (2,)))        # 2 KV heads: replicated over TP 4
    kv8 = KV.Part(0, 0, 1, 8, Split((8,), (8,)))
    conv = KV.Part(0, 0, 0, 4 * 4 + 4 * 4 + 8 * 2, Split((16, 16, 16), (4, 4, 8)))  # Gated-DeltaNet's packed q|k|v
    latent = KV.Part(0, 0, 1, 6, None)                   # MLA: every rank holds all
    for part in (kv2, kv8, conv, latent):
        _reshard(part, send_tp, recv_tp)


def test_routes_send_each_index_once_from_its_first_holder():
    part = KV.Part(0, 0, 1, 2, Split((2,), (2,)))
    # prefill TP 4 (head 0 on ranks 0-1, head 1 on ranks 2-3) to decode TP 1: ranks 0 and 2 send
    assert {s: [(src, dst, n) for _, src, dst, n in segs] for s, segs in KV.routes([part], 4, 1, 0).items()} == \
        {0: [(0, 0, 1)], 2: [(0, 1, 1)]}


def test_transfer_key_round_trips():
    for args in [(0, 0, 0, 0, 0), (3, 7, 1, 4095, 123456), (255, 255, 255, 4095, (1 << 24) - 1)]:
        assert KV.parse_key(KV.transfer_key(*args)) == args
    assert KV.parse_key(KV.transfer_key(1, 2, 0, 3, (1 << 24) + 5))[4] == 5
    with pytest.raises(ValueError):
        KV.transfer_key(0, 0, 0, 4096, 0)


# ---------------------------------------------------------------- the schedulers
def test_decode_scheduler_reserves_a_row_then_imports_and_decodes():
    jobs = []
    s = Scheduler([Request(index=0, prompt=list(range(1, 21)), max_new_tokens=3)], 1, 2, 64, (0,),
                  prefill_on=lambda req, mb, row: jobs.append((req.index, mb, row)))
    first = s.plan_round()
    assert jobs == [(0, 0, 0)] and first == ((0, 0),) and s.last_aux == ((0, 0),)  # reserved, idle
    assert s.active
    s.prefilled(0, 77, key=12345)
    values = s.plan_round()[0]
    assert P.imported(values[0]) == 20 and P.decode(values[0]) == (0, P.START) and s.last_aux[0][0] == 12346
    assert P.held_tokens(values[0]) == 20
    nxt = s.plan_round()[0]
    assert P.decode(nxt[0])[0] == 1  # its first output, fed from the host at position 20
    assert s.pool.lengths[0] == 21
    plan = s.take(2, 0)
    assert plan.rows[0].tokens == (77,) and plan.rows[0].first == 20 and plan.rows[0].output


def test_decode_scheduler_drops_the_state_of_a_request_ended_at_prefill():
    s = Scheduler([Request(index=0, prompt=[1, 2, 3], max_new_tokens=1)], 1, 1, 64, (0,),
                  prefill_on=lambda *a: None)
    s.plan_round()
    s.prefilled(0, 9, key=5, finish_reason="length")
    assert P.imported(s.plan_round()[0][0]) == 3           # the state is taken...
    assert P.decode(s.plan_round()[0][0]) == (0, P.RELEASE)  # ...and dropped
    assert not s.active and s.done[0].output == [9] and s.done[0].finish_reason == "length"


def test_prefill_scheduler_marks_the_last_chunk_for_export_and_ends_there():
    s = Scheduler([Request(index=0, prompt=list(range(1, 11)), max_new_tokens=50, transfer=99)], 1, 1, 64, (0,),
                  prefill_chunk=4)
    auxes = []
    for _ in range(3):
        s.plan_round()
        auxes.append(s.last_aux[0][0])
    assert auxes == [0, 0, 99]
    assert P.decode(s.plan_round()[0][0]) == (0, P.RELEASE)  # one output: the row is free


# ---------------------------------------------------------------- served by prefill sets, on CPU ranks
PROMPTS = [[(7 * i + 3) % 100 for i in range(20)], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42],
           [60, 61, 62, 63, 64, 65]]
RUN_TOKENS = 6
CONTEXT = 64


@functools.cache
def _reference(folder: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_generate(folder, p, RUN_TOKENS)[1]) for p in PROMPTS)


def _pd_artifact(folder: str, out: str, template: str, owners: list, prefill_tp: int) -> str:
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    compiled = pinned_plan(run_front_end(folder), parse_cluster("h100x8+l40sx8", load_catalog()), template, owners,
                           batch=4, microbatches=2, context=CONTEXT)
    pool = {"gpu": "h100", "tp": prefill_tp, "replicas": 1, "for_sets": 1, "prefill_ms": 1.0, "kv_bytes": 1,
            "kv_transfer_ms": 0.1}
    plan = dataclasses.replace(compiled.plan, prefill={"mode": "disaggregated", "owners": [pool]})
    write_artifact(out, dataclasses.replace(compiled, plan=plan))
    return out


CASES = {  # family: (template, decode owners, prefill TP); TP differs across the transfer
    "llama": ("afd", [("h100", 2, 1), ("l40s", 1, 1)], 1),
    "gemma3": ("colocated", [("h100", 2, 1)], 1),          # sliding-window rings beside pages
    "qwen3_next": ("colocated", [("h100", 1, 1)], 2),      # Gated-DeltaNet's state from TP 2 to TP 1
    "deepseek_v3": ("colocated", [("h100", 2, 1)], 1),     # MLA's latent pages
    "mistral": ("cad", [("l40s", 1, 1), ("h100", 2, 1)], 1),  # a sliding window on every layer, under CAD
    "mixtral": ("afd", [("h100", 1, 1), ("l40s", 2, 1)], 2),  # experts split over 2; attention TP 1 from TP 2
    "gpt_oss": ("colocated", [("h100", 2, 1)], 1),         # sinks, sliding and full layers
}


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.slow
def test_disaggregated_plan_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family):
    from opweave.runtime.launch import RunConfig, run_detailed

    overrides = {"num_hidden_layers": 5} if family == "qwen3_next" else {}
    folder = tiny_checkpoint(family, **overrides)
    template, owners, prefill_tp = CASES[family]
    out = _pd_artifact(folder, str(tmp_path / "art"), template, owners, prefill_tp)
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(PROMPTS))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests,
                                            timeout_s=300))
    assert all(r.error is None for r in outputs)
    assert [tuple(r.output) for r in outputs] == list(_reference(folder))
    assert min(stats["checked_rounds"]) >= 1


@pytest.mark.slow
def test_a_server_of_a_disaggregated_plan(tiny_checkpoint, tmp_path, monkeypatch):
    """`opweave serve`'s engine over prefill sets: the first token comes from the prefill leader,
    the rest from the decode ranks; greedy and seeded tokens as a plan without them, a request
    that ends at its first token (a stop id, max_tokens 1) ends on the prefill side, a cancel."""
    from opweave.serve.engine import Engine, Sampling
    from test_serve_engine import Collect, sampled_reference

    folder = tiny_checkpoint("llama")
    out = _pd_artifact(folder, str(tmp_path / "art"), "afd", [("h100", 1, 1), ("l40s", 2, 1)], 2)
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    engine = Engine(out, folder, max_queue=16, prefill_sets=2)
    engine.start()
    try:
        want = _reference(folder)
        got = Collect()
        for i, p in enumerate(PROMPTS):
            engine.submit(p, Sampling(max_tokens=RUN_TOKENS), got.callback(i))
        engine.submit(PROMPTS[0], Sampling(max_tokens=RUN_TOKENS, stop_token_ids=(want[0][0],)), got.callback("stop"))
        engine.submit(PROMPTS[1], Sampling(max_tokens=1), got.callback("one"))
        engine.submit(PROMPTS[2], Sampling(max_tokens=RUN_TOKENS, temperature=1.0, seed=7), got.callback("seeded"))
        long = engine.submit(PROMPTS[3], Sampling(max_tokens=40), got.callback("long"))
        got.wait(list(range(len(PROMPTS))) + ["stop", "one", "seeded"], timeout=120)
        engine.cancel(long)
        got.wait(["long"], timeout=60)
        assert [tuple(got.tokens(i)) for i in range(len(PROMPTS))] == list(want)
        assert got.tokens("stop") == [want[0][0]] and got.reason("stop") == "stop"
        assert got.tokens("one") == [want[1][0]] and got.reason("one") == "length"
        assert got.tokens("seeded") == sampled_reference(folder, PROMPTS[2], RUN_TOKENS, 1.0, 1.0, 7)
        assert got.reason("long") == "cancelled"
        assert {k for k, _ in engine.stats()["round_s"]} == {0, 1, 2}  # the decode set and both prefill sets
        # a stop with requests decoding and others being prefilled: every rank ends on its own (none killed)
        for i in range(4):
            engine.submit(PROMPTS[i], Sampling(max_tokens=50), got.callback(("late", i)))
        with got.ended:
            assert got.ended.wait_for(lambda: got.tokens(("late", 0)), 60)
        engine.stop(timeout_s=120)
        assert "killed" not in (engine.error or "") and "died" not in (engine.error or ""), engine.error
        assert {got.reason(("late", i)) for i in range(4)} <= {"cancelled", "length"}
    finally:
        engine.stop()


@pytest.mark.slow
def test_a_prefill_rank_that_dies_fails_the_run_naming_it(tiny_checkpoint, tmp_path, monkeypatch):
    from opweave.errors import OpWeaveError
    from opweave.runtime.launch import RunConfig, run_detailed

    folder = tiny_checkpoint("llama")
    out = _pd_artifact(folder, str(tmp_path / "art"), "colocated", [("h100", 1, 1)], 1)
    monkeypatch.setenv("OPWEAVE_FAULT_KILL", "p0:3")  # the prefill set's rank 0, after its round 3
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(PROMPTS))
    with pytest.raises(OpWeaveError, match=r"prefill set 0, rank 0 died \(killed by signal 9\)"):
        run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests, timeout_s=120))


def test_dump_memory_covers_the_prefill_ranks(tiny_checkpoint, tmp_path):
    """`opweave dump --what memory` measures a disaggregated plan's prefill ranks too, against
    their own plan: the allocated weights and state are the planned ones (within 1%)."""
    from opweave.profile.allocated import artifact_memory

    folder = tiny_checkpoint("llama")
    out = _pd_artifact(folder, str(tmp_path / "art"), "colocated", [("h100", 2, 1)], 1)
    ranks = artifact_memory(out, activations=False)
    assert [(r.prefill, r.rank, r.tp) for r in ranks] == [(False, 0, 2), (False, 1, 2), (True, 0, 1)]
    for r in ranks:  # as tests/test_memory.py holds every plan's ranks
        for what in ("weights", "state"):
            assert getattr(r.allocated, what) == pytest.approx(getattr(r.planned, what), rel=0.01, abs=1), (r, what)
        assert r.kv_pages[0] == r.kv_pages[1] > 0


@pytest.mark.slow
def test_two_decode_sets_share_two_prefill_sets(tiny_checkpoint, tmp_path):
    """Every decode leader sends jobs to every prefill set in turn; the prefill sets stop once
    every decode leader is done."""
    from opweave.runtime.launch import RunConfig, run_detailed

    folder = tiny_checkpoint("llama")
    out = _pd_artifact(folder, str(tmp_path / "art"), "colocated", [("h100", 1, 1)], 1)
    prompts = PROMPTS * 2
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(prompts))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests,
                                            timeout_s=300, replica_sets=2, prefill_sets=2))
    assert [tuple(r.output) for r in outputs] == list(_reference(folder)) * 2
    assert len(stats["replica_sets"]) == 2


def test_an_import_step_preempted_prefills_its_request_locally():
    """A row short of pages at its import step drops the request back to the queue: it comes back
    as a local prefill, not as a second job (its state was already sent once)."""
    jobs = []
    s = Scheduler([Request(index=0, prompt=list(range(1, 33)), max_new_tokens=3)], 1, 1, 64, (0,), pages=4,
                  prefill_on=lambda req, mb, row: jobs.append(req.index))
    s.plan_round()
    s.pool.free.clear()  # the pool is taken meanwhile: the import cannot have its pages
    s.pool.cached.clear()
    s.prefilled(0, 77, key=9)
    values = s.plan_round()[0]
    assert not P.imported(values[0]) and s.queue and s.queue[0].local and jobs == [0]


@pytest.mark.slow
def test_a_prompt_started_on_the_prefill_sets_cached_prefix_sends_its_whole_state(tiny_checkpoint, tmp_path):
    """Later copies of a prompt find its pages in the prefill set's prefix cache and compute only
    the rest; the state sent is still every position of the prompt (the page pool's length)."""
    from opweave.runtime.launch import RunConfig, run_detailed

    folder = tiny_checkpoint("llama")
    out = _pd_artifact(folder, str(tmp_path / "art"), "colocated", [("h100", 1, 1)], 1)
    prompt = [(5 * i + 7) % 200 for i in range(40)]  # two whole pages and 8 positions
    requests = tuple(Request(index=i, prompt=prompt, max_new_tokens=RUN_TOKENS) for i in range(7))
    outputs, _ = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests, timeout_s=300))
    want = tuple(hf_generate(folder, prompt, RUN_TOKENS)[1])
    assert [tuple(r.output) for r in outputs] == [want] * 7
