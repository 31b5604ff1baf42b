"""Worker entry point for `torchrun` (multi-node runs): `python -m opweave.runtime.entry ARTIFACT
--weights CKPT --prompts FILE.jsonl [--max-new-tokens N]`. torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; rank 0 prints `{"outputs": [...]}`. `opweave run ARTIFACT --torchrun`
prints the command for each node."""

from __future__ import annotations

import argparse
import json
import os
import sys

from opweave.errors import OpWeaveError


def main() -> int:
    import torch
    import torch.distributed as dist

    from opweave.runtime.launch import read_requests
    from opweave.runtime.manifest import verify_manifest
    from opweave.runtime.worker import run_rank

    parser = argparse.ArgumentParser(prog="opweave.runtime.entry")
    parser.add_argument("artifact")
    parser.add_argument("--weights", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    try:
        rank = int(os.environ["RANK"])
        verify_manifest(args.artifact)
        requests = read_requests(args.prompts, None, args.max_new_tokens)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        out = run_rank(args.artifact, rank, args.weights, device, list(requests))
        if rank == 0:
            print(json.dumps({"outputs": [{"prompt_ids": r.prompt, "token_ids": r.output} for r in out[0]]}))
        dist.destroy_process_group()
    except OpWeaveError as e:
        print(f"opweave: error: rank {os.environ.get('RANK')}: {e}", file=sys.stderr)
        return 2
    return 0


def torchrun_commands(artifact: str, weights: str, prompts: str, max_new_tokens: int, port: int = 29500) -> list[str]:
    """One `torchrun` command per node of replica set 0; when the ranks do not fill the nodes
    evenly (torchrun's static numbering), the per-rank commands of each node instead."""
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.ir.plan import plan_from_json

    with open(os.path.join(artifact, "plan.json")) as f:
        plan = plan_from_json(json.load(f))
    node_of = {g.global_index: g.node_index for g in parse_cluster(plan.cluster, load_catalog()).physical_gpus()}
    rank_nodes = [node_of[g] for o in plan.owners for replica in o.gpus[0] for g in replica]
    nodes = sorted(set(rank_nodes), key=rank_nodes.index)
    per_node = [rank_nodes.count(n) for n in nodes]
    contiguous = rank_nodes == [n for n, c in zip(nodes, per_node) for _ in range(c)]
    tail = f"-m opweave.runtime.entry {artifact} --weights {weights} --prompts {prompts} --max-new-tokens {max_new_tokens}"
    if not contiguous or len(set(per_node)) != 1:  # torchrun needs equal nodes: start each rank by hand
        out = []
        for i, n in enumerate(nodes):
            ranks = [r for r, node in enumerate(rank_nodes) if node == n]
            lines = [f"RANK={r} LOCAL_RANK={j} WORLD_SIZE={len(rank_nodes)} MASTER_ADDR=<node-0-address> "
                     f"MASTER_PORT={port} python {tail} &" for j, r in enumerate(ranks)]
            out.append(f"# node {i} (cluster node {n}): ranks {ranks[0]}..{ranks[-1]}\n" + "\n".join(lines) + "\nwait")
        return out
    return [f"# node {i} (cluster node {n})\ntorchrun --nnodes {len(nodes)} --node-rank {i} "
            f"--nproc-per-node {per_node[0]} --master-addr <node-0-address> --master-port {port} {tail}"
            for i, n in enumerate(nodes)]


if __name__ == "__main__":
    sys.exit(main())
