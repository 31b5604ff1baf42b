"""The front end of the compile pipeline: MODEL argument -> OpGraph -> partition blocks.

Each pass is a pure function; with OPWEAVE_DEBUG_DIR set, the IR after each pass is written as
`NN_<pass>.txt`, and with OPWEAVE_VERIFY=1 the IR is verified after each pass.
"""

from __future__ import annotations

import dataclasses
import os

from opweave import config
from opweave.ir.graph import OpGraph, format_graph, verify
from opweave.ir.trace import build_graph
from opweave.models.registry import ModelSource, resolve
from opweave.passes.blocks import BlockedGraph, find_blocks, format_blocks


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    source: ModelSource
    graph: OpGraph
    blocks: BlockedGraph


def _debug_write(step: int, name: str, text: str) -> None:
    folder = config.debug_dir()
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{step:02d}_{name}.txt"), "w") as f:
            f.write(text + "\n")


def run_front_end(model: str, dtype: str | None = None) -> FrontEnd:
    """Resolves MODEL, traces its decode step and finds its partition blocks."""
    source = resolve(model)                                   # name | checkpoint dir | model.py
    graph = build_graph(source.build("meta", dtype))          # torch.fx trace -> OpGraph
    _debug_write(1, "trace", format_graph(graph))
    if config.verify_enabled():
        verify(graph)
    blocks = find_blocks(graph)                               # smallest repeating layer pattern
    _debug_write(2, "blocks", format_blocks(blocks))
    return FrontEnd(source=source, graph=graph, blocks=blocks)
