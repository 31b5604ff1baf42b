"""The paged KV cache: the page pool's bookkeeping, prefix reuse, and paged rounds with the
scheduler in one process against transformers (the multi-process runtime tests run the same
pages on real ranks)."""

import pytest
import torch

from opweave.ir.kinds import OpKind
from opweave.kernels import paged as PK
from opweave.kernels import reference as K
from opweave.models.registry import resolve
from opweave.runtime import pages as P
from opweave.runtime.layout import Layout, Packed
from opweave.runtime.pages import PagePool
from opweave.runtime.prefix import PrefixCache, page_keys
from opweave.runtime.scheduler import Request, Scheduler
from opweave.runtime.state import RankState


# ---------------------------------------------------------------- the pool

def test_pages_grow_release_to_free_or_cached_and_evict_least_recent():
    pool = PagePool(pages=6, slots=3, width=4, page_tokens=4)
    evicted = []
    pool.on_evict = evicted.append
    pool.apply(0, 9, P.START)             # 3 pages: 0, 1, 2 (the last partly filled)
    pool.apply(1, 4, P.START)             # 1 page: 3 (full)
    assert pool.tables[0] == [0, 1, 2] and pool.tables[1] == [3] and pool.lengths[:2] == [9, 4]
    assert pool.parent[:4] == [-1, 0, 1, -1]
    assert pool.take_changed() == [(0, [0, 1, 2, 6]), (1, [3, 6, 6, 6])]  # padded with the null page (6)
    pool.apply(0, 0, P.RELEASE)           # full pages 0, 1 cached (tail first), partial page 2 free
    assert list(pool.free) == [4, 5, 2] and list(pool.cached) == [1, 0]
    assert pool.available == 5 and pool.take_changed() == [(0, [6, 6, 6, 6])]
    pool.apply(2, 16, P.START)            # takes 4, 5, 2, then evicts the least recently used cached page: 1
    assert pool.tables[2] == [4, 5, 2, 1] and evicted == [1] and list(pool.cached) == [0]
    pool.apply(0, 1, P.SHARED + 3)        # starts on page 3's chain (held by slot 1 too), then grows
    assert pool.tables[0] == [3, 0] and pool.refs[3] == 2 and pool.lengths[0] == 5 and not pool.cached
    with pytest.raises(Exception, match="all held"):
        pool.apply(1, 5, P.NONE)          # slot 1 needs a second page: none is free or cached
    with pytest.raises(RuntimeError, match="exceed"):
        pool.apply(2, 1, P.NONE)          # past the slot's 4 pages


def test_control_word_values_carry_tokens_and_events():
    for tokens, event in ((0, 0), (1, P.RELEASE), (128, P.START), (3, P.SHARED + 12345)):
        assert P.decode(P.encode(tokens, event)) == (tokens, event)
    with pytest.raises(ValueError):
        P.encode(1 << 24, 0)
    value = P.encode(5, P.SHARED + 7, sampled=True)
    assert P.decode(value) == (5, P.SHARED + 7) and P.sampled(value) and P.held_tokens(value) == 5
    assert not P.sampled(P.encode(5, P.SHARED + 7, padding=True))


def test_rows_drawing_at_a_positive_temperature_are_marked_on_their_output_steps():
    """The control word says which rows the sampler must walk the vocabulary for: a sampled
    request's steps that draw an output (its last prompt chunk, then each decode step), never its
    earlier chunks, a greedy request's steps, or idle rows."""
    from opweave.kernels.sampling import encode

    reqs = [Request(index=0, prompt=[3] * 6, max_new_tokens=2, sampling=encode(0.7, 1.0, 1)),
            Request(index=1, prompt=[4] * 2, max_new_tokens=2)]
    sched = Scheduler(reqs, num_microbatches=1, rows=3, context=64, eos_ids=(), prefill_chunk=4)
    marks = []
    for _ in range(3):
        values = sched.plan_round()[0]
        marks.append(tuple((P.decode(v)[0], P.sampled(v)) for v in values))
    assert marks[0] == ((4, False), (0, False), (0, False))  # request 0's first chunk draws nothing
    assert marks[1] == ((2, True), (2, False), (0, False))   # its last chunk draws its first output
    assert marks[2] == ((1, True), (1, False), (0, False))


def test_prefix_keys_chain_and_lookup_stops_at_a_broken_chain():
    a = list(range(40))
    keys = page_keys(a, 16)
    assert len(keys) == 2 and keys != page_keys(list(range(1, 41)), 16)
    assert page_keys(a[:16] + [0] * 16, 16)[0] == keys[0] and page_keys(a[:16] + [0] * 16, 16)[1] != keys[1]
    pool = PagePool(pages=8, slots=2, width=4, page_tokens=16)
    cache = PrefixCache(pool)
    pool.apply(0, 40, P.START)
    assert cache.register(pool.tables[0], keys, a, 0, 40, round_index=0) == (0, 1)
    assert cache.lookup(keys, a, ready=0) == (0, -1)       # its round has not started
    assert cache.lookup(keys, a, ready=1) == (2, 1)        # both pages, ending at page 1
    assert cache.lookup(keys, a[:32], ready=1) == (1, 0)   # a 32-token prompt computes its last page
    assert cache.lookup(keys, a[:16] + [0] * 24, ready=1) == (1, 0)  # the same keys, other tokens (as a
    cache.forget((0,))                                     # hash collision would be): not found
    assert cache.lookup(keys, a, ready=1) == (0, -1)
    assert cache.queried == 40 * 4 + 32 and cache.hit == 32 + 16 + 16


def test_a_found_prefix_is_held_before_other_rows_take_pages():
    """Within a microbatch's round every row's page event comes before any row's tokens: a row
    starting on cached pages holds them before a decoding row that needs a page reuses the least
    recently used cached one."""
    pool = PagePool(pages=5, slots=3, width=3, page_tokens=2)
    pool.apply_rows([(2, 4, P.START)])                 # a prompt fills pages 0, 1
    pool.apply_rows([(2, 0, P.RELEASE), (0, 4, P.START), (1, 2, P.START)])  # 0, 1 cached; slots 0, 1: 2, 3, 4
    pool.apply_rows([(1, 0, P.RELEASE)])               # page 4 cached too: least recent first 1, 0, 4
    assert list(pool.cached) == [1, 0, 4] and not pool.free
    pool.apply_rows([(0, 1, P.NONE), (2, 0, P.SHARED + 1)])  # slot 0 grows; slot 2 starts on pages 0, 1
    assert pool.tables[2] == [0, 1] and pool.tables[0] == [2, 3, 4] and pool.lengths[2] == 4


def test_a_short_pool_admits_by_free_pages_and_preempts_the_newest_request():
    """Two 30-token prompts in a pool of 5 pages (16 tokens each): both are admitted (2 pages +
    their first output each) and decode until both need a third page in the same round, one more
    than is free; the newer one is then preempted (its 2 pages dropped), waits for its outputs in
    flight, and is computed
    again from its prompt and those outputs once the older one ends. Tokens that depend only on
    the position come out as without preemption; a prompt longer than the whole pool fails alone;
    every page comes back."""
    from local_loop import drive

    def step(ids, positions):  # a "model" whose next token is a function of the position
        return (positions[:, -1:] * 7 + 3) % 101

    a, b = Request(index=0, prompt=[5] * 30, max_new_tokens=8), Request(index=1, prompt=[6] * 30, max_new_tokens=8)
    huge = Request(index=2, prompt=[7] * 90, max_new_tokens=2)
    sched = Scheduler([a, b, huge], num_microbatches=1, rows=2, context=128, eos_ids=(), prefill_chunk=64, pages=5)
    drive(sched, step, rows=2)
    want = [(p * 7 + 3) % 101 for p in range(29, 37)]
    assert a.output == want and b.output == want and a.finish_reason == b.finish_reason == "length"
    assert sched.preemptions == 1
    assert huge.finish_reason == "error" and "needs 6 KV pages" in huge.error and "the pool has 5" in huge.error
    assert sched.pool.available == sched.pool.pages and not any(sched.pool.tables)
    with pytest.raises(Exception, match="a KV pool of 0 pages"):
        Scheduler([], 1, 2, 128, eos_ids=(), pages=0)


# ---------------------------------------------------------------- the kernels

def test_paged_kernels_equal_the_ring_buffer_kernels():
    """The same keys in a per-slot cache and in scattered pages: the same attention, decode and chunk."""
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, page, width = 3, 4, 2, 8, 4, 5
    context = page * width
    lengths = [7, 13, 20]
    ring_k = torch.randn(b, context, hkv, d, generator=gen)
    ring_v = torch.randn(b, context, hkv, d, generator=gen)
    pages = b * width + 1
    k_pages = torch.randn(pages, page, hkv, d, generator=gen) * 100  # garbage where nothing is written
    v_pages = torch.randn(pages, page, hkv, d, generator=gen) * 100
    order = torch.randperm(b * width, generator=gen)
    table = order.view(b, width).to(torch.int32)
    for row, n in enumerate(lengths):
        positions = torch.arange(n).view(1, n)
        PK.paged_cache_write(k_pages, v_pages, table[row:row + 1], ring_k[row:row + 1, :n], ring_v[row:row + 1, :n],
                             positions)
    q = torch.randn(b, hq, d, generator=gen)
    last = torch.tensor([n - 1 for n in lengths])
    want = K.decode_attention(q, ring_k, ring_v, last, 0.3, None)  # slot j holds position j; j > last masked
    for span in (width, 5):
        torch.testing.assert_close(PK.paged_decode_attention(q, k_pages, v_pages, table, last, 0.3, span), want)
    # a chunk of 3 tokens after each row's first 4 positions
    t = 3
    cq = torch.randn(b, t, hq, d, generator=gen)
    ck, cv = torch.randn(b, t, hkv, d, generator=gen), torch.randn(b, t, hkv, d, generator=gen)
    cpos = torch.arange(4, 4 + t).expand(b, -1).clone()
    cpos[2, 0] = -1  # padding inside a row
    got = PK.paged_chunk_attention(cq, ck, cv, k_pages, v_pages, table, cpos, 0.3, 2)
    want = K.chunk_attention(cq, ck, cv, ring_k, ring_v, cpos, 0.3, None)  # each row's positions < its first
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- paged rounds against transformers

def _paged_model(folder: str, rows: int, context: int, pages: int | None = None):
    """The model with its state in a `RankState` (full attention in pages) and its stateful ops and
    LM head run as a packed round runs them; returns (model, state, current layout holder)."""
    model = resolve(folder).load()
    modules = {i: m for i, m in enumerate(model.op_modules()) if getattr(m, "state_attrs", ())}
    state = RankState.allocate(modules, rows, 1, context, "cpu", pages=pages)
    current: list[Layout] = []
    for i, m in enumerate(model.op_modules()):
        if getattr(m, "state_attrs", ()) or m.kind == OpKind.LM_HEAD:
            def packed(*args, state=None, _f=m.forward, _m=m, _i=i, _s=state):
                wrapped = Packed(_f, lambda: current[0], last=_m.kind == OpKind.LM_HEAD)
                return wrapped(*args) if _m.kind == OpKind.LM_HEAD else wrapped(*args, state=_s.view(_i, 0))
            m.forward = packed
    return model, state, current


def _drive(sched, model, state, rows, arrivals, cancels, current) -> None:
    """The runtime's loop in one process: plans two rounds ahead, replays each round's agreed
    values into the rank's pool before it runs (as `Runtime._start_round` does), learns late."""
    from opweave.runtime.inputs import RowInputs

    inputs = RowInputs(rows, 1, torch.device("cpu"))
    tokens = torch.zeros(rows, dtype=torch.long)
    sampled = {}
    agreed = [sched.plan_round()[0], sched.plan_round()[0]]
    r = 0
    while sched.active or any(k >= r for k in arrivals):
        for req in arrivals.pop(r, []):
            sched.add(req)
        for index in cancels.pop(r, []):
            sched.cancel(index)
        plan = sched.take(r, 0)
        state.apply_round((agreed[r],), 0)
        layout = Layout(tuple(P.decode(v)[0] for v in agreed[r]))
        if layout.tokens:
            inputs.prepare(0, plan, layout)
            ids, positions = inputs.ids(0, tokens)
            current[:] = [layout]
            tokens = model(ids, positions)[:, 0].argmax(-1)
        sampled[r] = tokens.tolist()
        if r >= 2:
            sched.learn(r - 2, 0, sampled.pop(r - 2))
        agreed.append(sched.plan_round()[0])
        r += 1
        assert r < 800, "the scheduler never finished"
    for values in agreed[r:]:  # the rounds planned ahead, not run: the scheduler's copy has them
        state.apply_round((values,), 0)
    assert state.pool.tables == sched.pool.tables and state.pool.refs == sched.pool.refs  # the same pages
    assert not any(state.pool.tables) and state.pool.available == state.pool.pages  # every page back


@pytest.fixture(scope="module")
def paged_llama(tmp_path_factory):
    from hf_fixtures import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("paged_llama")), num_hidden_layers=2)


def test_a_cached_prompt_starts_at_its_last_page(paged_llama):
    """The same 40-token prompt twice, the second after the first has prefilled: it starts on the
    first's two full pages (32 tokens cached) and both get transformers' tokens."""
    from test_state_alloc import _hf_tokens

    prompt = [(7 * i) % 190 + 3 for i in range(40)]
    model, state, current = _paged_model(paged_llama, rows=2, context=64)
    first, second = Request(index=0, prompt=prompt, max_new_tokens=4), Request(index=1, prompt=prompt, max_new_tokens=4)
    sched = Scheduler([], 1, 2, 64, eos_ids=(), prefill_chunk=16, prefix_cache=True)
    with torch.no_grad():
        _drive(sched, model, state, 2, {0: [first], 6: [second]}, {}, current)
    want = _hf_tokens(paged_llama, tuple(prompt), 4)
    assert first.output == want and second.output == want
    assert sched.prefix.hit == 32 and sched.prefix.queried == 80


def test_arrivals_shared_prefixes_and_cancellations_keep_every_requests_tokens(paged_llama):
    """Requests sharing prefixes arrive at random rounds into few rows, with prefix reuse on or off
    and decode rounds bucketed or not, prompts prefilled under a small budget, some cancelled, the
    pool full-sized or short (admission waits for pages, the newest rows are preempted and computed
    again): every request that ends by itself has
    transformers' greedy tokens, a cancelled one a prefix of them; the rank's pool replayed from
    the agreed values equals the scheduler's copy."""
    from hypothesis import HealthCheck, example, given, settings, strategies as st

    from test_state_alloc import _hf_tokens

    base = [(11 * i) % 197 + 3 for i in range(48)]
    request = st.tuples(st.integers(0, 48), st.lists(st.integers(3, 200), min_size=1, max_size=6),
                        st.integers(1, 4), st.integers(0, 8), st.one_of(st.none(), st.integers(0, 8)))
    hits, preempted = [], []

    # Besides the drawn examples, one that surely preempts: three 15-token prompts fill a page each
    # of a 4-page pool, then each grows into a second page while one is free.
    @example(reqs=[(10, [5, 6, 7, 8, 9], 4, 0, None)] * 3, rows=3, chunk=16, reuse=False, buckets=False, short=8)
    @settings(max_examples=32, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(reqs=st.lists(request, min_size=1, max_size=6), rows=st.integers(1, 4), chunk=st.sampled_from([5, 16, 40]),
           reuse=st.booleans(), buckets=st.booleans(), short=st.one_of(st.none(), st.integers(0, 12)))
    def check(reqs, rows, chunk, reuse, buckets, short):
        context = 64  # 4 pages a slot; the longest request (54 prompt + 4 output tokens) needs 4
        pages = None if short is None else max(4, rows * 4 - short)  # a short pool: admission waits, rows preempted
        model, state, current = _paged_model(paged_llama, rows, context, pages)
        arrivals, cancels, made = {}, {}, []
        for i, (shared, tail, n, at, cancel) in enumerate(reqs):
            req = Request(index=i, prompt=base[:shared] + tail, max_new_tokens=n)
            made.append(req)
            arrivals.setdefault(at, []).append(req)
            if cancel is not None:
                cancels.setdefault(at + cancel, []).append(i)
        sched = Scheduler([], 1, rows, context, eos_ids=(), prefill_chunk=chunk, prefix_cache=reuse, buckets=buckets,
                          pages=pages)
        with torch.no_grad():
            _drive(sched, model, state, rows, arrivals, cancels, current)
        if reuse:
            hits.append(sched.prefix.hit)
        preempted.append(sched.preemptions)
        for req in made:
            want = _hf_tokens(paged_llama, tuple(req.prompt), req.max_new_tokens)
            assert req.finish_reason in ("length", "cancelled"), (req.index, req.finish_reason, req.error)
            if req.finish_reason == "length":
                assert req.output == want, (req.index, req.prompt)
            else:
                assert req.output == want[:len(req.output)], (req.index, req.prompt)

    check()
    assert sum(hits) > 0  # some prompts did start on cached pages
    assert sum(preempted) > 0  # some short pools preempted rows, whose requests still got their tokens


# ---------------------------------------------------------------- on real ranks

@pytest.mark.parametrize("plan", ["colocated", "afd", "cad"])
@pytest.mark.slow
def test_ranks_reuse_prefixes_and_keep_transformers_tokens(tiny_checkpoint, tmp_path, capsys, plan):
    """`opweave run` of prompts that share their first pages, on real ranks: the later ones start on
    the earlier ones' cached pages (colocated and AFD: the KV ranks hold the schedulers' rows) or
    prefill whole (CAD: core attention on two replicas under one scheduler, so no reuse), and every
    prompt gets transformers' greedy tokens, as with `--no-prefix-cache`, and with a short pool
    (`--kv-pages`: requests wait for pages and rows are preempted; refused under CAD)."""
    import json

    from opweave.cli import main
    from hf_fixtures import hf_generate
    from test_runtime import compile_pinned

    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path / "art")
    compile_pinned(folder, plan, art)  # batch 4 in 2 microbatches, context 64
    shared = [(5 * i) % 90 + 3 for i in range(36)]
    prompts = [shared + [7, 8], shared + [9], shared[:20] + [4, 4, 4], shared + [7, 8], shared + [11, 12, 13],
               shared + [9], shared + [7, 8, 1], shared[:33]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    want = [hf_generate(folder, p, 4)[1] for p in prompts]
    got = {}
    for flags in ([], ["--no-prefix-cache"]):
        assert main(["run", art, "--weights", folder, "--prompts", str(path), "--max-new-tokens", "4", "--json",
                     *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [o["token_ids"] for o in out["outputs"]] == want, (plan, flags)
        got[bool(flags)] = out["stats"]["prefix_cache"]
        assert out["stats"]["preemptions"] == 0
    assert got[True] == {"queried": 0, "hit": 0}
    # a pool of 7 pages for 4 slots of 4: prompts of 3 pages wait for pages, and rows growing into a
    # 4th page are preempted
    short = ["run", art, "--weights", folder, "--prompts", str(path), "--max-new-tokens", "20", "--json",
             "--kv-pages", "7"]
    if plan == "cad":
        assert got[False] == {"queried": 0, "hit": 0}
        assert main(short) == 2
        assert "--kv-pages: not under this plan" in capsys.readouterr().err
    else:
        assert got[False]["queried"] == sum(map(len, prompts)) and got[False]["hit"] >= 32
        for flags in ([], ["--no-prefix-cache"]):
            assert main(short + flags) == 0
            out = json.loads(capsys.readouterr().out)
            assert [o["token_ids"] for o in out["outputs"]] == [hf_generate(folder, p, 20)[1] for p in prompts]
            assert out["stats"]["preemptions"] > 0, (plan, flags)
    assert main(short[:-1] + ["17"]) == 2
    assert "--kv-pages 17 exceeds what the plan's memory holds" in capsys.readouterr().err


def test_decode_rounds_fill_their_bucket_with_padding_that_takes_no_page():
    """With buckets (CUDA graphs), a decode round computes rows [0, 1 | 2 | 4 | ...): free rows
    below the bucket feed a padding token, marked so no pool gives them a page; prompt rounds
    are left alone."""
    reqs = [Request(index=i, prompt=[3 + i] * 2, max_new_tokens=6 - 2 * i) for i in range(3)]
    sched = Scheduler(reqs, num_microbatches=1, rows=8, context=64, eos_ids=(), prefill_chunk=64, buckets=True)
    assert sched.plan() == ((2, 2, 2, 0, 0, 0, 0, 0),)  # prompts: no bucket
    values = sched.plan_round()[0]                      # 3 decoding rows -> a bucket of 4
    assert tuple(P.decode(v)[0] for v in values) == (1, 1, 1, 1, 0, 0, 0, 0)
    assert values[3] == P.encode(1, P.NONE, padding=True) and P.held_tokens(values[3]) == 0
    assert P.held_tokens(values[0]) == 1
    assert sched.plan() == ((1, 1, 0, 0, 0, 0, 0, 0),)  # request 2 has its 2 outputs: 2 rows -> 2
    assert sched.plan() == ((1, 1, 0, 0, 0, 0, 0, 0),)
    assert sched.plan() == ((1, 0, 0, 0, 0, 0, 0, 0),)  # request 1 has its 4: 1 row
    assert sched.pool.tables[3] == [] and sched.pool.lengths[3] == 0  # the padding row took no page
    pool = PagePool.for_context(8, 64)
    pool.apply(5, P.held_tokens(P.encode(1, P.NONE, padding=True)), P.NONE)
    assert pool.tables[5] == [] and pool.lengths[5] == 0


def test_decode_reads_the_whole_table_under_capture_and_chunks_what_the_rows_hold():
    pages = torch.zeros(9, 16, 1, 4)
    table = torch.zeros(2, 8, dtype=torch.int32)
    lengths = [0, 0, 3, 20]
    cpu = PK.PagedKV(pages, pages, table, lengths, base=2)
    cuda = PK.PagedKV(pages, pages, table, lengths, base=2, whole=True)
    assert cpu.span == cpu.chunk_span == 2 and cuda.span == 8 and cuda.chunk_span == 2
    assert cuda.rows(0, 1).span == 8 and cuda.rows(0, 1).chunk_span == 1 and cpu.rows(1, 2).span == 2
