"""What a compile is asked for, as one frozen record, and the plan space it searches.

`Inputs` holds the compile's inputs: the MODEL argument, the cluster, the TPOT target, the
context, the search options, the cost model. It also holds two hooks: `progress` (one line per
search phase) and `warn` (a warning for the user). `plan_space` is the one builder of the
search's `PlanSpace`. The compile, `compile --fleet`, pinned plans and the benches all use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from opweave.cost.model import CostModel
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import OpGraph
from opweave.ir.plan import PREFILL_CHUNK
from opweave.ir.workload import Workload
from opweave.passes.blocks import BlockedGraph
from opweave.passes.search import SearchOptions
from opweave.passes.space import PlanSpace


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A compile's inputs. The front end reads `model` and `dtype`; the later steps read the rest."""

    model: str                                  # built-in name, checkpoint folder or model.py
    dtype: str | None = None                    # the traced dtype (None: the model's own)
    kv_cache_dtype: str = "auto"                # attention's cache: "auto" (the model's dtype) or "fp8"
    cluster: Cluster | None = None
    tpot_slo_s: float = math.inf
    context: int = 0
    prefill_chunk: int = PREFILL_CHUNK          # prompt tokens per row per step: sizes the activations
    workload: Workload | None = None            # the traffic to plan for (None: decode alone, `ir/workload.py`)
    options: SearchOptions = SearchOptions()
    cost_model: CostModel = CostModel()
    allow_long_context: bool = False            # a context past max_position_embeddings warns, not fails
    progress: Callable[[str], None] | None = None
    warn: Callable[[str], None] | None = None   # None: Python's warnings.warn

    @property
    def isl(self) -> int | None:
        return None if self.workload is None else self.workload.isl

    @property
    def osl(self) -> int | None:
        return None if self.workload is None else self.workload.osl


def plan_space(graph: OpGraph, blocks: BlockedGraph, inputs: Inputs | None = None, **changes) -> PlanSpace:
    """The plan space of `graph` and `blocks` for `inputs`, with the fields in `changes` replaced.

    Without `inputs`, the fields come from `changes` alone, e.g.
    `plan_space(fe.graph, fe.blocks, cluster=cluster, context=8192, tpot_slo_s=0.05)`.
    """
    if inputs is None:
        inputs = Inputs(model=graph.model, **changes)
    elif changes:
        inputs = dataclasses.replace(inputs, **changes)
    return PlanSpace(graph=graph, blocks=blocks, cluster=inputs.cluster, context=inputs.context,
                     tpot_slo_s=inputs.tpot_slo_s, cost_model=inputs.cost_model, prefill_chunk=inputs.prefill_chunk,
                     workload=inputs.workload, attention_dp=inputs.options.attention_dp)
