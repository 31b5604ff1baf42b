"""Rendering a `RankProgram` as a readable Python module (`rank_XX.py`).

Every decision is made here in Python; the jinja2 template only lays out plain strings. Each
generated line carries a comment naming the plan stage, block, layer and operator it serves.
"""

from __future__ import annotations

import os
import re

import jinja2

from opweave import __version__
from opweave.ir.program import Launch, RankProgram, StageProgram

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=False)
_VALUE = re.compile(r"^(?P<name>[^\[]+)(\[(?P<index>\d+)\])?$")


class _Names:
    """IR value names -> Python variable names (v<op> or v<op>_<element>)."""

    def __init__(self, op_index: dict[str, int]):
        self.op_index = op_index

    def var(self, value: str) -> str:
        if value in ("ids", "positions"):
            return value
        m = _VALUE.match(value)
        base = f"v{self.op_index[m.group('name')]}"
        return base if m.group("index") is None else f"{base}_{m.group('index')}"


def _where(st: StageProgram) -> str:
    layers = f"layers {st.layers[0]}-{st.layers[-1]}" if st.layers else "no layer"
    block = f"block {st.block}" if st.block is not None else "tail layers / epilogue"
    return f"{block}, {layers}, ops {st.launches[0].op}..{st.launches[-1].op}"


def _comment(st: StageProgram, l: Launch) -> str:
    block = "-" if l.block is None else l.block
    layer = "-" if l.layer is None else l.layer
    return f"# stage {st.stage} · block {block} · layer {layer} · {l.kind} ({l.name})"


def _stage_lines(program: RankProgram, st: StageProgram, names: _Names) -> dict:
    used = {v for l in st.launches for v in l.inputs} | set(st.send.values if st.send else ())
    if st.recv is None:
        head = "ids, positions = rt.begin(mb)  # scheduler: this step's tokens and positions for my rows"
    else:
        srcs = ", ".join(f"rank {p.rank} rows {p.lo}..{p.hi - 1}" for p in st.recv.peers)
        received = ", ".join(names.var(v) for v in st.recv.values)
        head = f"positions, ({received},) = rt.recv({st.stage}, mb)  # after op {st.recv.cut}, from {srcs}"
    lines = []
    for l in st.launches:
        out = names.var(l.output)
        args = ", ".join(names.var(v) for v in l.inputs)
        if l.kind == "sample" and program.tp > 1:
            lines.append(f"{out} = rt.tp_argmax({args})  {_comment(st, l)}: vocab-split argmax")
        else:
            lines.append(f"{out} = self.op{l.op}({args})  {_comment(st, l)}")
        if l.allreduce:
            lines.append(f"{out} = rt.allreduce({out})  # stage {st.stage} · TP all-reduce of {l.kind} partial sums")
        elements = sorted(int(v.rsplit("[", 1)[1][:-1]) for v in used if v.startswith(l.output + "["))
        for i in elements:
            lines.append(f"{out}_{i} = {out}[{i}]")
    tail = ""
    if st.send is not None:
        dsts = ", ".join(f"rank {p.rank} rows {p.lo}..{p.hi - 1}" for p in st.send.peers)
        sent = ", ".join(names.var(v) for v in st.send.values)
        tail = f"rt.send({st.stage}, mb, positions, ({sent},))  # after op {st.send.cut}, to {dsts}"
    elif st.returns:
        dsts = ", ".join(f"rank {p.rank} rows {p.lo}..{p.hi - 1}" for p in st.returns)
        tail = f"rt.finish(mb, {names.var(st.launches[-1].output)})  # new token ids to {dsts}"
    return {"stage": st.stage, "where": _where(st), "head": head, "lines": lines, "tail": tail}


def render_rank(program: RankProgram, op_names: list[str], template: str, num_stages: int) -> str:
    """The source of `rank_XX.py` for one rank (deterministic)."""
    names = _Names({name: i for i, name in enumerate(op_names)})
    binds = [{"op": l.op, "name": l.name} for st in program.stages for l in st.launches
             if not (l.kind == "sample" and program.tp > 1)]
    return _ENV.get_template("rank.py.j2").render(
        version=__version__, model=program.model, plan_hash=program.plan_hash, template=template,
        num_stages=num_stages, rank=program.rank, world_size=program.world_size, owner=program.owner,
        replica=program.replica, tp_rank=program.tp_rank, tp=program.tp, tp_group=list(program.tp_group),
        rows_lo=program.rows[0], rows_hi_incl=program.rows[1] - 1, num_microbatches=program.num_microbatches,
        microbatch_size=program.microbatch_size,
        stage_list=", ".join(str(st.stage) for st in program.stages) if len(program.stages) <= 16
        else f"{len(program.stages)} stages: {program.stages[0].stage}, {program.stages[1].stage}, ..., "
             f"{program.stages[-1].stage}",
        ops=repr(program.ops), binds=binds,
        stages=[_stage_lines(program, st, names) for st in program.stages])
