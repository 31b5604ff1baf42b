"""`RankProgram`: the straight-line per-round work of one rank (summary §6).

One decode round of a rank is, for every stage its owner runs (in token order) and every
microbatch: receive the stage's inputs (from the previous owner's replicas whose rows overlap,
fanned out to the TP peers) and take back what the owner kept for it, launch its ops (with an
all-reduce after the partial sums the TP table names), keep what a later stage of the owner reads,
and send on what the next owners need (`passes/carry.py`; at the last stage, the new token ids back
to the embedding owner).
Every rank follows the same global order (round, stage, microbatch), so blocking receives and
non-blocking sends never deadlock, and there is no coordinator between stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from opweave.errors import OpWeaveError
from opweave.ir.graph import OP_CLASS
from opweave.ir.kinds import OpClass, OpKind
from opweave.ir.tp import Layout, layout_from_json, layout_to_json
from opweave.ir.plan import PREFILL_CHUNK


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Peer:
    """A transfer partner (the rank of its replica that handles this cut: `StageProgram`'s ports)
    and the rows of each microbatch exchanged with it."""

    rank: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """Values crossing a cut (after op `cut`), to or from `peers`."""

    cut: int
    values: tuple[str, ...]                   # IR value names, in packing order
    shapes: tuple[tuple[int, ...], ...]       # per-token shape of each value
    layouts: tuple[Layout, ...]               # how a TP group holds each value (opweave.ir.tp)
    peers: tuple[Peer, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    op: int                   # index in the OpGraph
    name: str                 # module path, e.g. model.layers.3.mixer.attn
    kind: str
    layer: int | None
    block: int | None
    inputs: tuple[str, ...]   # IR value names
    output: str               # IR value name of the op's output (tuple outputs: name, indexed name[i])
    allreduce: bool           # row-parallel partial sums: all-reduce over the TP group after the op


def stateful(launch: Launch) -> bool:
    """Whether the op keeps per-sequence state (the ATTN class: KV cache, recurrent state); the
    rank program passes it the microbatch's state view (`opweave.runtime.state`)."""
    return OP_CLASS.get(OpKind(launch.kind)) == OpClass.ATTN


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageProgram:
    stage: int
    block: int | None
    layers: tuple[int, ...]
    recv: Transfer | None     # None: the stage starts the step (embedding owner: the scheduler's tokens)
    launches: tuple[Launch, ...]
    send: Transfer | None     # None: the last stage
    returns: tuple[Peer, ...] = ()  # last stage: where the new token ids go (embedding owner leaders)
    # the rank of this replica's TP group that receives the stage's input / sends its output (or
    # returns the token ids): the group's ranks take the cuts in turn (`passes.lower.port`)
    recv_port: int | None = None
    send_port: int | None = None
    # values the owner keeps between its own stage programs instead of sending them round
    # (`passes/carry.py`): `keeps` are stored per microbatch at the end of this one (every TP rank
    # its own copy, in the value's layout), `takes` read back at the start of this one
    keeps: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankProgram:
    rank: int
    world_size: int
    owner: int
    replica: int
    tp: int
    tp_rank: int
    tp_group: tuple[int, ...]       # global ranks of this replica's TP group (leader first)
    tp_groups: tuple[tuple[int, ...], ...]  # every TP group of the world (created by all ranks, in order)
    rows: tuple[int, int]           # rows [lo, hi) of every microbatch this replica processes
    microbatch_size: int
    num_microbatches: int
    scheduler: bool                 # this replica owns stage 0: it schedules requests into its rows
    scheduler_leaders: tuple[int, ...]  # leaders of every scheduling replica (request i -> i mod len)
    token_sources: tuple[Peer, ...]  # scheduler: where its rows' new token ids come from
    stages: tuple[StageProgram, ...]
    model: str
    plan_hash: str
    context: int
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per round and microbatch at most (chunked prefill)
    kv_cache_dtype: str = "auto"    # attention's keys and values: the model's dtype, or "fp8" (e4m3)
    experts: str = "tp"             # routed experts' layout in this TP group (`opweave.ir.tp.EXPERT_LAYOUTS`)
    ep_group: tuple[int, ...] = ()  # "dp": the ranks whose routed experts this rank's tokens visit (its owner's
                                    # expert group: each a TP 1 replica with its own rows), in order
    ep_groups: tuple[tuple[int, ...], ...] = ()  # every such group of the world (created by all ranks, in order)
    ep_rows: tuple[tuple[int, int], ...] = ()    # each member's rows of a microbatch, in `ep_group` order
    ep_dispatch: str = ""           # "dp": "gather" or "alltoall" (the plan's `PlanOwner.dispatch`)
    ep_nodes: int = 1               # "dp": the nodes its expert group spans (`PlanOwner.group_nodes`)
    ep_slots: tuple = ()            # with redundant experts: per MoE layer (layer, each member's experts), members
                                    # in `ep_group` order ("dp") or `tp_group` order ("ep"): `PlanOwner.expert_slots`

    @property
    def leader(self) -> int:
        return self.tp_group[0]

    @property
    def ops(self) -> tuple[int, ...]:
        return tuple(sorted({l.op for s in self.stages for l in s.launches}))


def program_to_json(program: RankProgram) -> dict[str, Any]:
    """JSON-ready dict (layouts in their typed form: {"replicated": {}} or {"split": {...}})."""
    out = dataclasses.asdict(program)
    for stage, s in zip(out["stages"], program.stages):
        for name in ("recv", "send"):
            transfer = getattr(s, name)
            if transfer is not None:
                stage[name]["layouts"] = [layout_to_json(layout) for layout in transfer.layouts]
    return out


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _layout(data: Any) -> Layout:
    try:
        return layout_from_json(data)
    except ValueError:
        raise OpWeaveError(f"rank program: value layout {data!r} is not one this opweave reads "
                           "(an artifact from another version: compile it again)") from None


def _transfer(d: dict | None) -> Transfer | None:
    if d is None:
        return None
    return Transfer(cut=d["cut"], values=tuple(d["values"]), shapes=_tuples(d["shapes"]),
                    layouts=tuple(_layout(x) for x in d["layouts"]), peers=tuple(Peer(**p) for p in d["peers"]))


def program_from_json(d: dict[str, Any]) -> RankProgram:
    stages = tuple(StageProgram(stage=s["stage"], block=s["block"], layers=tuple(s["layers"]),
                                recv=_transfer(s["recv"]), send=_transfer(s["send"]),
                                launches=tuple(Launch(**{**l, "inputs": tuple(l["inputs"])}) for l in s["launches"]),
                                returns=tuple(Peer(**p) for p in s["returns"]),
                                recv_port=s.get("recv_port"), send_port=s.get("send_port"),
                                keeps=tuple(s.get("keeps", ())), takes=tuple(s.get("takes", ())))
                   for s in d["stages"])
    return RankProgram(**{**d, "tp_group": tuple(d["tp_group"]), "tp_groups": _tuples(d["tp_groups"]),
                          "rows": tuple(d["rows"]), "scheduler_leaders": tuple(d["scheduler_leaders"]),
                          "ep_group": tuple(d.get("ep_group", ())), "ep_groups": _tuples(d.get("ep_groups", [])),
                          "ep_rows": _tuples(d.get("ep_rows", [])), "ep_slots": _tuples(d.get("ep_slots", [])),
                          "token_sources": tuple(Peer(**p) for p in d["token_sources"]),
                          "stages": stages})


def format_program(program: RankProgram) -> str:
    """Readable listing (what `opweave dump ARTIFACT --what ranks` prints)."""
    p = program
    lines = [f"rank {p.rank}/{p.world_size}: owner o{p.owner} replica {p.replica} tp {p.tp_rank}/{p.tp} "
             f"(group {list(p.tp_group)}), rows {p.rows[0]}..{p.rows[1] - 1} of each of {p.num_microbatches} "
             f"microbatch(es) of {p.microbatch_size}" + (", scheduler" if p.scheduler else "")]
    if p.ep_group:
        lines.append(f"  routed experts: {p.ep_dispatch or 'gather'} over expert group {list(p.ep_group)}"
                     + (f" on {p.ep_nodes} nodes" if p.ep_nodes > 1 else ""))
    if p.ep_slots:
        me = p.ep_group.index(p.rank) if p.ep_group else p.tp_rank
        lines.append(f"  expert slots (with copies), per layer: "
                     + ", ".join(f"{layer}: {list(slots[me])}" for layer, slots in p.ep_slots))
    for s in p.stages:
        ports = [f"{name} port r{r}" for name, r in (("recv", s.recv_port), ("send", s.send_port)) if r is not None]
        lines.append(f"  stage {s.stage} (layers {list(s.layers)}" + "".join(f", {x}" for x in ports) + "):")
        if s.recv:
            lines.append(f"    recv after op {s.recv.cut} {list(s.recv.values)} from "
                         + ", ".join(f"r{q.rank}[{q.lo}:{q.hi}]" for q in s.recv.peers))
        if s.takes:
            lines.append(f"    take kept {list(s.takes)}")
        for l in s.launches:
            lines.append(f"    launch op {l.op} {l.kind} ({l.name})" + (" + all-reduce" if l.allreduce else ""))
        if s.keeps:
            lines.append(f"    keep {list(s.keeps)} for a later stage of this owner")
        if s.send:
            lines.append(f"    send {list(s.send.values)} to " + ", ".join(f"r{q.rank}[{q.lo}:{q.hi}]" for q in s.send.peers))
        if s.returns:
            lines.append("    return token ids to " + ", ".join(f"r{q.rank}[{q.lo}:{q.hi}]" for q in s.returns))
    return "\n".join(lines)
