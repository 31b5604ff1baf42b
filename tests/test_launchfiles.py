"""Launch files (`opweave/runtime/launchfiles.py`): the torchrun scripts, the Slurm batch script and
the LeaderWorkerSet manifest of a plan spanning two nodes hold its node count, ranks per node and
GPUs; each kind, run on this machine as two "nodes" (a stand-in Python that records its command
line, then the real ranks), starts exactly the ranks the plan has and generates `opweave run`'s
tokens. Every path holds shell syntax: it must stay one argument and run nothing."""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys

import pytest
import yaml

from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.runtime.launchfiles import LAUNCH_KINDS, NODE0_PLACEHOLDER, launch_plan, write_launch_files
from test_runtime import compile_pinned

ODD = "odd dir; touch INJECTED $(touch INJECTED2) `touch INJECTED3` 'q'"
PROMPTS = [[5, 6, 7], [9, 8, 7, 6]]
NEW_TOKENS = 3

# Stand-ins for what a cluster provides: a Python that records how it was called, Slurm's srun
# (the command once per node, SLURM_NODEID set, all at once) and scontrol, and a `sleep` that
# returns (a k8s pod idles after its run).
FAKE_PYTHON = """#!{python}
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}}}}) + "\\n")
"""
FAKE_SRUN = """#!/usr/bin/env bash
nodes=1
while [[ $1 != bash ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@" & pids+=("$!"); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = "#!/usr/bin/env bash\necho 127.0.0.1\ncommand -p sleep 0.1\necho 127.0.0.2\n"  # two writes, apart
FAKE_SLEEP = "#!/usr/bin/env bash\nexit 0\n"


def _tiny_weights(tiny_checkpoint, root):
    weights = os.path.join(root, "weights")
    shutil.copytree(tiny_checkpoint("llama", num_hidden_layers=3), weights)
    return weights


def _prompts(root):
    path = os.path.join(root, "prompts 'x'.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS)
    return path


@pytest.fixture(scope="module")
def two_node(tiny_checkpoint, tmp_path_factory):
    """(weights, artifact, prompts): an AFD plan on h100x2+l40sx2, two H100 replicas on node 0
    and one TP-2 L40S group on node 1 (2 ranks on each node)."""
    root = str(tmp_path_factory.mktemp("launch") / ODD)
    os.makedirs(root)
    weights = _tiny_weights(tiny_checkpoint, root)
    compiled = pinned_plan(run_front_end(weights), parse_cluster("h100x2+l40sx2", load_catalog()), "afd",
                           [("h100", 1, 2), ("l40s", 2, 1)], batch=4, microbatches=2, context=64)
    art = os.path.join(root, "art")
    write_artifact(art, compiled)
    return weights, art, _prompts(root)


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    """A folder of stand-ins (`python`, `srun`, `scontrol`, `sleep`) to put first on PATH."""
    folder = tmp_path_factory.mktemp("fakes")
    for name, text in (("python", FAKE_PYTHON.format(python=sys.executable)), ("srun", FAKE_SRUN),
                       ("scontrol", FAKE_SCONTROL), ("sleep", FAKE_SLEEP)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return str(folder)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _manifest(path):
    with open(path) as f:
        docs = list(yaml.safe_load_all(f))
    return {d["kind"]: d for d in docs}


def _pod(lws, role):
    template = lws["spec"]["leaderWorkerTemplate"][f"{role}Template"]
    (container,) = template["spec"]["containers"]
    return template["spec"], container


def _start_nodes(kind, files, tmp_path, env):
    """Starts the files of `kind` as two nodes on this machine: (processes, scripts) after each
    started; every process leads its own session, so it and its ranks can be killed as one."""
    start = {"start_new_session": True, "cwd": tmp_path, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
             "text": True}
    if kind == "torchrun":
        return [subprocess.Popen(["bash", f], env=env, **start) for f in files]
    if kind == "slurm":
        (sbatch,) = files
        return [subprocess.Popen(["bash", sbatch], env={**env, "SLURM_JOB_NODELIST": "node[1-2]"}, **start)]
    docs = _manifest(files[0])
    script = tmp_path / "node.sh"
    script.write_text(docs["ConfigMap"]["data"]["node.sh"])
    pod_env = {e["name"]: e["value"] for e in _pod(docs["LeaderWorkerSet"], "leader")[1]["env"] if "value" in e}
    pod_env.update({k: env[k] for k in ("ARTIFACT", "WEIGHTS", "PROMPTS", "PYTHON") if k in env})
    return [subprocess.Popen(["bash", str(script)], **start, env={
        **env, **pod_env, "MASTER_PORT": env["MASTER_PORT"], "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LWS_WORKER_INDEX": str(i)}) for i in range(2)]


def _finish(procs, timeout):
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # on any failure: each process and its ranks
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), [err[-2000:] for _, err in results]
    return results


def _env(fakes, art, weights, prompts, python):
    """What the scripts read: the stand-ins first on PATH, and every variable a user would set.
    The k8s pod's paths (/opweave/...) are replaced by this machine's."""
    return {**os.environ, "PATH": fakes + os.pathsep + os.environ["PATH"], "PYTHON": python,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
            "ARTIFACT": art, "WEIGHTS": weights, "PROMPTS": prompts}


def test_the_files_hold_the_plans_nodes(two_node, tmp_path):
    weights, art, prompts = two_node
    lp = launch_plan(art)
    assert [n.ranks for n in lp.nodes] == [(0, 1), (2, 3)] and [n.gpu for n in lp.nodes] == ["h100", "l40s"]
    out = str(tmp_path / "launch")
    written = {k: write_launch_files(art, k, weights=weights, prompts=prompts, out_dir=out) for k in LAUNCH_KINDS}
    assert [os.path.basename(p) for p in written["torchrun"]] == ["node_00.sh", "node_01.sh"]
    for i, path in enumerate(written["torchrun"]):
        text = open(path).read()
        assert os.stat(path).st_mode & stat.S_IXUSR and text.startswith("#!/usr/bin/env bash\n# Generated by OpWeave")
        assert "set -euo pipefail" in text and f"\nNODE={i}\n" in text and '--node-rank "$NODE"' in text
        assert "--nnodes 2" in text and "--nproc-per-node 2" in text and "-m opweave.runtime.entry" in text
        assert json.dumps(art) in text and "cluster \"h100x2+l40sx2\"" in text and "plan.json sha256" in text
    (sbatch,) = written["slurm"]
    text = open(sbatch).read()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)'):
        assert line in text.splitlines() or line + "  # node 0" in text.splitlines()
    assert "NODE=$SLURM_NODEID" in text and text.count("srun ") == 1 and "# Generated by OpWeave" in text
    for path in written["torchrun"] + written["slurm"]:
        subprocess.run(["bash", "-n", path], check=True)
    (manifest,) = written["k8s"]
    assert open(manifest).read().startswith("# Generated by OpWeave")
    docs = _manifest(manifest)
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for role in ("leader", "worker"):
        spec, container = _pod(lws, role)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert container["command"] == ["bash", "/opweave/launch/node.sh"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "<pvc-with-artifact-and-weights>"
        assert volumes["launch"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/opweave/artifact"]["subPath"] == "art" and mounts["/opweave/weights"]["subPath"] == "weights"
        assert "ports" not in container  # a batch: nothing to serve
    data = docs["ConfigMap"]["data"]
    assert data["prompts.jsonl"] == open(prompts).read() and "$LWS_LEADER_ADDRESS" in data["node.sh"]
    subprocess.run(["bash", "-n"], input=data["node.sh"], text=True, check=True)
    assert "Service" not in docs


def test_an_unset_node_address_is_refused_before_anything_runs(two_node, tmp_path, fakes):
    weights, art, prompts = two_node
    node0 = write_launch_files(art, "torchrun", weights=weights, prompts=prompts, out_dir=str(tmp_path))[0]
    env = {k: v for k, v in _env(fakes, art, weights, prompts, "python").items() if k != "MASTER_ADDR"}
    env["FAKE_LOG"] = str(tmp_path / "log")
    done = subprocess.run(["bash", node0], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "set MASTER_ADDR" in done.stderr and not os.path.exists(env["FAKE_LOG"])
    assert NODE0_PLACEHOLDER in open(node0).read()


@pytest.mark.parametrize("kind", LAUNCH_KINDS)
def test_each_kind_starts_the_plans_torchrun_on_each_node(two_node, tmp_path, fakes, kind):
    """With the stand-in Python: each node's exact command line, every path one argument."""
    weights, art, prompts = two_node
    files = write_launch_files(art, kind, weights=weights, prompts=prompts, out_dir=str(tmp_path / "launch"),
                               max_new_tokens=NEW_TOKENS, extra_args=("--stall-timeout", "60"))
    env = {**_env(fakes, art, weights, prompts, "python"), "FAKE_LOG": str(tmp_path / "log")}
    env.pop("ARTIFACT"), env.pop("WEIGHTS"), env.pop("PROMPTS")  # the files' own defaults ...
    if kind == "k8s":  # ... but a pod's are mount points
        env.update(ARTIFACT=art, WEIGHTS=weights, PROMPTS=prompts)
    _finish(_start_nodes(kind, files, tmp_path, env), timeout=60)
    calls = sorted((json.loads(line) for line in open(env["FAKE_LOG"])), key=lambda c: c["argv"])
    assert [c["argv"][c["argv"].index("--node-rank") + 1] for c in calls] == ["0", "1"]
    for call in calls:
        argv = call["argv"]
        assert argv[:2] == ["-m", "torch.distributed.run"] and argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--nproc-per-node") + 1] == "2"
        assert argv[argv.index("--master-addr") + 1] == "127.0.0.1"
        assert argv[argv.index("--master-port") + 1] == env["MASTER_PORT"]
        assert argv[argv.index("opweave.runtime.entry") + 1:] == [
            art, "--weights", weights, "--prompts", prompts, "--max-new-tokens", str(NEW_TOKENS),
            "--stall-timeout", "60"]
    found = [f for d in (tmp_path, os.path.dirname(art)) for f in os.listdir(d) if f.startswith("INJECTED")]
    assert found == []


def test_unequal_nodes_start_each_rank_by_hand(tiny_checkpoint, tmp_path, fakes):
    """A plan of 1 rank on one node and 2 on the other: torchrun cannot number it, so each node
    starts its ranks with RANK / LOCAL_RANK / WORLD_SIZE (in every kind)."""
    weights = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path / "art")
    compile_pinned(weights, "afd", art)
    assert [len(n.ranks) for n in launch_plan(art).nodes] == [1, 2]
    prompts = _prompts(str(tmp_path))
    for kind in LAUNCH_KINDS:
        log = tmp_path / f"{kind}.log"
        files = write_launch_files(art, kind, weights=weights, prompts=prompts, out_dir=str(tmp_path / kind))
        env = {**_env(fakes, art, weights, prompts, "python"), "FAKE_LOG": str(log)}
        _finish(_start_nodes(kind, files, tmp_path, env), timeout=60)
        ranks = sorted((c["env"]["RANK"], c["env"]["LOCAL_RANK"], c["env"]["WORLD_SIZE"], c["argv"][:2])
                       for c in map(json.loads, open(log)))
        entry = ["-m", "opweave.runtime.entry"]
        assert ranks == [("0", "0", "3", entry), ("1", "0", "3", entry), ("2", "1", "3", entry)], kind
    assert "#SBATCH --gpus-per-node=2" in open(tmp_path / "slurm" / "opweave.sbatch").read()
    lws = _manifest(tmp_path / "k8s" / "opweave-lws.yaml")["LeaderWorkerSet"]
    assert [_pod(lws, r)[1]["resources"]["limits"]["nvidia.com/gpu"] for r in ("leader", "worker")] == [1, 2]


def test_a_one_node_plan_is_served(tiny_checkpoint, tmp_path, fakes):
    weights = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path / "art")
    write_artifact(art, pinned_plan(run_front_end(weights), parse_cluster("h100x2", load_catalog()), "colocated",
                                    [("h100", 2, 1)], batch=4, microbatches=1, context=64))
    written = {k: write_launch_files(art, k, weights=weights, serve=True, serve_port=8123, image="reg/opweave:1",
                                     pvc="models", out_dir=str(tmp_path / "launch")) for k in LAUNCH_KINDS}
    docs = _manifest(written["k8s"][0])
    lws = docs["LeaderWorkerSet"]
    spec, leader = _pod(lws, "leader")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1 and leader["image"] == "reg/opweave:1"
    assert leader["ports"] == [{"name": "http", "containerPort": 8123}]
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8123}
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {v["name"]: v for v in spec["volumes"]}["data"]["persistentVolumeClaim"]["claimName"] == "models"
    assert docs["Service"]["spec"]["ports"][0]["port"] == 8123 and "prompts.jsonl" not in docs["ConfigMap"]["data"]
    assert "#SBATCH --nodes=1" in open(written["slurm"][0]).read()
    env = {**_env(fakes, art, weights, "", "python"), "FAKE_LOG": str(tmp_path / "log")}
    env.pop("ARTIFACT"), env.pop("WEIGHTS")
    _finish(_start_nodes("torchrun", written["torchrun"], tmp_path, env), timeout=60)
    (call,) = map(json.loads, open(env["FAKE_LOG"]))
    assert call["argv"] == ["-m", "opweave", "serve", art, "--weights", weights, "--device", "cuda",
                            "--host", "0.0.0.0", "--port", "8123"]


def test_what_cannot_be_launched_is_refused(two_node, tmp_path):
    weights, art, prompts = two_node
    cases = [(dict(kind="mpi"), "kind must be one of torchrun, slurm, k8s"),
             (dict(kind="torchrun", prompts=None), "a batch run needs prompts"),
             (dict(kind="k8s", serve=True), "span 2 nodes and opweave serve runs a plan on one node"),
             (dict(kind="slurm", port=70000), "port must be 1..65535"),
             (dict(kind="slurm", max_new_tokens=0), "max_new_tokens must be a whole number"),
             (dict(kind="torchrun", out_dir=os.path.join(art, "launch")), "is inside the artifact")]
    for given, message in cases:
        kwargs = {"weights": weights, "prompts": prompts, "out_dir": str(tmp_path), **given}
        with pytest.raises(OpWeaveError, match=message.replace("(", r"\(")):
            write_launch_files(art, kwargs.pop("kind"), **kwargs)
    assert not os.path.exists(os.path.join(art, "launch")) and os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def reference_run(two_node):
    """`opweave run`'s token ids for the prompts (its own local launcher)."""
    weights, art, prompts = two_node
    done = subprocess.run([sys.executable, "-m", "opweave", "run", art, "--weights", weights, "--prompts", prompts,
                           "--max-new-tokens", str(NEW_TOKENS), "--json"], capture_output=True, text=True,
                          timeout=300, check=True)
    return [o["token_ids"] for o in json.loads(done.stdout)["outputs"]]


@pytest.mark.slow
@pytest.mark.parametrize("kind", LAUNCH_KINDS)
def test_two_local_nodes_generate_opweave_runs_tokens(two_node, reference_run, tmp_path, fakes, kind):
    """The files as written, run for real as two nodes on this machine (localhost rendezvous)."""
    weights, art, prompts = two_node
    files = write_launch_files(art, kind, weights=weights, prompts=prompts, out_dir=str(tmp_path / "launch"),
                               max_new_tokens=NEW_TOKENS)
    env = _env(fakes, art, weights, prompts, sys.executable)
    if kind != "k8s":
        env.pop("ARTIFACT"), env.pop("WEIGHTS"), env.pop("PROMPTS")
    results = _finish(_start_nodes(kind, files, tmp_path, env), timeout=240)
    outputs = [json.loads(line) for out, _ in results for line in out.splitlines() if line.startswith('{"outputs"')]
    assert len(outputs) == 1, [err[-2000:] for _, err in results]
    assert [o["token_ids"] for o in outputs[0]["outputs"]] == reference_run
    assert [len(t) for t in reference_run] == [NEW_TOKENS] * len(PROMPTS)
    found = [f for d in (tmp_path, os.path.dirname(art)) for f in os.listdir(d) if f.startswith("INJECTED")]
    assert found == []


def test_the_cli_writes_and_refuses_in_one_line(two_node, tmp_path, capsys):
    """`opweave launch-files`: the paths written, one per line; bad combinations exit 2 in one line."""
    from opweave.cli import main

    weights, art, prompts = two_node
    out = str(tmp_path / "slurm")
    assert main(["launch-files", art, "--kind", "slurm", "--weights", weights, "--prompts", prompts,
                 "--out", out, "--iface", "lo"]) == 0
    written = capsys.readouterr().out.split()
    assert written == ["wrote", os.path.join(out, "opweave.sbatch")]
    assert "--iface lo" in open(os.path.join(out, "opweave.sbatch")).read()
    for argv, message in ((["--kind", "k8s", "--serve"], "span 2 nodes"),
                          (["--kind", "torchrun", "--serve", "--iface", "lo"], "apply to a batch"),
                          (["--kind", "torchrun"], "one of the arguments --prompts --serve is required")):
        assert main(["launch-files", art, "--weights", weights, "--out", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "x")
