"""Rendering a `RankProgram` as a readable Python module (`rank_XX.py`).

Every decision is made here in Python; the jinja2 template only lays out plain values. Each
generated line carries a comment naming the plan stage, block, layer and operator it serves.

Note: generated code is safe by construction. Names in a plan come from outside (a model is
named after its checkpoint folder, operators after the model's modules), and `opweave run`
executes these modules, so no value is ever pasted into source text. A value reaches the module
in one of two forms only:
  - `literal(value)`: an ASCII Python literal (`ascii()` of a str, int, bool, None, or a tuple
    or list of them); anything else is refused;
  - `comment(*parts)`: `# ` and the parts, each escaped as by `ascii()` (joined by the fixed
    separator ` · `), so a newline, a quote, a backslash or a non-ASCII character in a name
    cannot end the comment or change the file's encoding.
Both return `Code`, and the template's finalizer emits any other value through `literal`, so the
template cannot paste a raw string. Statements are built from numbers and the variable names
`_Names` makes (checked identifiers). The module docstring and the first two lines are fixed
text: nothing from the plan can form a `coding:` declaration.
"""

from __future__ import annotations

import os
import re

import jinja2

from opweave import __version__
from opweave.ir.kinds import OpKind
from opweave.ir.program import Launch, RankProgram, StageProgram, stateful

_VALUE = re.compile(r"^(?P<name>[^\[]+)(\[(?P<index>[0-9]+)\])?$")
_VARIABLE = re.compile(r"v[0-9]+(_[0-9]+)?|ids|positions")


class Code(str):
    """Python source made by `literal`, `comment` or `_statement`: the only text the template
    emits as it is."""


def literal(value) -> Code:
    """`value` as an ASCII Python literal: str, int, bool, None, or a tuple/list of those.

    Exact types only: a subclass may carry its own `__repr__` (an IntEnum's is not a literal)."""
    if type(value) in (tuple, list):
        items = [literal(v) for v in value]
        if type(value) is list:
            return Code("[" + ", ".join(items) + "]")
        return Code("(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")")
    if type(value) not in (str, int, bool, type(None)):
        raise TypeError(f"a generated module holds only str, int, bool, None and tuples of them, "
                        f"not {type(value).__name__}")
    return Code(ascii(value))


def comment(*parts: str) -> Code:
    """`# part · part ...` on one line, whatever the parts hold (each escaped as by `ascii()`)."""
    return Code("# " + " · ".join(ascii(str(p))[1:-1] for p in parts))


def _statement(source: str, *note: str) -> Code:
    """A generated statement (numbers and `_Names` variables only) and its comment, if any."""
    if "\n" in source or "#" in source or not source.isascii():
        raise ValueError(f"generated statement is not one plain line: {source!r}")
    return Code(source + ("  " + comment(*note) if note else ""))


def _emit(value) -> Code:
    """The template's finalizer: `Code` as it is, every other value as a literal."""
    return value if isinstance(value, Code) else literal(value)


_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=False,
                          autoescape=False, finalize=_emit)


class _Names:
    """IR value names -> Python variable names (v<op> or v<op>_<element>)."""

    def __init__(self, op_index: dict[str, int]):
        self.op_index = op_index

    def var(self, value: str) -> str:
        if value in ("ids", "positions"):
            return value
        m = _VALUE.match(value)
        base = f"v{int(self.op_index[m.group('name')])}"
        name = base if m.group("index") is None else f"{base}_{int(m.group('index'))}"
        if not _VARIABLE.fullmatch(name):
            raise ValueError(f"generated variable name {name!r} is not an identifier")
        return name


def _where(st: StageProgram) -> str:
    layers = f"layers {st.layers[0]}-{st.layers[-1]}" if st.layers else "no layer"
    block = f"block {st.block}" if st.block is not None else "tail layers / epilogue"
    return f"{block}, {layers}, ops {st.launches[0].op}..{st.launches[-1].op}"


def _note(st: StageProgram, l: Launch, extra: str = "") -> tuple[str, ...]:
    block = "-" if l.block is None else l.block
    layer = "-" if l.layer is None else l.layer
    return f"stage {st.stage}", f"block {block}", f"layer {layer}", f"{l.kind} ({l.name}){extra}"


def fused_add_norm(st: StageProgram, k: int) -> bool:
    """Launch k is a residual add whose sum only goes on to the next launch's RMSNorm (and on as
    the residual stream): the two run as one fused kernel (`rt.add_norm`, `add_rms_norm`)."""
    if k + 1 >= len(st.launches):
        return False
    add, norm = st.launches[k], st.launches[k + 1]
    return (add.kind == OpKind.RESIDUAL.value and norm.kind in (OpKind.NORM.value, OpKind.FINAL_NORM.value)
            and not add.allreduce and not norm.allreduce and tuple(norm.inputs) == (add.output,))


def _peers(peers) -> str:
    return ", ".join(f"rank {p.rank} rows {p.lo}..{p.hi - 1}" for p in peers)


def _held_key(names: _Names, value: str) -> str:
    """The key of a kept value in `self.held[mb]`: its variable name, as a literal."""
    return literal(names.var(value))


def _held_links(program: RankProgram) -> tuple[dict, dict, dict]:
    """(value -> stage that keeps it, value -> stages that take it, in order) and, per stage, the
    later stages reading back what it keeps: for the provenance comments and to pop a kept value
    at its last reading."""
    kept_by: dict[str, int] = {}
    taken_by: dict[str, list[int]] = {}
    for st in program.stages:
        for v in st.takes:
            taken_by.setdefault(v, []).append(st.stage)
        for v in st.keeps:
            kept_by[v] = st.stage
    readers = {st.stage: {v: [s for s in taken_by.get(v, []) if s > st.stage] for v in st.keeps}
               for st in program.stages}
    return kept_by, taken_by, readers


def _stage_lines(program: RankProgram, st: StageProgram, names: _Names, links: tuple[dict, dict, dict]) -> dict:
    kept_by, taken_by, readers = links
    used = ({v for l in st.launches for v in l.inputs} | set(st.send.values if st.send else ()) | set(st.keeps))
    if st.recv is None:
        head = _statement("ids, positions = rt.begin(mb)", "scheduler: this step's tokens and positions for my rows")
    elif not st.recv.values:
        head = _statement(f"positions, () = rt.recv({int(st.stage)}, mb)",
                          f"after op {st.recv.cut}, from {_peers(st.recv.peers)}: positions only, "
                          "every value this stage reads is kept here")
    else:
        received = ", ".join(names.var(v) for v in st.recv.values)
        head = _statement(f"positions, ({received},) = rt.recv({int(st.stage)}, mb)",
                          f"after op {st.recv.cut}, from {_peers(st.recv.peers)}")
    takes = []
    for v in st.takes:
        source = f"self.held[mb][{_held_key(names, v)}]"
        if taken_by[v][-1] == st.stage:   # its last reading on this rank
            source = f"self.held[mb].pop({_held_key(names, v)})"
        takes.append(_statement(f"{names.var(v)} = {source}", f"stage {st.stage}",
                                f"{v}, kept on this owner since stage {kept_by[v]} (not sent)"))
    last_use = {names.var(v): k for k, l in enumerate(st.launches) for v in l.inputs}
    keep = ({"ids", "positions"} | {names.var(v) for v in (st.send.values if st.send else ())}
            | {names.var(v) for v in st.keeps})
    if st.returns:
        keep.add(names.var(st.launches[-1].output))
    lines = []
    fused = {k + 1 for k in range(len(st.launches)) if fused_add_norm(st, k)}  # norms run with their add
    for k, l in enumerate(st.launches):
        out = names.var(l.output)
        args = ", ".join(names.var(v) for v in l.inputs)
        if k in fused:
            pass  # emitted with the residual add before it
        elif k + 1 in fused:
            norm = st.launches[k + 1]
            lines.append(_statement(f"{out}, {names.var(norm.output)} = rt.add_norm(self.op{int(norm.op)}, {args})",
                                    *_note(st, l, f" + {norm.kind} ({norm.name}), fused")))
        elif l.kind == "sample":
            split = ", vocabulary split over the TP group" if program.tp > 1 else ""
            lines.append(_statement(f"{out} = rt.sample(mb, {args}, positions)",
                                    *_note(st, l, f": each row by its sampling word (greedy at temperature 0){split}")))
        else:
            if stateful(l):
                args += f", state=self.state{int(l.op)}[mb]"
            lines.append(_statement(f"{out} = self.op{int(l.op)}({args})", *_note(st, l)))
        if l.allreduce:
            lines.append(_statement(f"{out} = rt.allreduce({out})",
                                    f"stage {st.stage}", f"TP all-reduce of {l.kind} partial sums"))
        elements = sorted(int(v.rsplit("[", 1)[1][:-1]) for v in used if v.startswith(l.output + "["))
        for i in elements:
            lines.append(_statement(f"{out}_{i} = {out}[{i}]"))
        # free what this step no longer needs (its inputs' last use; a tuple once its elements are taken)
        dead = [v for v in dict.fromkeys([*(names.var(x) for x in l.inputs), out])
                if last_use.get(v, -1) <= k and v not in keep]
        if dead:
            lines.append(_statement(f"del {', '.join(dead)}", f"stage {st.stage}", "values not used again this step"))
    for v in st.keeps:   # the owner of its next reader holds it: it stays here instead of going round
        later = ", ".join(map(str, readers[st.stage][v]))
        lines.append(_statement(f"self.held[mb][{_held_key(names, v)}] = {names.var(v)}", f"stage {st.stage}",
                                f"keep {v} for stage {later} of this owner (not sent)"))
    tail = None
    if st.send is not None:
        sent = ", ".join(names.var(v) for v in st.send.values)
        tail = _statement(f"rt.send({int(st.stage)}, mb, positions, ({sent},))",
                          f"after op {st.send.cut}, to {_peers(st.send.peers)}")
    elif st.returns:
        tail = _statement(f"rt.finish(mb, {names.var(st.launches[-1].output)})",
                          f"new token ids to {_peers(st.returns)}")
    skip = _statement(f"if not rt.live({int(st.stage)}, mb):", "no row of this microbatch has a token this round")
    return {"title": comment(f"---- stage {st.stage}: {_where(st)}"), "skip": skip, "head": head,
            "lines": takes + lines,
            "tail": tail}


def render_rank(program: RankProgram, op_names: list[str], template: str, num_stages: int) -> str:
    """The source of `rank_XX.py` for one rank (deterministic, plain ASCII)."""
    names = _Names({name: i for i, name in enumerate(op_names)})
    binds = [{"op": int(l.op), "note": comment(l.name), "state": stateful(l),
              "state_note": comment(l.name, "its state, one view per microbatch")}
             for st in program.stages for l in st.launches if l.kind != "sample"]
    held = None
    if any(st.keeps for st in program.stages):
        held = _statement("self.held = [{} for _ in range(NUM_MICROBATCHES)]",
                          "per microbatch: values this owner keeps for its later stages instead of sending them "
                          "(passes/carry.py)")
    links = _held_links(program)
    return _ENV.get_template("rank.py.j2").render(
        version=__version__, model=program.model, plan_hash=program.plan_hash, template=template,
        num_stages=num_stages, rank=program.rank, world_size=program.world_size, owner=program.owner,
        replica=program.replica, tp_rank=program.tp_rank, tp=program.tp, tp_group=tuple(program.tp_group),
        experts=program.experts,
        rows=tuple(program.rows), num_microbatches=program.num_microbatches,
        microbatch_size=program.microbatch_size, stage_indices=tuple(st.stage for st in program.stages),
        ops=tuple(program.ops), binds=binds, held=held,
        stages=[_stage_lines(program, st, names, links) for st in program.stages])
