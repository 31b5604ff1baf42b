"""Verifiers of the IRs with no module of their own: partition blocks and rank programs.

Each takes an IR and returns it unchanged or raises `IRError` (a bug in OpWeave, not in the
user's input). The compile pipeline (`compiler/pipeline.py`) runs them between its steps when
OPWEAVE_VERIFY=1; the operator graph's verifier is `ir/graph.py verify`, the plan's
`ir/plan.py verify_plan`, the placement's `passes/placement.py verify_placement`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from opweave.ir.graph import IRError
from opweave.ir.program import Peer, RankProgram


def verify_blocks(bg: Any) -> Any:
    """Partition blocks (`passes/blocks.py BlockedGraph`) tile the graph: prologue, blocks, tail
    and epilogue are contiguous op ranges covering every op once, in order; each block holds
    `period` whole layers in order, and every block has the same op kinds."""
    graph = bg.graph
    head = getattr(bg, "num_head_layers", 0)  # layers before block 0 (passes/blocks.py)
    parts = [("prologue", bg.prologue)] + ([("head", bg.head)] if head else [])
    parts += [(f"block {b}", r) for b, r in enumerate(bg.blocks)]
    parts += ([("tail", bg.tail)] if bg.tail is not None else []) + [("epilogue", bg.epilogue)]
    nxt = 0
    for name, r in parts:
        if r.first != nxt or r.last < r.first:
            raise IRError(f"{name} covers ops {r.first}..{r.last} after op {nxt - 1}: the blocks do not tile the graph")
        nxt = r.last + 1
    if nxt != len(graph.ops):
        raise IRError(f"the blocks cover ops 0..{nxt - 1} of {len(graph.ops)}")
    if len(bg.blocks) != bg.num_blocks or head + bg.num_blocks * bg.period + bg.num_tail_layers != graph.num_layers:
        raise IRError(f"{head} head layers + {bg.num_blocks} blocks of {bg.period} layers + "
                      f"{bg.num_tail_layers} tail layers "
                      f"!= {graph.num_layers} layers")
    kinds = None
    for b, r in enumerate(bg.blocks):
        layers = [op.layer for op in graph.ops[r.first:r.last + 1]]
        first = head + b * bg.period
        if layers != sorted(layers) or set(layers) != set(range(first, first + bg.period)):
            raise IRError(f"block {b} holds layers {sorted(set(layers))}, expected "
                          f"{first}..{first + bg.period - 1}")
        these = [op.kind for op in graph.ops[r.first:r.last + 1]]
        if kinds is not None and these != kinds:
            raise IRError(f"block {b}'s op kinds differ from block 0's")
        kinds = these
    return bg


def _messages(programs: Sequence[RankProgram]) -> tuple[dict, dict]:
    """(sent, received): (src rank, dst rank) -> the messages in program order, each
    (stage, cut, values, shapes, rows lo, rows hi); the token ids back count as cut -1. A stage's
    transfers are its replica's port's (`recv_port`, `send_port`), which fans out to its TP peers."""
    sent: dict[tuple[int, int], list[tuple]] = {}
    received: dict[tuple[int, int], list[tuple]] = {}
    for p in programs:
        for s in p.stages:
            if s.recv is not None and p.rank == s.recv_port:
                for q in s.recv.peers:
                    received.setdefault((q.rank, p.rank), []).append(
                        (s.recv.cut, s.recv.values, s.recv.shapes, q.lo, q.hi))
            if s.send is not None and p.rank == s.send_port:
                for q in s.send.peers:
                    sent.setdefault((p.rank, q.rank), []).append(
                        (s.send.cut, s.send.values, s.send.shapes, q.lo, q.hi))
            for q in (s.returns if p.rank == s.send_port else ()):
                sent.setdefault((p.rank, q.rank), []).append((-1, ("token ids",), ((),), q.lo, q.hi))
        for q in (p.token_sources if p.rank == p.leader else ()):
            received.setdefault((q.rank, p.rank), []).append((-1, ("token ids",), ((),), q.lo, q.hi))
    return sent, received


def _describe(m: tuple) -> str:
    cut, values, shapes, lo, hi = m
    what = "token ids" if cut < 0 else f"cut after op {cut} {list(values)}"
    return f"{what} rows {lo}..{hi - 1} ({(hi - lo) * sum(math.prod(s) for s in shapes)} elements)"


def _base(value: str) -> str:
    return value.split("[")[0]


def verify_dataflow(p: RankProgram) -> None:
    """Within one rank, every value is there when it is used: a stage program's ops read, and it
    sends and keeps, only what it made itself, received at its start, or took back from what an
    earlier stage program of the rank kept; every kept value is taken back by a later one (a
    kept value nobody reads would be a lost send)."""
    held: dict[str, int] = {}     # kept value -> the stage program that kept it
    taken: set[str] = set()
    for s in p.stages:
        # the step's positions come with every start (`rt.begin` / `rt.recv`), its token ids with `rt.begin`
        here = {"positions"} | (set(s.recv.values) if s.recv else {"ids"})
        for v in s.takes:
            if v not in held:
                raise IRError(f"rank {p.rank} stage {s.stage} takes back {v}, which no earlier stage of the rank kept")
            here.add(v)
            taken.add(v)
        made: set[str] = set()
        for l in s.launches:
            missing = [v for v in l.inputs if v not in here and _base(v) not in made]
            if missing:
                raise IRError(f"rank {p.rank} stage {s.stage}: op {l.op} ({l.name}) reads {missing}, which the "
                              "stage neither makes, receives nor takes back from what its owner kept")
            made.add(l.output)
        for name, values in (("sends", s.send.values if s.send else ()), ("keeps", s.keeps)):
            missing = [v for v in values if v not in here and _base(v) not in made]
            if missing:
                raise IRError(f"rank {p.rank} stage {s.stage} {name} {missing}, which it does not have")
        for v in s.keeps:
            held[v] = s.stage
            taken.discard(v)
    lost = sorted(set(held) - taken)
    if lost:
        raise IRError(f"rank {p.rank} keeps {lost}, which no later stage of the rank takes back")


def verify_programs(programs: Sequence[RankProgram]) -> Sequence[RankProgram]:
    """Rank programs agree with each other: ranks are 0..world-1 with one world size; every TP
    group's members agree on it; every rank's values are there when used (`verify_dataflow`);
    every send has its receive, in the same order, with the same values, shapes and rows (so the
    same bytes), and every receive its send."""
    world = len(programs)
    for i, p in enumerate(programs):
        if p.rank != i or p.world_size != world:
            raise IRError(f"program {i} is rank {p.rank} of {p.world_size}, expected rank {i} of {world}")
    for p in programs:
        if p.rank not in p.tp_group or len(p.tp_group) != p.tp or programs[p.leader].tp_group != p.tp_group:
            raise IRError(f"rank {p.rank}: TP group {list(p.tp_group)} is not its leader's or not of size {p.tp}")
        for s in p.stages:
            for t in (s.recv, s.send):
                if t is not None and len(t.values) != len(t.shapes):
                    raise IRError(f"rank {p.rank} stage {s.stage}: {len(t.values)} values, {len(t.shapes)} shapes")
            peers: list[Peer] = list(s.returns) + [q for t in (s.recv, s.send) if t is not None for q in t.peers]
            bad = [q.rank for q in peers if not 0 <= q.rank < world or not 0 <= q.lo < q.hi]
            if bad:
                raise IRError(f"rank {p.rank} stage {s.stage}: peers {bad} are not ranks with rows")
            for name, rank, needed in (("recv", s.recv_port, s.recv is not None),
                                       ("send", s.send_port, s.send is not None or bool(s.returns))):
                if needed and rank not in p.tp_group:
                    raise IRError(f"rank {p.rank} stage {s.stage}: {name} port {rank} is not in its TP group "
                                  f"{list(p.tp_group)}")
        verify_dataflow(p)
    sent, received = _messages(programs)
    for src, dst in sorted(set(sent) | set(received)):
        out, inn = sent.get((src, dst), []), received.get((src, dst), [])
        for i in range(max(len(out), len(inn))):
            a = out[i] if i < len(out) else None
            b = inn[i] if i < len(inn) else None
            if a is None:
                raise IRError(f"rank {dst} receives {_describe(b)} from rank {src}, which sends no such message")
            if b is None:
                raise IRError(f"rank {src} sends {_describe(a)} to rank {dst}, which has no matching receive")
            if a != b:
                raise IRError(f"message {i} from rank {src} to rank {dst}: sent {_describe(a)}, "
                              f"received {_describe(b)}")
    return programs


def verify_modules(modules: dict[str, str], programs: Sequence[RankProgram]) -> dict[str, str]:
    """Rendered rank modules: one per program, named rank_XX.py, each valid Python."""
    expected = [f"rank_{p.rank:02d}.py" for p in programs]
    if sorted(modules) != sorted(expected):
        raise IRError(f"rendered modules {sorted(modules)[:4]}... do not match the {len(expected)} rank programs")
    for name, source in modules.items():
        try:
            compile(source, name, "exec")
        except SyntaxError as e:
            raise IRError(f"{name} is not valid Python: {e.msg} (line {e.lineno})") from None
    return modules
