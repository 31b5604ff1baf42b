"""The compile pipeline: the table of steps from a model to its rendered rank modules.

    step     makes                                   printer (dump)        verifier (OPWEAVE_VERIFY=1)
    trace    OpGraph (torch.fx trace of decode)      format_graph          ir/graph.py verify
    blocks   BlockedGraph (partition blocks)         format_blocks         ir/verify.py verify_blocks
    search   SearchResult (best candidate)           format_search         stage cover, memory fit
    place    Placement (replica sets on the nodes)   format_placement      placement.py verify_placement
    plan     Plan                                    format_plan + JSON    ir/plan.py verify_plan
    lower    RankProgram per rank                    format_program        ir/verify.py verify_programs
    render   rank_XX.py sources                      the sources           ir/verify.py verify_modules

One frozen record, `Compiled`, holds a compile: its `Inputs` and the IRs made so far. Each step
is a function in `compiler/steps.py`. It takes the fields named in `reads` and returns those
named in `makes`; `run` puts them into a new record.

With OPWEAVE_DEBUG_DIR set, step i writes its printer's text as `NN_<step>.txt` (NN = i + 1,
whichever driver runs it); the text is formatted only then. With OPWEAVE_VERIFY=1 its verifier
runs after it, and a failure raises `IRError` "verify failed after step 'S' (steps run so far):
...". Any other exception a step raises becomes a `StepError` "step 'S' failed (after A, B):
..." with the original chained, as torch.fx's PassManager reports a pass. An `OpWeaveError`
(bad user input) passes unchanged.

The drivers: `run_front_end` runs trace and blocks, `compile_model` trace .. plan,
`write_artifact` lower and render. `pinned_plan` replaces the search by a given candidate and
runs place and plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

from opweave import config
from opweave.compiler import steps
from opweave.compiler.inputs import Inputs
from opweave.errors import OpWeaveError
from opweave.ir.graph import IRError, OpGraph, format_graph, verify
from opweave.ir.plan import Plan, format_plan, plan_to_json, verify_plan
from opweave.ir.program import RankProgram, format_program
from opweave.ir.verify import verify_blocks, verify_modules, verify_programs
from opweave.models.registry import ModelSource
from opweave.passes.blocks import BlockedGraph, find_blocks, format_blocks
from opweave.passes.placement import Placement, format_placement, verify_placement
from opweave.passes.search import SearchResult, format_search


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compile: its inputs and the IRs its steps made so far (None or empty until made).

    After trace and blocks it is the front end (`compiler/frontend.py FrontEnd`). After plan it is
    what `compile_model` and `pinned_plan` return. `write_artifact` runs lower and render on it.
    """

    inputs: Inputs
    source: ModelSource | None = None
    graph: OpGraph | None = None
    blocks: BlockedGraph | None = None
    result: SearchResult | None = None
    placement: Placement | None = None
    plan: Plan | None = None
    plan_text: str = ""
    programs: tuple[RankProgram, ...] = ()
    modules: Mapping[str, str] = dataclasses.field(default_factory=dict)
    steps: tuple[str, ...] = ()      # the steps run so far, in order (named in failures)


class StepError(Exception):
    """A step raised something other than an `OpWeaveError`: a bug in OpWeave or in a hook.

    `step` is the step, `before` the steps run before it; the original error is `__cause__`.
    """

    def __init__(self, message: str, step: str = "", before: tuple[str, ...] = ()):
        super().__init__(message)
        self.step, self.before = step, before


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    run: Callable[..., Any]                # the fields named in `reads` -> those named in `makes`
    reads: tuple[str, ...]
    makes: tuple[str, ...]
    printer: Callable[[Compiled], str]
    verifier: Callable[[Compiled], Any] | None
    doing: str = ""                        # the progress line said as it starts (`Inputs.progress`)


def _verify_search(c: Compiled) -> None:
    cand = c.result.best
    nxt = 0
    for s in cand.stage_plan.stages:
        if s.first != nxt or s.last < s.first:
            raise IRError(f"stage {s.index} covers ops {s.first}..{s.last} after op {nxt - 1}")
        nxt = s.last + 1
    if nxt != len(c.graph.ops) or len(cand.problem.stages) != len(cand.stage_plan.stages):
        raise IRError(f"the best candidate's stages cover ops 0..{nxt - 1} of {len(c.graph.ops)}")
    for o in cand.owners:
        if o.memory_per_gpu > o.gpu.usable_memory_bytes:
            raise IRError(f"owner o{o.slot} ({o.describe()}) needs {o.memory_per_gpu / 1e9:.1f} GB per GPU, "
                          f"more than the {o.gpu.usable_memory_bytes / 1e9:.1f} GB usable")


def _print_plan(c: Compiled) -> str:
    return format_plan(c.plan) + "\n\n" + json.dumps(plan_to_json(c.plan), indent=1)


STEPS: tuple[Step, ...] = (
    Step("trace", steps.trace_model, ("inputs",), ("source", "graph"),
         lambda c: format_graph(c.graph), lambda c: verify(c.graph), "tracing the decode step (torch.fx)"),
    Step("blocks", find_blocks, ("graph",), ("blocks",),
         lambda c: format_blocks(c.blocks), lambda c: verify_blocks(c.blocks), "finding the partition blocks"),
    Step("search", steps.search_plans, ("inputs", "source", "graph", "blocks"), ("result", "inputs"),
         lambda c: format_search(c.result), _verify_search, "searching templates, owners and batches"),
    Step("place", steps.place_best, ("inputs", "result"), ("placement",),
         lambda c: format_placement(c.placement), lambda c: verify_placement(c.placement, c.inputs.cluster),
         "placing the replica sets on the nodes"),
    Step("plan", steps.make_plan, ("inputs", "graph", "result", "placement"), ("plan",),
         _print_plan, lambda c: verify_plan(c.plan, len(c.graph.ops)),
         "assembling the plan (stages, owners, predicted figures)"),
    Step("lower", steps.lower_plan, ("source", "graph", "blocks", "plan"), ("plan_text", "programs"),
         lambda c: "\n\n".join(format_program(p) for p in c.programs) or "(no rank programs: a model.py model)",
         lambda c: verify_programs(c.programs), "lowering the plan to rank programs"),
    Step("render", steps.render_modules, ("graph", "plan", "programs"), ("modules",),
         lambda c: "\n".join(f"# ==== {name}\n{text}" for name, text in c.modules.items()),
         lambda c: verify_modules(c.modules, c.programs), "rendering the rank modules"),
)
NAMES = tuple(s.name for s in STEPS)


def _index(name: str) -> int:
    if name not in NAMES:
        raise ValueError(f"no pipeline step {name!r} (steps: {', '.join(NAMES)})")
    return NAMES.index(name)


def after_step(c: Compiled, name: str) -> Compiled:
    """What follows step `name` (run here or by a driver that replaces it, e.g. a pinned plan's
    search): `c` with the step added to `steps`, its numbered dump when OPWEAVE_DEBUG_DIR is set,
    its verifier when OPWEAVE_VERIFY=1."""
    i = _index(name)
    step = STEPS[i]
    c = dataclasses.replace(c, steps=c.steps + (name,))
    folder = config.debug_dir()  # checked: a folder files can be written in
    if folder:
        path = os.path.join(folder, f"{i + 1:02d}_{name}.txt")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(step.printer(c) + "\n")
        except OSError as e:  # the folder went away or filled up meanwhile
            raise OpWeaveError(f"OPWEAVE_DEBUG_DIR: cannot write {path} ({e.strerror or e})") from None
    if step.verifier is not None and config.verify_enabled():
        try:
            step.verifier(c)
        except IRError as e:
            raise IRError(f"verify failed after step '{name}' ({', '.join(c.steps)}): {e}") from e
    return c


def run(c: Compiled, first: str = NAMES[0], last: str = NAMES[-1]) -> Compiled:
    """Runs steps `first` .. `last` in order on `c`, each followed by `after_step`; returns the
    new record (`c` itself is not changed). Each step says what it does to `c.inputs.progress`
    (`opweave compile`'s progress lines on stderr) as it starts."""
    for step in STEPS[_index(first):_index(last) + 1]:
        if c.inputs.progress is not None:
            c.inputs.progress(f"{step.name}: {step.doing}")
        try:
            made = step.run(**{field: getattr(c, field) for field in step.reads})
            made = dict(zip(step.makes, made if len(step.makes) > 1 else (made,), strict=True))
        except OpWeaveError:
            raise
        except Exception as e:
            before = f"after {', '.join(c.steps)}" if c.steps else "the first step"
            raise StepError(f"step '{step.name}' failed ({before}): {type(e).__name__}: {e}",
                            step.name, c.steps) from e
        c = after_step(dataclasses.replace(c, **made), step.name)
    return c
