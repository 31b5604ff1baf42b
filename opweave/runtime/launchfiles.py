"""Launch files for a compiled artifact: what each node of a multi-node deployment runs.

    write_launch_files(ART, kind, weights=..., prompts=...)   the files of one kind; their paths
    launch_plan(ART)                                           the plan's nodes and their ranks

`opweave run ART --torchrun` prints one command per node; these are the same commands as files a
cluster can run: `torchrun` (one `node_NN.sh` per node), `slurm` (one `opweave.sbatch`) and
`k8s` (one `opweave-lws.yaml`: a LeaderWorkerSet, one pod per node).

Every kind runs the same shell body on node $NODE (`_node_body`): when the plan's ranks fill its
nodes evenly and in order, one `torchrun` per node (torchrun's static rendezvous numbers the ranks
node by node, as the plan does); otherwise each of the node's ranks started by hand with RANK,
LOCAL_RANK and WORLD_SIZE, as `entry.torchrun_commands` does. The ranks run
`python -m opweave.runtime.entry` (`opweave run`'s batch; rank 0, on node 0, prints
`{"outputs": [...]}`). With `serve=True` a plan whose ranks sit on one node runs `opweave serve`
there instead (the server starts its ranks itself): a server whose ranks span nodes does not
exist yet, so a multi-node plan is refused for serving.

The body names only shell variables (ARTIFACT, WEIGHTS, PROMPTS, PYTHON, MASTER_ADDR, MASTER_PORT,
NODE, ...) and numbers: the paths given appear once, shell-quoted, where the variables are set,
where the environment can override them, so no path is ever parsed as shell syntax.

The files go to a folder beside the artifact (default `ART-launch/`), never inside it: an
artifact's manifest lists every file it holds, and `compile -o ART` replaces only a folder that
holds nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex

from opweave import __version__
from opweave.errors import OpWeaveError

LAUNCH_KINDS = ("torchrun", "slurm", "k8s")
RENDEZVOUS_PORT = 29500           # torchrun's default --master-port
SERVE_PORT = 8000                 # opweave serve's default --port
NODE0_PLACEHOLDER = "<node-0-address>"
POD_ROOT = "/opweave"             # where the k8s pods mount the launch files, artifact and weights
MAX_CONFIGMAP_BYTES = 900_000     # a ConfigMap holds at most 1 MiB; the script and YAML need the rest
LWS_NAME = "opweave"              # the LeaderWorkerSet, its ConfigMap ("-launch") and Service


@dataclasses.dataclass(frozen=True)
class LaunchNode:
    """One node of the launch: node 0 holds rank 0 (which prints the outputs) and the rendezvous."""

    index: int                 # node rank in the launch (torchrun's --node-rank)
    cluster_node: int          # the node's index in the plan's cluster
    gpu: str                   # its GPU type
    ranks: tuple[int, ...]     # global ranks it runs, in order; LOCAL_RANK is the position here


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What the launch files need of an artifact's plan (replica set 0, as the runtime deploys)."""

    artifact: str              # absolute path
    model: str
    cluster: str
    template: str
    plan_hash: str             # the manifest's sha256 of plan.json
    compiled_by: str           # the OpWeave version that compiled the artifact
    nodes: tuple[LaunchNode, ...]

    @property
    def world(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    @property
    def per_node(self) -> int:
        """Ranks of the fullest node: the GPUs a node of the launch must have."""
        return max(len(n.ranks) for n in self.nodes)

    @property
    def torchrun(self) -> bool:
        """Whether one torchrun per node numbers the ranks as the plan does: every node runs the
        same number of ranks, node i ranks [i*k, (i+1)*k)."""
        k = len(self.nodes[0].ranks)
        return all(n.ranks == tuple(range(i * k, (i + 1) * k)) for i, n in enumerate(self.nodes))

    @property
    def mixed_gpus(self) -> bool:
        return len({n.gpu for n in self.nodes}) > 1


def launch_plan(artifact: str) -> LaunchPlan:
    """The nodes of `artifact`'s plan, in the order of their first rank (so rank 0 is on node 0),
    read from plan.json checked against the manifest. Rank r is the r-th GPU of the plan's owners,
    replicas and TP groups in order, as `lower` numbers them."""
    from opweave.artifact import load_artifact
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.ir.plan import plan_from_json

    art = load_artifact(artifact, ["plan.json"])
    plan = plan_from_json(art.json("plan.json"))
    cluster = parse_cluster(plan.cluster, load_catalog())
    gpus = [cluster.locate(g) for o in plan.owners for replica in o.gpus for g in replica]
    order = list(dict.fromkeys(g.node_index for g in gpus))
    nodes = tuple(LaunchNode(index=i, cluster_node=n, gpu=next(g.gpu_name for g in gpus if g.node_index == n),
                             ranks=tuple(r for r, g in enumerate(gpus) if g.node_index == n))
                  for i, n in enumerate(order))
    return LaunchPlan(artifact=os.path.abspath(artifact), model=plan.model, cluster=plan.cluster,
                      template=plan.template, plan_hash=art.manifest.get("plan_hash", "?"),
                      compiled_by=art.manifest.get("opweave_version", "?"), nodes=nodes)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the nodes run, as given to `write_launch_files`."""

    weights: str
    prompts: str | None
    serve: bool
    port: int
    serve_port: int
    max_new_tokens: int
    extra: tuple[str, ...]


def write_launch_files(artifact_dir: str, kind: str, *, weights: str, prompts: str | None = None,
                       serve: bool = False, out_dir: str | None = None, port: int = RENDEZVOUS_PORT,
                       serve_port: int = SERVE_PORT, max_new_tokens: int = 16, extra_args=(),
                       image: str | None = None, pvc: str | None = None) -> list[str]:
    """Writes the launch files of `kind` (one of LAUNCH_KINDS) for the artifact's plan and returns
    their paths.

    Args:
        artifact_dir: a folder written by `opweave compile`.
        kind: "torchrun" (`node_NN.sh` per node), "slurm" (`opweave.sbatch`) or "k8s"
            (`opweave-lws.yaml`).
        weights: the checkpoint folder (or "random"), as the nodes see it (a default they may override).
        prompts: a JSON Lines file of `prompt_ids` lines, read on every node: needed unless `serve`
            (the k8s manifest carries its content in a ConfigMap).
        serve: run `opweave serve` on the plan's one node instead of a batch (refused when the
            plan's ranks span nodes).
        out_dir: where to write (made if missing; default `ARTIFACT-launch`, beside the artifact).
        port: torchrun's rendezvous port on node 0. serve_port: the server's HTTP port.
        max_new_tokens: the batch's default per prompt (a line's own `max_new_tokens` wins).
        extra_args: appended to every rank's (or the server's) command, e.g. ("--stall-timeout",
            "300", "--iface", "ib0").
        image, pvc: for k8s, the container image and the PersistentVolumeClaim holding the artifact
            and checkpoint folders (placeholders that fail validation when not given).
    Raises:
        OpWeaveError: an unknown kind, a batch without prompts, serving a multi-node plan, a
            port out of range, an output folder inside the artifact.
    """
    if kind not in LAUNCH_KINDS:
        raise OpWeaveError(f"launch files: kind must be one of {', '.join(LAUNCH_KINDS)}, got {kind!r}")
    for name, value in (("port", port), ("serve_port", serve_port)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
            raise OpWeaveError(f"launch files: {name} must be 1..65535, got {value!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OpWeaveError(f"launch files: max_new_tokens must be a whole number, at least 1, got {max_new_tokens!r}")
    lp = launch_plan(artifact_dir)
    if serve and len(lp.nodes) > 1:
        raise OpWeaveError(f"launch files: this plan's ranks span {len(lp.nodes)} nodes and opweave serve runs "
                           "a plan on one node (a server across nodes does not exist yet); write them without "
                           "serving for opweave run's batch on every node")
    if not serve and not prompts:
        raise OpWeaveError("launch files: a batch run needs prompts (a JSON Lines file every node reads), "
                           "or serve the plan")
    run = _Run(weights=weights if weights == "random" else os.path.abspath(weights),
               prompts=os.path.abspath(prompts) if prompts else None, serve=serve, port=port,
               serve_port=serve_port, max_new_tokens=max_new_tokens, extra=tuple(map(str, extra_args)))
    out = os.path.abspath(out_dir or lp.artifact.rstrip(os.sep) + "-launch")
    if os.path.commonpath([os.path.realpath(out), os.path.realpath(lp.artifact)]) == os.path.realpath(lp.artifact):
        raise OpWeaveError(f"launch files: {out} is inside the artifact {lp.artifact}; write them beside it")
    if kind == "torchrun":
        files = {f"node_{n.index:02d}.sh": _node_script(lp, run, n) for n in lp.nodes}
    elif kind == "slurm":
        files = {"opweave.sbatch": _sbatch(lp, run)}
    else:
        files = {"opweave-lws.yaml": _lws_manifest(lp, run, image, pvc)}
    return _write(out, files, executable=kind != "k8s")


def _write(folder: str, files: dict[str, str], executable: bool) -> list[str]:
    """Writes each file whole (a temporary file renamed), executable for scripts."""
    from opweave.outputs import atomic_file

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OpWeaveError(f"launch files: cannot make {folder} ({e.strerror})") from None
    paths = []
    for name, text in files.items():
        path = os.path.join(folder, name)
        with atomic_file(path, flag="launch files:") as f:
            f.write(text)
        if executable:  # executable by whoever may read it
            mode = os.stat(path).st_mode
            os.chmod(path, mode | (mode & 0o444) >> 2)
        paths.append(path)
    return paths


# --- what a node runs ---------------------------------------------------------------------------

def _node_body(lp: LaunchPlan, run: _Run, last: bool = True) -> list[str]:
    """The shell lines node $NODE runs, naming only variables and numbers. `last`: nothing follows,
    so a single command replaces the shell (`exec`: signals reach it directly)."""
    exec_ = "exec " if last else ""
    tail = "".join(" " + shlex.quote(a) for a in run.extra)
    if run.serve:
        return [f'{exec_}"$PYTHON" -m opweave serve "$ARTIFACT" --weights "$WEIGHTS" --device "$DEVICE" '
                f'--host "$HOST" --port "$PORT"{tail}']
    entry = (f'-m opweave.runtime.entry "$ARTIFACT" --weights "$WEIGHTS" --prompts "$PROMPTS" '
             f'--max-new-tokens {run.max_new_tokens}{tail}')
    if lp.torchrun:
        return [f'{exec_}"$PYTHON" -m torch.distributed.run --nnodes {len(lp.nodes)} --node-rank "$NODE" '
                f'--nproc-per-node {len(lp.nodes[0].ranks)} \\',
                '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
                f"    {entry}"]
    ranks = " ".join('"' + " ".join(map(str, n.ranks)) + '"' for n in lp.nodes)
    return ["# the nodes hold unequal or interleaved ranks, which torchrun cannot number: each rank by hand",
            f"RANKS=({ranks})  # by node",
            "pids=()",
            'trap \'kill "${pids[@]}" 2>/dev/null || true\' EXIT  # one rank failing stops the others here',
            "local_rank=0",
            "for rank in ${RANKS[NODE]}; do",
            f'  RANK=$rank LOCAL_RANK=$local_rank WORLD_SIZE={lp.world} MASTER_ADDR=$MASTER_ADDR '
            'MASTER_PORT=$MASTER_PORT \\',
            f'    "$PYTHON" {entry} &',
            '  pids+=("$!")',
            "  local_rank=$((local_rank + 1))",
            "done",
            'for pid in "${pids[@]}"; do wait "$pid"; done']


def _provenance(lp: LaunchPlan) -> list[str]:
    """Comment lines naming what the file was generated from (names JSON-escaped: one line each)."""
    q = json.dumps
    return [f"Generated by OpWeave {__version__} from the plan of artifact {q(lp.artifact)}:",
            f"model {q(lp.model)}, cluster {q(lp.cluster)}, template {q(lp.template)}, "
            f"plan.json sha256 {lp.plan_hash}, compiled by OpWeave {lp.compiled_by}.",
            "Write it again after a recompile rather than editing its commands."]


def _node_lines(lp: LaunchPlan) -> list[str]:
    return [f"node {n.index}: {len(n.ranks)} x {n.gpu} (cluster node {n.cluster_node}), "
            f"rank{'s' if len(n.ranks) > 1 else ''} {' '.join(map(str, n.ranks))}" for n in lp.nodes]


def _comment(lines) -> list[str]:
    return [f"# {line}".rstrip() for line in lines]


def _variables(lp: LaunchPlan, run: _Run, rendezvous: bool) -> list[str]:
    """`NAME=${ENV:-'default'}` lines: each default shell-quoted, each overridable from the environment."""
    q = shlex.quote
    rows = []
    if rendezvous:
        rows.append(("MASTER_PORT", "MASTER_PORT", str(run.port), "a free TCP port on node 0: the rendezvous"))
    rows += [("ARTIFACT", "OPWEAVE_ARTIFACT", lp.artifact, "the artifact folder, as every node sees it"),
             ("WEIGHTS", "OPWEAVE_WEIGHTS", run.weights, "the checkpoint folder (or random)")]
    if run.serve:
        rows += [("HOST", "OPWEAVE_HOST", "0.0.0.0", "the address the server listens on"),
                 ("PORT", "OPWEAVE_PORT", str(run.serve_port), "its HTTP port"),
                 ("DEVICE", "OPWEAVE_DEVICE", "cuda", "cuda, or cpu")]
    else:
        rows.append(("PROMPTS", "OPWEAVE_PROMPTS", run.prompts, "prompt_ids lines, read on every node"))
    rows.append(("PYTHON", "PYTHON", "python3", "a Python with opweave and torch installed"))
    return [f"{name}=${{{env}:-{q(value)}}}  # {why}" for name, env, value, why in rows]


def _node_script(lp: LaunchPlan, run: _Run, node: LaunchNode) -> str:
    """`node_NN.sh`: the node's command under `set -euo pipefail`, its variables at the top."""
    name = f"node_{node.index:02d}.sh"
    multi = len(lp.nodes) > 1
    about = [f"Run on {_node_lines(lp)[node.index]}."]
    if multi:
        about.append(f"Start node_00.sh .. node_{len(lp.nodes) - 1:02d}.sh, one on each node, together "
                     "(the rendezvous waits for all); rank 0 prints {\"outputs\": [...]} on node 0.")
    lines = ["#!/usr/bin/env bash", *_comment(_provenance(lp)), "#", *_comment(about), "set -euo pipefail", "",
             "# Set these here, or in the environment:"]
    if not run.serve and multi:
        lines.append(f"MASTER_ADDR=${{MASTER_ADDR:-{shlex.quote(NODE0_PLACEHOLDER)}}}  "
                     "# node 0's address, reachable from every node")
    elif not run.serve:
        lines.append("MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}  # one node: the rendezvous is local")
    lines += _variables(lp, run, rendezvous=not run.serve)
    lines += [f"NODE={node.index}", ""]
    if not run.serve and multi:
        lines += [f"if [[ $MASTER_ADDR == {shlex.quote(NODE0_PLACEHOLDER)} ]]; then",
                  f'  echo "{name}: set MASTER_ADDR to the address of node 0 (edit this file or export it)" >&2',
                  "  exit 2", "fi", ""]
    return "\n".join(lines + _node_body(lp, run)) + "\n"


def _sbatch(lp: LaunchPlan, run: _Run) -> str:
    """`opweave.sbatch`: one task per node; node 0's host name is the rendezvous address and each
    task's node rank is SLURM_NODEID. The node body travels to the tasks as a function
    (`declare -f`), so no quoting of it is redone."""
    n = len(lp.nodes)
    notes = ["Submit from a folder every node sees: sbatch opweave.sbatch (add --partition, --time, ...).",
             "Slurm numbers the nodes (SLURM_NODEID) in the order of their host names; what each needs:",
             *("  " + line for line in _node_lines(lp))]
    if lp.mixed_gpus:
        notes.append("The plan mixes GPU types: allocate nodes whose types follow that order "
                     "(e.g. --nodelist), or start node_NN.sh on each node by hand (kind torchrun).")
    lines = ["#!/usr/bin/env bash", *_comment(_provenance(lp)), "#", *_comment(notes),
             "#SBATCH --job-name=opweave", f"#SBATCH --nodes={n}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={lp.per_node}", "set -euo pipefail", "",
             "# Set these here, or in the environment:", *_variables(lp, run, rendezvous=not run.serve)]
    exports = "ARTIFACT WEIGHTS PYTHON " + ("HOST PORT DEVICE" if run.serve else "PROMPTS MASTER_ADDR MASTER_PORT")
    if not run.serve:
        # node 0's host name (sed reads every line: `head -n1` may end first, and pipefail fails on
        # scontrol's SIGPIPE)
        lines.append('MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # node 0')
    else:
        lines.append('echo "opweave: serving on $(hostname):$PORT" >&2')
    lines += [f"export {exports}", "", "node_main() {", *("  " + line for line in _node_body(lp, run)), "}", "",
              f"srun --nodes={n} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
              '  bash -c "set -euo pipefail; $(declare -f node_main)"\'; NODE=$SLURM_NODEID node_main\'']
    return "\n".join(lines) + "\n"


# --- Kubernetes ---------------------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z/][A-Za-z0-9_./-]*")  # a word YAML reads back as this string, unquoted
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null"}  # ... but for these (YAML 1.1)


class _Block(str):
    """A string written as a YAML literal block (`|`), for a readable script."""


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar: any text, on one line


def _yaml(value, indent: int = 0) -> list[str]:
    """YAML lines of dicts, lists and scalars (keys are ours: plain words)."""
    pad = "  " * indent
    lines = []
    if isinstance(value, dict):
        for key, v in value.items():
            if isinstance(v, _Block):
                lines += [f"{pad}{key}: |", *(f"{pad}  {line}" if line else "" for line in v.splitlines())]
            elif isinstance(v, (dict, list)) and v:
                lines += [f"{pad}{key}:", *_yaml(v, indent + 1)]
            elif isinstance(v, (dict, list)):
                lines.append(f"{pad}{key}: {'{}' if isinstance(v, dict) else '[]'}")
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
        return lines
    for item in value:
        if isinstance(item, (dict, list)):
            sub = _yaml(item, indent + 1)
            lines += [f"{pad}- {sub[0].lstrip()}", *sub[1:]]
        else:
            lines.append(f"{pad}- {_scalar(item)}")
    return lines


def _block_or_string(text: str):
    """A literal block when every line is printable (and so survives as written), else a string."""
    return _Block(text) if text.endswith("\n") and all(line.isprintable() for line in text.splitlines()) else text


def _pod(lp: LaunchPlan, run: _Run, gpus: int, leader: bool, image: str | None, pvc: str | None) -> dict:
    """A pod of the group: the launch script from the ConfigMap, the artifact and checkpoint
    folders from one PVC (subPath: their folder names), /dev/shm for the ranks, `gpus` GPUs."""
    env = {"ARTIFACT": f"{POD_ROOT}/artifact", "PYTHON": "python3",
           "WEIGHTS": "random" if run.weights == "random" else f"{POD_ROOT}/weights"}
    if run.serve:
        env.update(HOST="0.0.0.0", PORT=str(run.serve_port), DEVICE="cuda")
    else:
        env.update(PROMPTS=f"{POD_ROOT}/launch/prompts.jsonl", MASTER_PORT=str(run.port))
    container = {"name": "opweave", "image": image or "<image with opweave and CUDA torch>",
                 "command": ["bash", f"{POD_ROOT}/launch/node.sh"],
                 "env": [{"name": k, "value": v} for k, v in env.items()]}
    if run.serve:
        container["env"].append({"name": "OPWEAVE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": "opweave-api-key", "key": "key", "optional": True}}})
    container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    if run.serve and leader:
        container["ports"] = [{"name": "http", "containerPort": run.serve_port}]
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": run.serve_port},
                                       "periodSeconds": 10, "failureThreshold": 3}
    mounts = [{"name": "launch", "mountPath": f"{POD_ROOT}/launch", "readOnly": True},
              {"name": "data", "mountPath": f"{POD_ROOT}/artifact", "subPath": os.path.basename(lp.artifact),
               "readOnly": True}]
    if run.weights != "random":
        mounts.append({"name": "data", "mountPath": f"{POD_ROOT}/weights",
                       "subPath": os.path.basename(run.weights), "readOnly": True})
    container["volumeMounts"] = mounts + [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "launch", "configMap": {"name": f"{LWS_NAME}-launch"}},
               {"name": "data", "persistentVolumeClaim": {"claimName": pvc or "<pvc-with-artifact-and-weights>",
                                                          "readOnly": True}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    return {"metadata": {"labels": {"role": "leader" if leader else "worker"}},
            "spec": {"containers": [container], "volumes": volumes}}


def _lws_manifest(lp: LaunchPlan, run: _Run, image: str | None, pvc: str | None) -> str:
    """`opweave-lws.yaml`: a ConfigMap (the node script; the prompts), the LeaderWorkerSet (size =
    nodes; the leader is node 0, worker i node i) and, when serving, a Service on the leader."""
    script = ["set -euo pipefail", "# LeaderWorkerSet (v0.6+) sets these in every pod of the group",
              "MASTER_ADDR=$LWS_LEADER_ADDRESS", "NODE=$LWS_WORKER_INDEX  # 0 on the leader", ""]
    if run.serve:
        script += _node_body(lp, run)
    else:
        script += _node_body(lp, run, last=False)
        script += ["echo 'opweave: the run has ended; this pod idles so that its log stays "
                   "(kubectl delete -f opweave-lws.yaml when done)' >&2", "exec sleep infinity"]
    data = {"node.sh": _block_or_string("\n".join(script) + "\n")}
    if not run.serve:
        try:
            from opweave.datafile import read_regular

            prompts = read_regular(run.prompts, f"prompts {run.prompts}", MAX_CONFIGMAP_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise OpWeaveError(f"launch files: cannot read prompts {run.prompts} "
                               f"({getattr(e, 'strerror', None) or e})") from None
        data["prompts.jsonl"] = _block_or_string(prompts)
    leader_gpus = len(lp.nodes[0].ranks)
    worker_gpus = max((len(n.ranks) for n in lp.nodes[1:]), default=leader_gpus)
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": LWS_NAME},
           "spec": {"replicas": 1, "leaderWorkerTemplate": {
               "size": len(lp.nodes), "restartPolicy": "RecreateGroupOnPodRestart",
               "leaderTemplate": _pod(lp, run, leader_gpus, True, image, pvc),
               "workerTemplate": _pod(lp, run, worker_gpus, False, image, pvc)}}}
    folders = [lp.artifact] + ([] if run.weights == "random" else [run.weights])
    edit = (["the image (opweave and a CUDA torch)"] if image is None else []) + (
        [f"the PVC, which holds the folders {', '.join(json.dumps(os.path.basename(f)) for f in folders)} at its top"]
        if pvc is None else [])
    notes = ([f"Edit {' and '.join(edit)}."] if edit else []) + [
        "Pods in group order (the leader is node 0, worker i node i); each needs:",
        *("  " + line for line in _node_lines(lp))]
    if lp.mixed_gpus:
        notes.append("The plan mixes GPU types: add a nodeSelector for each template's GPU type "
                     "(e.g. nvidia.com/gpu.product).")
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{LWS_NAME}-launch"}, "data": data}
    docs = [_yaml(config_map), _yaml(lws)]
    if run.serve:
        docs.append(_yaml({"apiVersion": "v1", "kind": "Service", "metadata": {"name": LWS_NAME},
                           "spec": {"selector": {"leaderworkerset.sigs.k8s.io/name": LWS_NAME, "role": "leader"},
                                    "ports": [{"name": "http", "port": run.serve_port,
                                               "targetPort": run.serve_port}]}}))
    head = _comment(_provenance(lp)) + ["#"] + _comment(notes)
    return "\n".join(head + ["\n---\n".join("\n".join(d) for d in docs)]) + "\n"
