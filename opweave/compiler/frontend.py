"""The front end of the compile pipeline: MODEL argument -> OpGraph -> partition blocks.

These are the pipeline's first two steps (`compiler/pipeline.py`: trace, blocks), with their
numbered debug dumps (OPWEAVE_DEBUG_DIR) and verifiers (OPWEAVE_VERIFY=1).
"""

from __future__ import annotations

import dataclasses

from opweave.ir.graph import OpGraph
from opweave.models.registry import ModelSource
from opweave.passes.blocks import BlockedGraph


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    source: ModelSource
    graph: OpGraph
    blocks: BlockedGraph


def run_front_end(model: str, dtype: str | None = None) -> FrontEnd:
    """Resolves MODEL, traces its decode step and finds its partition blocks."""
    from opweave.compiler import pipeline

    return pipeline.run(pipeline.State(model=model, dtype=dtype), last="blocks").front_end()
