"""Worker entry point for `torchrun` (multi-node runs): `python -m opweave.runtime.entry ARTIFACT
--weights CKPT --prompts FILE.jsonl [--max-new-tokens N]`. torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; rank 0 prints `{"outputs": [...]}`. `opweave run ARTIFACT --torchrun`
prints the command for each node."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from opweave import config
from opweave.errors import OpWeaveError


def main() -> int:
    """One rank under torchrun. Its process group's timeout is `--stall-timeout` (no launcher
    watches the ranks here: a peer waiting longer for a stalled rank fails, and torchrun stops
    the others). The rendezvous and gloo/NCCL sockets use the network between the nodes, which
    must be trusted; `--iface` (or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) names the interface."""
    import torch
    import torch.distributed as dist

    from opweave.runtime.launch import (STALL_TIMEOUT_S, RunConfig, join_process_group, planned_prefill, read_requests,
                                        world_size)
    from opweave.runtime.checks import check_inputs
    from opweave.artifact import load_artifact, read_key
    from opweave.runtime.worker import run_rank

    parser = argparse.ArgumentParser(prog="opweave.runtime.entry")
    parser.add_argument("artifact")
    parser.add_argument("--weights", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT_S, metavar="SECONDS",
                        help="the process group's timeout: a rank waiting longer on a peer fails")
    parser.add_argument("--verify-key", metavar="KEY_FILE", help="refuse the artifact unless manifest.sig matches")
    parser.add_argument("--iface", metavar="NAME", help="network interface for gloo/NCCL (default: "
                        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else the one the host name resolves to)")
    args = parser.parse_args()
    rank = os.environ.get("RANK")
    try:
        rank = int(os.environ["RANK"])
        key = read_key(args.verify_key, "--verify-key") if args.verify_key else None
        artifact = load_artifact(args.artifact, verify_key=key)  # read once, checked, then used
        requests = read_requests(args.prompts, None, args.max_new_tokens)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cfg = RunConfig(artifact=args.artifact, weights=args.weights, device=device, requests=requests,
                        stall_timeout_s=args.stall_timeout)  # validates the flags as `opweave run` does
        cfg = planned_prefill(cfg, artifact)
        check_inputs(cfg, artifact)
        config.check_run(device, world_size(args.artifact, artifact.manifest))
        if args.iface:
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = args.iface
        join_process_group(device, args.stall_timeout,
                           int(os.environ.get("LOCAL_RANK", 0)) if device == "cuda" else None)
        out = run_rank(artifact, rank, args.weights, device, list(requests), prefill_budget=cfg.prefill_budget)
        if rank == 0:
            print(json.dumps({"outputs": [{"prompt_ids": r.prompt, "token_ids": r.output} for r in out[0]]}))
        dist.destroy_process_group()
        # as the local launcher's ranks do: no interpreter teardown, whose destruction of the
        # communication library's threads can abort a finished rank ("terminate called ...")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except OpWeaveError as e:
        print(f"opweave: error: rank {rank}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of the terminal's process group
        return 130
    except Exception as e:  # a peer lost or timed out: one line, as the local launcher reports it
        if config.debug_enabled():
            raise
        print(f"opweave: error: rank {rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1
    return 0


def torchrun_commands(artifact: str, weights: str, prompts: str, max_new_tokens: int, port: int = 29500,
                      extra: tuple[str, ...] = ()) -> list[str]:
    """One `torchrun` command per node of replica set 0; when the ranks do not fill the nodes
    evenly (torchrun's static numbering), the per-rank commands of each node instead.

    Every argument is quoted for a POSIX shell (`shlex.quote`), so a path with a space, `;` or
    `$(...)` stays one argument; `<node-0-address>` (quoted too: unedited it is a bad host name,
    not a redirection) is to be replaced by the address of the first node."""
    from opweave.artifact import load_artifact
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.ir.plan import plan_from_json

    plan = plan_from_json(load_artifact(artifact, ["plan.json"]).json("plan.json"))
    cluster = parse_cluster(plan.cluster, load_catalog())
    rank_nodes = [cluster.locate(g).node_index for o in plan.owners for replica in o.gpus for g in replica]
    nodes = sorted(set(rank_nodes), key=rank_nodes.index)
    per_node = [rank_nodes.count(n) for n in nodes]
    contiguous = rank_nodes == [n for n, c in zip(nodes, per_node) for _ in range(c)]
    address = shlex.quote("<node-0-address>")
    tail = shlex.join(["-m", "opweave.runtime.entry", artifact, "--weights", weights, "--prompts", prompts,
                       "--max-new-tokens", str(max_new_tokens), *extra])
    if not contiguous or len(set(per_node)) != 1:  # torchrun needs equal nodes: start each rank by hand
        out = []
        for i, n in enumerate(nodes):
            ranks = [r for r, node in enumerate(rank_nodes) if node == n]
            lines = [f"RANK={r} LOCAL_RANK={j} WORLD_SIZE={len(rank_nodes)} MASTER_ADDR={address} "
                     f"MASTER_PORT={int(port)} python {tail} &" for j, r in enumerate(ranks)]
            out.append(f"# node {i} (cluster node {n}): ranks {ranks[0]}..{ranks[-1]}\n" + "\n".join(lines) + "\nwait")
        return out
    return [f"# node {i} (cluster node {n})\ntorchrun --nnodes {len(nodes)} --node-rank {i} "
            f"--nproc-per-node {per_node[0]} --master-addr {address} --master-port {int(port)} {tail}"
            for i, n in enumerate(nodes)]


if __name__ == "__main__":
    sys.exit(main())
