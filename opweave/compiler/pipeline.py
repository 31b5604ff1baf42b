"""The compile pipeline: one list of steps from a model to its rendered rank modules.

    step     makes                                   printer (dump)        verifier (OPWEAVE_VERIFY=1)
    trace    OpGraph (torch.fx trace of decode)      format_graph          ir/graph.py verify
    blocks   BlockedGraph (partition blocks)         format_blocks         ir/verify.py verify_blocks
    search   SearchResult (best candidate)           format_search         stage cover, memory fit
    place    Placement (replica sets on the nodes)   format_placement      placement.py verify_placement
    plan     Plan                                    format_plan + JSON    ir/plan.py verify_plan
    lower    RankProgram per rank                    format_program        ir/verify.py verify_programs
    render   rank_XX.py sources                      the sources           ir/verify.py verify_modules

Each step reads and fills fields of one `State`. With OPWEAVE_DEBUG_DIR set, step i writes its
printer's text as `NN_<step>.txt` (NN = i + 1, whichever driver runs it); the text is formatted
only then. With OPWEAVE_VERIFY=1 its verifier runs after it, and a failure raises `IRError`
"verify failed after step 'S' (steps run so far): ...". `compile_model` runs trace .. plan,
`write_artifact` lower and render, `run_front_end` trace and blocks, and `pinned_plan` replaces
the search by a given candidate and runs place and plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

from opweave import config
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import IRError, OpGraph, format_graph, verify
from opweave.ir.plan import Plan, format_plan, verify_plan
from opweave.ir.program import RankProgram, format_program
from opweave.ir.verify import verify_blocks, verify_modules, verify_programs
from opweave.models.registry import ModelSource
from opweave.passes.blocks import BlockedGraph, format_blocks
from opweave.passes.placement import Placement, format_placement, verify_placement
from opweave.passes.search import PlanSpace, SearchOptions, SearchResult, format_search
from opweave.models.activation import PREFILL_CHUNK


@dataclasses.dataclass
class State:
    """What the steps read (the inputs) and fill (one IR each)."""

    model: str
    dtype: str | None = None
    cluster: Cluster | None = None
    tpot_slo_s: float = math.inf
    context: int = 0
    prefill_chunk: int = PREFILL_CHUNK
    options: SearchOptions = SearchOptions()
    cost_model: CostModel = CostModel()
    progress: Callable[[str], None] | None = None
    allow_long_context: bool = False
    warn: Callable[[str], None] | None = None
    source: ModelSource | None = None
    graph: OpGraph | None = None
    blocks: BlockedGraph | None = None
    result: SearchResult | None = None
    placement: Placement | None = None
    plan: Plan | None = None
    plan_text: str = ""
    programs: tuple[RankProgram, ...] = ()
    modules: dict[str, str] = dataclasses.field(default_factory=dict)
    done: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, compiled) -> State:
        """The state after the steps that made `compiled` (compiler/compile.py Compiled)."""
        fe = compiled.front_end
        return cls(model=fe.source.path, source=fe.source, graph=fe.graph, blocks=fe.blocks, result=compiled.result,
                   plan=compiled.plan, context=compiled.plan.context, done=list(compiled.steps))

    def front_end(self):
        from opweave.compiler.frontend import FrontEnd

        return FrontEnd(source=self.source, graph=self.graph, blocks=self.blocks)

    def compiled(self):
        from opweave.compiler.compile import Compiled

        return Compiled(front_end=self.front_end(), result=self.result, plan=self.plan, steps=tuple(self.done))


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[State], None]
    printer: Callable[[State], str]
    verifier: Callable[[State], Any] | None


def _trace(st: State) -> None:
    from opweave.ir.trace import build_graph
    from opweave.models.registry import resolve

    st.source = resolve(st.model)                                  # name | checkpoint dir | model.py
    st.graph = build_graph(st.source.build("meta", st.dtype))      # torch.fx trace -> OpGraph


def _blocks(st: State) -> None:
    from opweave.passes.blocks import find_blocks

    st.blocks = find_blocks(st.graph)                              # smallest repeating layer pattern


def _search(st: State) -> None:
    from opweave.compiler.compile import check_context
    from opweave.passes.search import search

    check_context(st.front_end(), st.context, st.allow_long_context, st.warn)  # within the trained positions
    space = PlanSpace(graph=st.graph, blocks=st.blocks, cluster=st.cluster, context=st.context,
                      tpot_slo_s=st.tpot_slo_s, cost_model=st.cost_model, prefill_chunk=st.prefill_chunk)
    st.result = search(space, st.options, st.progress)             # templates x owners x batching
    if st.result.best is None:
        raise OpWeaveError(f"no plan: {st.result.reason}")


def _verify_search(st: State) -> None:
    cand = st.result.best
    nxt = 0
    for s in cand.stage_plan.stages:
        if s.first != nxt or s.last < s.first:
            raise IRError(f"stage {s.index} covers ops {s.first}..{s.last} after op {nxt - 1}")
        nxt = s.last + 1
    if nxt != len(st.graph.ops) or len(cand.problem.stages) != len(cand.stage_plan.stages):
        raise IRError(f"the best candidate's stages cover ops 0..{nxt - 1} of {len(st.graph.ops)}")
    for o in cand.owners:
        if o.memory_per_gpu > o.gpu.usable_memory_bytes:
            raise IRError(f"owner o{o.slot} ({o.describe()}) needs {o.memory_per_gpu / 1e9:.1f} GB per GPU, "
                          f"more than the {o.gpu.usable_memory_bytes / 1e9:.1f} GB usable")


def _place(st: State) -> None:
    from opweave.compiler.compile import place

    st.placement = place(st.result.best, st.cluster)


def _plan(st: State) -> None:
    from opweave.compiler.compile import make_plan

    st.plan = make_plan(st.front_end(), st.cluster, st.context, st.tpot_slo_s, st.result, st.placement,
                        prefill_chunk=st.prefill_chunk)


def _lower(st: State) -> None:
    from opweave.artifact import sha256_text
    from opweave.compiler.compile import lower_plan, plan_text

    st.plan_text = plan_text(st.plan)
    st.programs = lower_plan(st.plan, st.front_end(), sha256_text(st.plan_text))


def _render(st: State) -> None:
    from opweave.codegen.render import render_rank

    names = [op.name for op in st.graph.ops]
    st.modules = {f"rank_{p.rank:02d}.py": render_rank(p, names, st.plan.template, st.plan.num_stages)
                  for p in st.programs}


def _print_plan(st: State) -> str:
    from opweave.ir.plan import plan_to_json

    return format_plan(st.plan) + "\n\n" + json.dumps(plan_to_json(st.plan), indent=1)


STEPS: tuple[Step, ...] = (
    Step("trace", _trace, lambda st: format_graph(st.graph), lambda st: verify(st.graph)),
    Step("blocks", _blocks, lambda st: format_blocks(st.blocks), lambda st: verify_blocks(st.blocks)),
    Step("search", _search, lambda st: format_search(st.result), _verify_search),
    Step("place", _place, lambda st: format_placement(st.placement),
         lambda st: verify_placement(st.placement, st.cluster)),
    Step("plan", _plan, _print_plan, lambda st: verify_plan(st.plan, len(st.graph.ops))),
    Step("lower", _lower, lambda st: "\n\n".join(format_program(p) for p in st.programs) or "(no rank programs: "
         "a model.py model)", lambda st: verify_programs(st.programs)),
    Step("render", _render, lambda st: "\n".join(f"# ==== {name}\n{text}" for name, text in st.modules.items()),
         lambda st: verify_modules(st.modules, st.programs)),
)
NAMES = tuple(s.name for s in STEPS)


def _index(name: str) -> int:
    if name not in NAMES:
        raise ValueError(f"no pipeline step {name!r} (steps: {', '.join(NAMES)})")
    return NAMES.index(name)


def after_step(st: State, name: str) -> None:
    """What follows step `name` (run here or by a driver that replaces it, e.g. a pinned plan's
    search): its numbered dump when OPWEAVE_DEBUG_DIR is set, its verifier when OPWEAVE_VERIFY=1."""
    i = _index(name)
    step = STEPS[i]
    st.done.append(name)
    folder = config.debug_dir()
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i + 1:02d}_{name}.txt"), "w", encoding="utf-8") as f:
            f.write(step.printer(st) + "\n")
    if step.verifier is not None and config.verify_enabled():
        try:
            step.verifier(st)
        except IRError as e:
            raise IRError(f"verify failed after step '{name}' ({', '.join(st.done)}): {e}") from e


def run(st: State, first: str = NAMES[0], last: str = NAMES[-1]) -> State:
    """Runs steps `first` .. `last` in order on `st`, each followed by `after_step`."""
    for step in STEPS[_index(first):_index(last) + 1]:
        step.run(st)
        after_step(st, step.name)
    return st
