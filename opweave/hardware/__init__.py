"""Hardware: the GPU catalog (`catalog.json`, one source per number) and cluster specs.

`catalog.py` loads the catalog into `GPUSpec`s (with an optional override file) and resolves GPU
names; `cluster.py` parses `--cluster` text (`h100x8+l40sx8`, a YAML/JSON file, or `local`) into
a `Cluster` of pools and lays its GPUs out into nodes. See docs/hardware.md.
"""
