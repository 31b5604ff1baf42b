"""`opweave launch-files`: the files that start a compiled plan's ranks on a real cluster, a
`torchrun` script per node, a Slurm batch script or a Kubernetes LeaderWorkerSet manifest
(`opweave.runtime.launchfiles`, docs/deploy.md)."""

from __future__ import annotations

import argparse

from opweave.cli.common import tcp_port

EXAMPLES = (
    "opweave launch-files art/ --kind torchrun --weights /shared/ckpt --prompts prompts.jsonl",
    "opweave launch-files art/ --kind k8s --weights /models/ckpt --serve --image registry/opweave:1 --pvc models",
)


def args_launch_files(p: argparse.ArgumentParser) -> None:
    from opweave.runtime.launchfiles import LAUNCH_KINDS, RENDEZVOUS_PORT, SERVE_PORT

    p.add_argument("artifact", help="folder written by opweave compile")
    p.add_argument("--kind", required=True, choices=LAUNCH_KINDS,
                   help="torchrun: a script per node; slurm: one sbatch script; k8s: a LeaderWorkerSet manifest "
                        "(required)")
    p.add_argument("--weights", required=True,
                   help="the checkpoint folder as the nodes see it, or 'random' (required)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompts", metavar="FILE.jsonl",
                      help="run this batch of prompt_ids lines, read on every node (default: none; give --prompts "
                           "or --serve)")
    what.add_argument("--serve", action="store_true",
                      help="start opweave serve on the plan's node instead of a batch (a plan on one node only)")
    p.add_argument("--out", metavar="DIR", help="where to write (default: ARTIFACT-launch, beside the artifact)")
    p.add_argument("--port", type=tcp_port, default=RENDEZVOUS_PORT,
                   help="torchrun's rendezvous port on node 0 (default %(default)s)")
    p.add_argument("--serve-port", type=tcp_port, default=SERVE_PORT,
                   help="the server's HTTP port with --serve (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="tokens per prompt of the batch whose line sets none (default %(default)s)")
    p.add_argument("--image", help="k8s: the container image with OpWeave installed (default: a placeholder "
                                   "Kubernetes refuses until edited)")
    p.add_argument("--pvc", metavar="NAME", help="k8s: the PersistentVolumeClaim holding the artifact and checkpoint "
                                                 "(default: a placeholder Kubernetes refuses until edited)")
    p.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="passed to every rank's command (or the server's): a rank without progress for this long "
                        "ends the run (default %(default)g)")
    p.add_argument("--verify-key", metavar="KEY_FILE",
                   help="batch only: every rank refuses the artifact unless its signature matches the secret in "
                        "KEY_FILE, which must be on every node (default: none, no signature check)")
    p.add_argument("--iface", metavar="NAME",
                   help="batch only: the network interface gloo/NCCL use on every node (default: theirs)")


def cmd_launch_files(args: argparse.Namespace) -> int:
    from opweave.errors import OpWeaveError
    from opweave.runtime.launchfiles import write_launch_files

    extra: tuple[str, ...] = ("--stall-timeout", repr(args.stall_timeout))
    if args.serve and (args.verify_key or args.iface):
        raise OpWeaveError("--verify-key and --iface apply to a batch (--prompts), not to --serve")
    extra += ("--verify-key", args.verify_key) if args.verify_key else ()
    extra += ("--iface", args.iface) if args.iface else ()
    paths = write_launch_files(args.artifact, args.kind, weights=args.weights, prompts=args.prompts,
                               serve=args.serve, out_dir=args.out, port=args.port, serve_port=args.serve_port,
                               max_new_tokens=args.max_new_tokens, extra_args=extra, image=args.image, pvc=args.pvc)
    for path in paths:
        print(f"wrote {path}")
    return 0
