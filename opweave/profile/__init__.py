"""Measured operator latencies and link figures for the cost model (`opweave profile`, docs/profile.md)."""

from opweave.profile.signature import graph_hash, op_signature
from opweave.profile.table import OpEntry, ProfileTable, cpu_gpu_spec, interpolate, load_profile

__all__ = ["OpEntry", "ProfileTable", "cpu_gpu_spec", "graph_hash", "interpolate", "load_profile", "op_signature",
           "profile"]


def profile(*args, **kwargs):
    """`opweave.profile.measure.profile` (imported on first use: it pulls in the model code)."""
    from opweave.profile.measure import profile as run

    return run(*args, **kwargs)
