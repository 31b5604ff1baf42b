"""The compile's front end: a MODEL argument traced into an OpGraph and cut into partition blocks.

`run_front_end` runs the pipeline's first two steps, trace and blocks (`compiler/pipeline.py`).
It returns the compile's record after them. The later steps continue from that record.
"""

from __future__ import annotations

from opweave.compiler import pipeline
from opweave.compiler.inputs import Inputs

FrontEnd = pipeline.Compiled
"""A compile's record after trace and blocks (`source`, `graph`, `blocks`): the same record type."""


def run_front_end(model: str, dtype: str | None = None, kv_cache_dtype: str = "auto") -> FrontEnd:
    """Resolves MODEL, traces its decode step (attention caching keys and values as
    `kv_cache_dtype`) and finds its partition blocks."""
    return pipeline.run(pipeline.Compiled(inputs=Inputs(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype)),
                        last="blocks")
