"""What crosses a cut: per stage boundary, the live values sent on and those that stay (issue 14).

A cut's live values (`CutPoint.values`) are everything produced before it and read after it. Not
all of them have to travel: under CAD the residual stream is live across the cuts before and after
core attention, but the owner that reads it next (the one running the rest of the layer) is the
one that produced it. The rule, walking the stages in token order and keeping, per value, the
set of owners that hold it (its producer's owner, and every owner it was sent to):

    at the boundary after stage i (owner A) to stage i + 1 (owner B != A), a live value v is
    SENT iff the owner C of v's next consumer stage (the first stage after i with an op that
    reads v) does not hold v yet; it then moves to B, as every live value did before this pass
    (passing through B when C != B, to go on at B's boundary). Otherwise v is KEPT: it stays on
    the owners holding it, and C reads it from its own memory.

Boundaries between two stages of one owner send nothing (the owner's stages run back to back).
The owner sending v always holds it (`carry` raises IRError otherwise): at every boundary a live
value is held by the owner of its next consumer, or by the owner of the stage before (which made
it, received it, or read it where it was kept). Under the planner's round-robin owners
(`owner_of[i] = (i % stages_per_block) % k` with k dividing stages_per_block, i.e. `i % k`) no
owner is ever sent a value it already holds: a value goes from its maker along the next owners
until the first one that reads it next, at most k - 1 hops, each to a new owner.

Note: one rule, three users. The planner and the simulator cost `send_bytes_per_token`; lowering
(`passes/lower.py`) sends exactly `Carry.sent` and keeps the rest per microbatch on the owner's
ranks (`StageProgram.keeps`, read back by the owner's later stage program: `StageProgram.takes`,
`ir/program.py`); the program verifier (`ir/verify.py verify_dataflow`) checks that every value a
stage reads was made, received or kept on that rank. So what is costed is what runs.

Complexity: O(sum over taken cuts of their live values) per plan, after an O(ops) index of the
graph's readers (built once per graph); `plan_carry` memoizes per (graph, template, owners).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import OrderedDict
from typing import Sequence

from opweave.ir.graph import DTYPE_SIZE, CutPoint, IRError, OpGraph, human_bytes
from opweave.passes.templates import StagePlan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Carry:
    """The carry decisions of one plan, per stage i (token order; the last stage has no cut).

    `sent[i]`: the live values sent after stage i to stage i + 1's owner (in the cut's order);
    `kept[i]`: the cut's other live values (they stay where they are held); both () when stage
    i + 1 has stage i's owner, and for the last stage. `sent_bytes_per_token[i]`: the bytes per
    token of `sent[i]` (0 when nothing crosses)."""

    owners: tuple[int, ...]
    sent: tuple[tuple[str, ...], ...]
    kept: tuple[tuple[str, ...], ...]
    sent_bytes_per_token: tuple[int, ...]

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token sent at all the plan's boundaries together."""
        return sum(self.sent_bytes_per_token)


@dataclasses.dataclass(frozen=True, slots=True)
class _Readers:
    """Per graph: each value's reading ops (sorted), each op's index by name, each cut by its op."""

    readers: dict[str, tuple[int, ...]]
    op_index: dict[str, int]
    cut_after: dict[int, CutPoint]


_MAX_MEMO = 4096
"""Plans `plan_carry` keeps (the oldest go first): a search asks for a few hundred templates x owner counts."""
_MAX_GRAPHS = 8
"""Graphs whose index `_readers` keeps (a process plans one model, tests a few)."""
_READERS: dict[int, tuple[OpGraph, _Readers]] = {}   # id(graph) -> (graph kept alive, its index)


def _readers(graph: OpGraph) -> _Readers:
    hit = _READERS.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    readers: dict[str, list[int]] = {}
    for op in graph.ops:
        for v in op.inputs:
            readers.setdefault(v, []).append(op.index)
    index = _Readers(readers={v: tuple(ops) for v, ops in readers.items()},
                     op_index={op.name: op.index for op in graph.ops}, cut_after={c.after: c for c in graph.cuts})
    if len(_READERS) >= _MAX_GRAPHS:
        _READERS.pop(next(iter(_READERS)))
    _READERS[id(graph)] = (graph, index)
    return index


def value_bytes_per_token(graph: OpGraph, shape: Sequence[int]) -> int:
    """Bytes per token of a cut value of per-token `shape`: cut values are in the model's dtype
    (the runtime packs them so: `runtime/message.py`)."""
    return math.prod(shape) * DTYPE_SIZE[graph.dtype]


def _check_bounds(graph: OpGraph, bounds: Sequence[tuple[int, int]], owner_of: Sequence[int]) -> None:
    if len(owner_of) != len(bounds):
        raise ValueError(f"{len(owner_of)} owners for {len(bounds)} stages")
    nxt = 0
    for i, (first, last) in enumerate(bounds):
        if first != nxt or last < first:
            raise ValueError(f"stage {i} covers ops {first}..{last} after op {nxt - 1}: stages must tile the graph")
        nxt = last + 1
    if nxt != len(graph.ops):
        raise ValueError(f"the stages cover ops 0..{nxt - 1} of {len(graph.ops)}")


def carry(graph: OpGraph, bounds: Sequence[tuple[int, int]], owner_of: Sequence[int]) -> Carry:
    """The module's rule (see its docstring) on stages given as op ranges.

    Args:
        graph: the operator graph the stages index.
        bounds: per stage (token order), its (first op, last op), inclusive; they tile the graph
            and every stage but the last ends at a legal cut.
        owner_of: per stage, its owner.
    Returns:
        the `Carry` of every boundary.
    Raises:
        ValueError: stages that do not tile the graph, or a stage ending where no cut is legal.
    """
    _check_bounds(graph, bounds, owner_of)
    index = _readers(graph)
    ends = [last for _, last in bounds]
    stage_of = lambda op: bisect.bisect_left(ends, op)   # noqa: E731 - the stage holding op index `op`
    holders: dict[str, set[int]] = {}
    n = len(bounds)
    sent: list[tuple[str, ...]] = [()] * n
    kept: list[tuple[str, ...]] = [()] * n
    sizes = [0] * n
    for i in range(n - 1):
        a, b = owner_of[i], owner_of[i + 1]
        if a == b:
            continue
        cut = index.cut_after.get(ends[i])
        if cut is None:
            raise ValueError(f"stage {i} ends after op {ends[i]}, which is not a legal cut point")
        out, stay, size = [], [], 0
        for v, shape in zip(cut.values, cut.value_shapes):
            have = holders.get(v)
            if have is None:   # first boundary v is live at: its producer's owner holds it
                have = holders[v] = {owner_of[stage_of(index.op_index[v.split("[")[0]])]}
            reads = index.readers[v]
            c = owner_of[stage_of(reads[bisect.bisect_right(reads, ends[i])])]
            if c in have:
                stay.append(v)
                continue
            if a not in have:
                raise IRError(f"stage {i} (owner {a}) must send {v} on to owner {c}, but owner {a} does not hold it")
            have.add(b)
            out.append(v)
            size += value_bytes_per_token(graph, shape)
        sent[i], kept[i], sizes[i] = tuple(out), tuple(stay), size
    return Carry(owners=tuple(owner_of), sent=tuple(sent), kept=tuple(kept), sent_bytes_per_token=tuple(sizes))


# ---------------------------------------------------------------- what an owner keeps between its stages


def stage_runs(owner_of: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last) stage of each stage program: consecutive stages of one owner run as one."""
    runs: list[tuple[int, int]] = []
    for i, o in enumerate(owner_of):
        if runs and owner_of[i - 1] == o:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def held_values(graph: OpGraph, bounds: Sequence[tuple[int, int]], owner_of: Sequence[int], carried: Carry
                ) -> dict[int, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per stage program (`stage_runs`, keyed by its first stage): (the values it keeps for a
    later stage program of its owner, the values it takes back that an earlier one kept).

    A stage program needs every value its ops read and every value it sends at its end; one it
    neither makes nor receives at its start, its owner holds from an earlier stage program (made
    or received there, the latest such): that one keeps it. Raises IRError when the owner does
    not hold it (the carry would have had to send it)."""
    runs = stage_runs(owner_of)
    got: dict[int, dict[str, int]] = {}   # owner -> value (a made one: its op's name) -> run that got it last
    keeps: dict[int, list[str]] = {first: [] for first, _ in runs}
    takes: dict[int, list[str]] = {first: [] for first, _ in runs}
    for first, last in runs:
        o = owner_of[first]
        mine = got.setdefault(o, {})
        received = set(carried.sent[first - 1]) if first > 0 else set()
        ops = graph.ops[bounds[first][0]:bounds[last][1] + 1]
        made = {op.name for op in ops}
        needed = [v for op in ops for v in op.inputs] + list(carried.sent[last])
        for v in dict.fromkeys(needed):
            if v in graph.inputs or v in received or v.split("[")[0] in made:
                continue
            source = mine.get(v, mine.get(v.split("[")[0]))
            if source is None:
                raise IRError(f"stage {first} (owner {o}) reads {v}, which it neither makes, receives nor holds")
            takes[first].append(v)
            if v not in keeps[source]:
                keeps[source].append(v)
        mine.update({v: first for v in received})
        mine.update({name: first for name in made})
    return {first: (tuple(keeps[first]), tuple(takes[first])) for first, _ in runs}


def held_bytes_per_token(plan: StagePlan, owner_of: Sequence[int]) -> dict[int, int]:
    """Per owner: the most bytes per token it keeps at once for its later stages (`held_values`),
    at the end of one of its stage programs. The runtime keeps them for every microbatch of a
    round at once (its loops are stage, then microbatch), so a rank holds this x its rows x the
    tokens per row x the microbatches, besides one step's activations."""
    return held_peak(plan.blocked.graph, [(s.first, s.last) for s in plan.stages], owner_of,
                     plan_carry(plan, owner_of))


def held_peak(graph: OpGraph, bounds: Sequence[tuple[int, int]], owner_of: Sequence[int],
              decided: Carry | None = None) -> dict[int, int]:
    """`held_bytes_per_token` from stage bounds (a compiled Plan's stages) instead of a StagePlan."""
    decided = carry(graph, bounds, owner_of) if decided is None else decided
    held = held_values(graph, bounds, owner_of, decided)
    size = {v: value_bytes_per_token(graph, shape)
            for cut in graph.cuts for v, shape in zip(cut.values, cut.value_shapes)}
    last_take = {(owner_of[first], v): first for first, (_, takes) in held.items() for v in takes}
    holding: dict[int, set[str]] = {o: set() for o in owner_of}
    peak = {o: 0 for o in owner_of}
    for first, (keeps, _) in held.items():   # stage programs in token order
        o = owner_of[first]
        holding[o] -= {v for v in holding[o] if last_take[(o, v)] == first}   # popped at its last reading
        holding[o] |= set(keeps)
        peak[o] = max(peak[o], sum(size[v] for v in holding[o]))
    return peak


# ---------------------------------------------------------------- on a StagePlan (the planner's view)

_MEMO: OrderedDict[tuple, tuple[StagePlan, Carry]] = OrderedDict()


def plan_carry(plan: StagePlan, owner_of: Sequence[int]) -> Carry:
    """`carry` of a template's stages with `owner_of[i]` the owner of stage i, memoized per
    (graph, template name, owners): the planner asks once per (template, owner count)."""
    owners = tuple(int(o) for o in owner_of)
    key = (id(plan.blocked.graph), plan.template.name, owners)
    hit = _MEMO.get(key)
    if hit is not None and hit[0].blocked.graph is plan.blocked.graph:
        _MEMO.move_to_end(key)
        return hit[1]
    result = carry(plan.blocked.graph, [(s.first, s.last) for s in plan.stages], owners)
    _MEMO[key] = (plan, result)   # the plan keeps its graph, so the id is not reused while cached
    if len(_MEMO) > _MAX_MEMO:
        _MEMO.popitem(last=False)
    return result


def send_values(plan: StagePlan, owner_of: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """Per stage i: the value names sent after stage i (() when nothing crosses, and for the last stage)."""
    return plan_carry(plan, owner_of).sent


def send_bytes_per_token(plan: StagePlan, owner_of: Sequence[int]) -> tuple[int, ...]:
    """Per stage i: the bytes per token sent after stage i to stage i + 1's owner (0 when the
    next stage has the same owner, and for the last stage)."""
    return plan_carry(plan, owner_of).sent_bytes_per_token


def round_robin(plan: StagePlan, k: int) -> tuple[int, ...]:
    """The planner's owners of a template's stages with k owner slots: `(i % stages_per_block) % k`."""
    return tuple((s.index % plan.stages_per_block) % k for s in plan.stages)


def format_carry(plan: StagePlan, owner_of: Sequence[int], limit: int | None = None) -> str:
    """One line per boundary that changes owner: what is sent, what stays, bytes per token (sent
    against all live), then the totals. `limit`: print the first `limit` boundaries only."""
    result = plan_carry(plan, owner_of)
    graph = plan.blocked.graph
    short = lambda v: v.removeprefix("model.")   # noqa: E731
    lines = [f"Carry of {graph.model} with template {plan.template.name} on owners "
             f"{list(dict.fromkeys(result.owners))} ({len(plan.stages)} stages)"]
    shown = 0
    live_total = 0
    for i, s in enumerate(plan.stages[:-1]):
        if result.owners[i] == result.owners[i + 1]:
            continue
        live_total += s.out_bytes_per_token
        if limit is not None and shown >= limit:
            continue
        shown += 1
        lines.append(f"  after stage {i} (op {s.last}) o{result.owners[i]} -> o{result.owners[i + 1]}: "
                     f"send {human_bytes(result.sent_bytes_per_token[i])}/tok of {human_bytes(s.out_bytes_per_token)}"
                     f" live: [{', '.join(map(short, result.sent[i]))}]"
                     + (f"; kept [{', '.join(map(short, result.kept[i]))}]" if result.kept[i] else ""))
    saved = 1 - result.bytes_per_token / live_total if live_total else 0.0
    lines.append(f"  total: {human_bytes(result.bytes_per_token)}/tok sent of {human_bytes(live_total)}/tok live "
                 f"({saved:.0%} stays where it is needed)")
    return "\n".join(lines)
