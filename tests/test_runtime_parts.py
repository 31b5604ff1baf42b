"""The runtime's parts without processes: per-microbatch state views (`runtime/state.py`), the TP
group's fan-out / shard / gather / all-reduce / argmax on threads of one process
(`runtime/tpgroup.py`), and message packing and assembly (`runtime/message.py`,
`runtime/transport.py`). The end-to-end runs are in test_runtime.py and test_processes.py."""

import os
import threading

import pytest
import torch
from torch import nn

from opweave.kernels.reference import NON_FINITE_TOKEN
from opweave.kernels.paged import PagedKV
from opweave.runtime.pages import PAGE_TOKENS
from opweave.kernels.sampling import WORD
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.ir.tp import REPLICATED, Split
from opweave.models.hf_config import config_from_hf
from opweave.models.model import build_model
from opweave.models.ops import OpModule, torch_dtype
from opweave.runtime.message import message_bytes, pack_message, unpack_message
from opweave.runtime.state import RankState
from opweave.runtime.tpgroup import TPGroup
from opweave.runtime.layout import Layout
from opweave.runtime.transport import assemble

# ---------------------------------------------------------------- state views


def _stateful_modules(folder: str) -> dict[int, OpModule]:
    """The stateful op modules of a tiny model (attention and Gated-DeltaNet for Qwen3-Next)."""
    import json

    with open(os.path.join(folder, "config.json")) as f:
        cfg = config_from_hf(json.load(f), "tiny")
    model = build_model(cfg, "cpu")
    return {i: m for i, m in enumerate(model.modules()) if isinstance(m, OpModule) and m.state_attrs}


def test_state_views_are_disjoint_rows_of_one_allocation(tiny_checkpoint):
    modules = _stateful_modules(tiny_checkpoint("qwen3_next", num_hidden_layers=4))
    kinds = {m.kind.value for m in modules.values()}
    assert {"attn_linear", "attn_full"} <= kinds
    rows, mbs = 3, 4
    state = RankState.allocate(modules, rows, mbs, context=16, device="cpu")
    assert set(state.ops) == set(modules)
    paged = {i for i, m in modules.items() if m.paged}
    assert paged and paged != set(modules)  # full attention in pages, Gated-DeltaNet per slot
    for i in paged:  # one pool per layer: slots x ceil(context / page) pages and the null page;
        m, views = modules[i], state.views(i)  # every microbatch sees it with its rows of one table
        assert m.k_cache.shape[:2] == (rows * mbs * 1 + 1, PAGE_TOKENS)
        for mb, view in enumerate(views):
            assert isinstance(view, PagedKV) and view.k_pages is m.k_cache and view.v_pages is m.v_cache
            assert view.table.untyped_storage().data_ptr() == state.table.untyped_storage().data_ptr()
            assert view.table.shape == (rows, 1) and view.base == mb * rows
            assert view.rows(1, 3).table.shape == (2, 1) and view.rows(1, 3).base == mb * rows + 1
        assert bool((state.table == state.pool.null).all())  # no slot holds a page yet
    for i, m in modules.items():
        if i in paged:
            continue
        views = state.views(i)
        assert len(views) == mbs
        for a, full in zip(m.state_attrs, (getattr(m, a) for a in m.state_attrs)):
            assert full.shape[0] == rows * mbs  # one allocation for every microbatch
        for mb, view in enumerate(views):
            assert len(view) == len(m.state_attrs)
            for t, a in zip(view, m.state_attrs):
                full = getattr(m, a)
                assert t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                t.fill_(mb + 1)  # write through the view: exactly its rows of the full tensor change
        for a in m.state_attrs:
            full = getattr(m, a)
            for mb in range(mbs):
                assert bool((full[mb * rows:(mb + 1) * rows] == mb + 1).all())
        assert state.view(i, 2) is views[2]  # made once, not per call
    with pytest.raises(KeyError, match="no per-sequence state"):
        state.views(-1)


def test_state_refuses_an_allocation_of_another_size(tiny_checkpoint):
    modules = _stateful_modules(tiny_checkpoint("llama", num_hidden_layers=2))
    for m in modules.values():
        m.allocate_state(5, 8, "cpu")
    with pytest.raises(ValueError, match="not 2 x 3 rows"):
        RankState(modules, rows=3, num_microbatches=2)


def test_stateful_ops_use_the_state_passed_not_their_own(tiny_checkpoint):
    """An op given a state view writes it, and leaves its own attributes' state untouched."""
    modules = _stateful_modules(tiny_checkpoint("qwen3_next", num_hidden_layers=4))
    attn = next(m for m in modules.values() if m.kind.value == "attn_full")
    c = attn.cfg
    attn.allocate_state(2, 8, "cpu")
    own = (attn.k_cache.clone(), attn.v_cache.clone())
    passed = (torch.zeros_like(attn.k_cache), torch.zeros_like(attn.v_cache))
    q = torch.randn(2, 1, c.num_heads, c.head_dim, dtype=attn.k_cache.dtype)
    k = torch.randn(2, 1, c.num_kv_heads, c.head_dim, dtype=attn.k_cache.dtype)
    v = torch.randn_like(k)
    positions = torch.tensor([[0], [3]])
    out = attn(q, k, v, positions, state=passed)
    assert torch.equal(attn.k_cache, own[0]) and torch.equal(attn.v_cache, own[1])
    assert torch.equal(passed[0][0, 0], k[0, 0]) and torch.equal(passed[1][1, 3], v[1, 0])
    assert torch.allclose(out, attn(q, k, v, positions))  # default: its own caches, same math


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernel_ops_pass_the_state_on(tiny_checkpoint, backend):
    """The kernel wrapper (`runtime/kernel_ops.py`) computes with the state passed, for decode
    attention and Gated-DeltaNet, exactly as the module computes with the same state as its own."""
    from opweave.kernels import get_backend
    from opweave.runtime.kernel_ops import KernelOp

    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    modules = _stateful_modules(tiny_checkpoint("qwen3_next", num_hidden_layers=4))
    attn = next(m for m in modules.values() if m.kind.value == "attn_full")
    gdn = next(m for m in modules.values() if m.kind.value == "attn_linear")
    for m in (attn, gdn):
        for p in m.parameters():
            p.data.normal_(0, 0.5)
    c, la, rows = attn.cfg, attn.cfg.linear_attn, 2
    positions = torch.tensor([[0], [5]])
    dtype = torch_dtype(c)

    def randn(*shape):
        return torch.randn(*shape).to(dtype)

    attn_args = (randn(rows, 1, c.num_heads, c.head_dim), randn(rows, 1, c.num_kv_heads, c.head_dim),
                 randn(rows, 1, c.num_kv_heads, c.head_dim), positions)
    hv = la.num_value_heads
    gdn_args = (randn(rows, 1, gdn.conv_dim), randn(rows, 1, hv, la.value_head_dim), randn(rows, 1, hv),
                randn(rows, 1, hv), positions)
    for m, args in ((attn, attn_args), (gdn, gdn_args)):
        m.allocate_state(rows, 8, "cpu")
        for a in m.state_attrs:
            getattr(m, a).normal_()
        passed = tuple(getattr(m, a).clone() for a in m.state_attrs)
        wrapped = KernelOp(m, get_backend(backend))
        got = wrapped(*args, state=passed)
        want = m(*args) if backend == "torch" or m is attn else m(*args, kernels=get_backend(backend))
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), m.kind
        for t, a in zip(passed, m.state_attrs):  # the passed state advanced as the module's own did
            assert torch.allclose(t.float(), getattr(m, a).float(), atol=2e-2, rtol=2e-2), (m.kind, a)


def _compile(folder: str, out: str, template: str, owners) -> None:
    fe = run_front_end(folder)
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    write_artifact(out, pinned_plan(fe, cluster, template, owners, batch=4, microbatches=2, context=32))


def test_a_round_sets_no_module_attribute(tiny_checkpoint, tmp_path, monkeypatch):
    """The generated module passes each microbatch's state view: during a round nothing is set on
    any operator module, and every microbatch's rows of the state are written."""
    from opweave.runtime.standalone import load_alone

    out = str(tmp_path / "art")
    _compile(tiny_checkpoint("qwen3_next", num_hidden_layers=4), out, "colocated", [("h100", 1, 1)])
    with open(os.path.join(out, "rank_00.py")) as f:
        assert "state=self.state" in f.read()
    rt, prog = load_alone(os.path.join(out, "rank_00.py"), torch.device("cpu"))
    assert rt.program.num_microbatches == 2 and rt.state.ops
    before = {(i, name): id(value) for i, m in rt.ops.items() for name, value in vars(m).items()}
    state_before = {(i, a): id(getattr(m, a)) for i, m in rt.ops.items() for a in m.state_attrs}
    set_during_round = []
    original = nn.Module.__setattr__

    def spy(self, name, value):
        if isinstance(self, OpModule):
            set_during_round.append((type(self).__name__, name))
        original(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", spy)
    with torch.no_grad():
        prog.round()
    monkeypatch.setattr(nn.Module, "__setattr__", original)
    assert set_during_round == []
    assert {(i, name): id(value) for i, m in rt.ops.items() for name, value in vars(m).items()} == before
    assert {(i, a): id(getattr(m, a)) for i, m in rt.ops.items() for a in m.state_attrs} == state_before
    for i in rt.state.ops:  # position 0 of every row, in both microbatches, was written
        m = rt.ops[i]
        first = getattr(m, m.state_attrs[0])
        if m.paged:  # each slot's first page, at slot 0
            written = first[rt.state.table[:, 0].long(), 0]
        else:
            written = first[:, 0] if m.kind.value in ("attn_full", "attn_sliding") else first
        assert bool(written.flatten(1).ne(0).any(dim=1).all()), m.kind


# ---------------------------------------------------------------- the TP group on threads


class ThreadComm:
    """`torch.distributed`'s broadcast / all_gather / all_reduce for the ranks of one group run
    as threads of this process (one thread per rank, each naming its rank in `local.rank`)."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks
        self.local = threading.local()
        self._barrier = threading.Barrier(len(ranks))
        self._slots: list = [None] * len(ranks)
        self.calls: list[str] = []

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.local.rank] = t.clone()
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        return got

    def broadcast(self, t, src, group):
        t.copy_(self._exchange(t)[self.ranks.index(src)])
        self.calls.append("broadcast")

    def all_gather(self, outs, t, group):
        for o, g in zip(outs, self._exchange(t)):
            o.copy_(g)
        self.calls.append("all_gather")

    def gather(self, t, outs, dst, group):
        got = self._exchange(t)
        if self.ranks[self.local.rank] == dst:
            for o, g in zip(outs, got):
                o.copy_(g)
        else:
            assert outs is None
        self.calls.append("gather")

    def all_reduce(self, t, group):
        t.copy_(torch.stack(self._exchange(t)).sum(dim=0))
        self.calls.append("all_reduce")


def on_group(ranks: tuple[int, ...], fn):
    """fn(TPGroup) on every rank of the group, each on its own thread: the results by TP rank."""
    comm = ThreadComm(ranks)
    results, errors = [None] * len(ranks), []

    def body(r):
        comm.local.rank = r
        try:
            results[r] = fn(TPGroup(ranks, r, group="g", comm=comm))
        except BaseException as e:  # surfaced below
            errors.append(e)
            comm._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


LAYOUTS = [
    ("replicated", REPLICATED, 24, 2),
    ("plain split", Split(sizes=(24,), units=(4,)), 24, 2),
    ("q | k | v packed", Split(sizes=(16, 8, 8), units=(4, 2, 2)), 32, 2),
    ("KV heads replicated", Split(sizes=(16, 4, 4), units=(4, 1, 1)), 24, 2),
    ("KV heads replicated, TP 4", Split(sizes=(32, 8, 8), units=(8, 2, 2)), 48, 4),
]


@pytest.mark.parametrize("name,layout,dim,tp", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_shard_then_gather_gives_back_the_value(name, layout, dim, tp):
    ranks = tuple(range(10, 10 + tp))
    full = torch.randn(3, 2, dim)

    def step(g: TPGroup):
        local = g.shard(full, layout)
        return local, g.gather(local, layout)

    results = on_group(ranks, step)
    for r, (local, whole) in enumerate(results):
        if r == 0 or layout is REPLICATED:
            assert torch.equal(whole, full)
        else:
            assert whole is None  # only the leader, which sends it, gets the whole value
        expected = full if layout is REPLICATED else torch.cat(
            [full.narrow(2, s, n) for s, n in layout.blocks(tp, r)], dim=2)
        assert torch.equal(local, expected)
        assert local.shape[2] == layout.local_size(dim, tp)


def test_gather_takes_a_replicated_kv_head_from_the_first_rank_holding_it():
    layout = Split(sizes=(8, 2, 2), units=(4, 1, 1))  # 4 q heads, 1 kv head over TP 2
    full = torch.arange(12.0).view(1, 1, 12)

    def step(g: TPGroup):
        local = g.shard(full, layout)
        if g.tp_rank == 1:  # rank 1's copy of the shared KV head is not read
            local[..., 4:] = -1.0
        return g.gather(local, layout)

    leader, other = on_group((0, 1), step)
    assert torch.equal(leader, full) and other is None


def test_fanout_allreduce_and_a_group_of_one():
    def step(g: TPGroup):
        t = torch.full((2, 5), 7 if g.is_leader else 0)
        g.fanout([t])
        return t, g.allreduce(torch.full((3,), float(g.tp_rank + 1)))

    for t, summed in on_group((4, 6, 9), step):
        assert bool((t == 7).all()) and torch.equal(summed, torch.full((3,), 6.0))
    alone = TPGroup((3,), 0, comm=None)  # a group of one never calls a collective
    x = torch.randn(2, 1, 6)
    assert alone.fanout([x])[0] is x and alone.allreduce(x) is x and alone.gather(x, Split((6,), (2,))) is x
    assert torch.equal(alone.argmax(x), x[:, -1].argmax(-1))


def test_vocab_split_argmax_matches_the_whole_vocabulary():
    vocab, tp = 12, 3
    logits = torch.randn(5, 2, vocab)
    logits[1, -1, 2] = logits[1, -1, 9] = 50.0   # a tie across shards: the lowest index wins
    logits[2, -1, 7] = float("nan")               # not finite in one shard only
    logits[3, -1, 0] = float("inf")
    expected = torch.argmax(logits[:, -1], dim=-1)
    expected[2] = expected[3] = NON_FINITE_TOKEN
    per = vocab // tp
    results = on_group((0, 1, 2), lambda g: g.argmax(logits[..., g.tp_rank * per:(g.tp_rank + 1) * per]))
    for ids in results:
        assert ids.tolist() == expected.tolist()
    assert results[0][1] == 2


# ---------------------------------------------------------------- messages


def test_message_round_trip():
    rows, tokens, shapes = 3, 7, ((2, 5), (6,))  # packed: 7 tokens of 3 rows
    positions = torch.arange(tokens).view(1, tokens)
    values = [torch.randn(1, tokens, *s, dtype=torch.bfloat16) for s in shapes]
    words = torch.tensor([[5, 0, 1_000_000], [6, 800_000, 950_000], [2 ** 63 - 1, 1, 1]])
    words = torch.cat([words, torch.arange(rows * (WORD - 3)).view(rows, WORD - 3)], dim=1)  # a word is WORD int64s
    message = pack_message(positions, words, values)
    per_token = (2 * 5 + 6) * 2
    assert message.numel() == message_bytes(rows, tokens, per_token) and message.dtype == torch.uint8
    pos, word, payload = unpack_message(message, rows, tokens, torch.bfloat16)
    assert torch.equal(pos, positions) and torch.equal(word, words)
    assert torch.equal(payload, torch.cat([v.reshape(-1) for v in values]))


def test_assemble_joins_peers_and_views_a_single_peer():
    shapes = ((2,),)
    word = torch.arange(1, 3 * WORD + 1).view(3, WORD)  # each row's sampling word
    layout = Layout((2, 0, 3))  # row 0: two tokens, row 1 idle, row 2: three
    top = (torch.tensor([[3, 4]]), word[:1], torch.arange(4.0))                   # row 0
    bottom = (torch.tensor([[9, 10, 11]]), word[1:], torch.arange(10.0, 16.0))    # rows 1-2
    positions, words, (v,) = assemble([(0, 1, *top), (1, 3, *bottom)], rows=3, layout=layout, shapes=shapes,
                                      dtype=torch.float32)
    assert positions.tolist() == [[3, 4, 9, 10, 11]]
    assert words.tolist() == word.tolist()
    assert v[0, :2].tolist() == [[0.0, 1.0], [2.0, 3.0]] and v[0, 4].tolist() == [14.0, 15.0]
    # a replica none of whose rows has a token: its padding token (position -1, zeros)
    positions, _, (v,) = assemble([(0, 1, torch.zeros(1, 0, dtype=torch.long), word[:1], torch.zeros(0))], rows=1,
                                  layout=Layout((0,), pad=True), shapes=shapes, dtype=torch.float32)
    assert positions.tolist() == [[-1]] and v.tolist() == [[[0.0, 0.0]]]
    # one peer holding every row: views of its message, no copy
    vals = torch.randn(1, 2, 2)
    msg = pack_message(torch.tensor([[7, 8]]), word[:2], [vals])
    pos, word, payload = unpack_message(msg, 2, 2, torch.float32)
    positions, words, (v,) = assemble([(0, 2, pos, word, payload)], rows=2, layout=Layout((1, 1)), shapes=shapes,
                                      dtype=torch.float32)
    assert torch.equal(v, vals) and positions.tolist() == [[7, 8]] and words.tolist() == word[:2].tolist()
    assert v.untyped_storage().data_ptr() == msg.untyped_storage().data_ptr()


# ---------------------------------------------------------------- CPU GEMMs

@pytest.mark.parametrize("tied", [False, True])
def test_cpu_gemm_weights_are_packed_and_compute_what_f_linear_does(tiny_checkpoint, tied):
    """On CPU the runtime packs the dense GEMMs' weights for oneDNN (`pack_cpu_gemms`): every
    `linear_weights` entry becomes a oneDNN tensor of the same shape, or, for the GEMMs of one input
    (q/k/v, gate/up), one oneDNN tensor of their rows stacked; the ops' outputs agree with the
    unpacked ones to float rounding, and a weight the embedding shares (a tied LM head) stays."""
    from opweave.kernels.reference import can_pack_linear
    from opweave.models.registry import resolve
    from opweave.runtime.kernel_ops import pack_cpu_gemms

    if not can_pack_linear():
        pytest.skip("this torch build has no oneDNN")
    folder = tiny_checkpoint("llama", num_hidden_layers=2, tie_word_embeddings=tied)
    plain, packed = resolve(folder).load(), resolve(folder).load()
    ops = {i: m for i, m in enumerate(packed.op_modules())}
    n = pack_cpu_gemms(ops, torch.device("cpu"))
    want = sum(len(m.linear_weights) for m in ops.values()) - (1 if tied else 0)
    assert n == want > 0
    fused = 0
    for m in ops.values():
        if m.fused_weight is not None:  # q/k/v and gate/up: one packed GEMM, its rows theirs
            parts = [getattr(m, name) for name in m.fuse_weights]
            assert m.fused_weight.is_mkldnn and all(w.is_meta for w in parts), m.kind
            assert tuple(m.fused_weight.shape) == (sum(w.shape[0] for w in parts), parts[0].shape[1])
            fused += 1
            continue
        for name in m.linear_weights:
            w = getattr(m, name)
            assert w.is_mkldnn != (tied and m.kind.value == "lm_head"), (m.kind, name)
    assert fused == 4  # two layers' q/k/v and gate/up
    ids = torch.tensor([[5, 6, 7, 8]])
    positions = torch.arange(4)[None]
    for model in (plain, packed):
        model.allocate_state(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(packed(ids, positions), plain(ids, positions), rtol=1e-5, atol=1e-5)
    assert pack_cpu_gemms(ops, torch.device("meta")) == 0


def test_round_reports_leave_idle_rounds_out(monkeypatch):
    """An idle server's empty rounds (every IDLE_WAIT_S) are not round times: /metrics'
    opweave_round_seconds quantiles are those of rounds that computed something."""
    import queue

    from opweave.runtime import worker
    from opweave.runtime.channel import RoundReport

    monkeypatch.setattr(worker, "ROUND_REPORT_S", 0.0)  # report at every round
    box = queue.Queue()
    reports = worker.RoundReports(box, replica_set=0, rank=0)
    reports.add(0.080, 17, 17)
    reports.add(None)
    reports.add(None)
    reports.add(0.075, 16, 16)
    sent = [box.get_nowait() for _ in range(box.qsize())]
    assert all(isinstance(r, RoundReport) for r in sent)
    times = [t for r in sent for t in r.seconds]
    assert times == [0.080, 0.075]
    assert sum(r.computed for r in sent) == 33


def test_a_lone_rank_round_can_be_captured(tiny_checkpoint, tmp_path):
    """`python rank_XX.py` captures its round as a CUDA graph: the round (the sampler included)
    makes no tensor from host data and never synchronises (`NoHostSync`, on CPU)."""
    from opweave.runtime.standalone import load_alone
    from opweave.runtime.syncguard import NoHostSync

    out = str(tmp_path / "art")
    _compile(tiny_checkpoint("gemma3"), out, "colocated", [("h100", 1, 1)])
    rt, prog = load_alone(os.path.join(out, "rank_00.py"), torch.device("cpu"))
    guard = NoHostSync("a lone rank's round")
    with torch.no_grad(), guard:
        prog.round()
    assert guard.ops > 0
