"""Hardware: the GPU catalog (`catalog.json`, one source per number), network profiles, price
tables and cluster specs.

`catalog.py` loads the catalog into `GPUSpec`s (with an optional price table and override file)
and resolves GPU names; `networks.py` holds the inter-node figures of each kind of node
(`networks.json`, named by an entry's `network` or a pool's `@PROFILE`); `prices.py` the public
price tables (`prices/*.json`, `--prices NAME`); `cluster.py` parses `--cluster` text
(`h100x8+l40sx8`, `h100x16@dgx`, a YAML/JSON file, or `local`) into a `Cluster` of pools and lays
its GPUs out into nodes. See docs/hardware.md.
"""
