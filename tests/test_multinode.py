"""Multi-node runs: the per-node commands `opweave run --torchrun` prints quote every argument,
and a plan whose ranks span two nodes runs as two `torchrun` agents (a localhost rendezvous on
this machine standing in for two hosts) and generates transformers' greedy tokens."""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from hf_fixtures import hf_generate
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.runtime.entry import torchrun_commands
from test_runtime import compile_pinned

ODD = "odd dir; touch INJECTED $(touch INJECTED2) `touch INJECTED3` 'q'"
PROMPT, NEW_TOKENS = [5, 6, 7], 3
PLACEHOLDER = "<node-0-address>"


@pytest.fixture(scope="module")
def two_node(tiny_checkpoint, tmp_path_factory):
    """(weights, artifact, prompts): an AFD plan on h100x2+l40sx2, two H100 replicas on node 0
    and one TP-2 L40S group on node 1, every path holding shell syntax."""
    root = tmp_path_factory.mktemp("multinode") / ODD
    weights = str(root / "weights")
    shutil.copytree(tiny_checkpoint("llama", num_hidden_layers=3), weights)
    fe = run_front_end(weights)
    compiled = pinned_plan(fe, parse_cluster("h100x2+l40sx2", load_catalog()), "afd",
                           [("h100", 1, 2), ("l40s", 2, 1)], batch=4, microbatches=2, context=64)
    art = str(root / "art")
    write_artifact(art, compiled)
    prompts = root / "prompts 'x'.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": PROMPT}) + "\n")
    return weights, art, str(prompts)


def _command_lines(text):
    return [line for line in text.splitlines() if line and not line.startswith("#") and line != "wait"]


def _arguments_survive(line, weights, art, prompts):
    argv = shlex.split(line)  # as a POSIX shell splits it
    assert argv[argv.index("opweave.runtime.entry") + 1] == art
    assert argv[argv.index("--weights") + 1] == weights and argv[argv.index("--prompts") + 1] == prompts
    assert PLACEHOLDER in argv or f"MASTER_ADDR={PLACEHOLDER}" in argv  # one word, not a redirection


def test_torchrun_commands_quote_every_argument(two_node):
    weights, art, prompts = two_node
    commands = torchrun_commands(art, weights, prompts, NEW_TOKENS, port=29511)
    assert len(commands) == 2
    for i, text in enumerate(commands):
        (line,) = _command_lines(text)
        argv = shlex.split(line)
        assert argv[:9] == ["torchrun", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
                            "--master-addr", PLACEHOLDER]
        _arguments_survive(line, weights, art, prompts)


def test_per_rank_commands_quote_every_argument(tiny_checkpoint, tmp_path):
    """A plan with 1 rank on one node and 2 on the other: per-rank commands instead of torchrun."""
    weights = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path / ODD / "art")
    os.makedirs(os.path.dirname(art))
    compile_pinned(weights, "afd", art)
    prompts = str(tmp_path / ODD / "p.jsonl")
    commands = torchrun_commands(art, weights, prompts, NEW_TOKENS)
    lines = [line for text in commands for line in _command_lines(text)]
    assert len(commands) == 2 and len(lines) == 3
    for line in lines:
        _arguments_survive(line, weights, art, prompts)
        assert line.endswith(" &") and shlex.split(line)[-1] == "&"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_generate_reference_tokens(two_node, tmp_path):
    """Each printed command, run by a shell with the first node's address filled in (and
    `torchrun` spelled `python -m torch.distributed.run`, the same program), as two nodes."""
    weights, art, prompts = two_node
    commands = torchrun_commands(art, weights, prompts, NEW_TOKENS, port=_free_port())
    runner = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    try:
        for text in commands:
            (line,) = _command_lines(text)
            assert line.startswith("torchrun ")
            line = runner + line[len("torchrun"):].replace(PLACEHOLDER, "127.0.0.1")
            agents.append(subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, start_new_session=True))
        results = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:  # each agent leads its own session: end it and its workers on any failure
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], [err[-2000:] for _, err in results]
    outputs = [json.loads(line) for line in results[0][0].splitlines() if line.startswith('{"outputs"')]
    assert len(outputs) == 1 and not any('{"outputs"' in out for out, _ in results[1:])
    assert outputs[0]["outputs"][0]["token_ids"] == hf_generate(weights, PROMPT, NEW_TOKENS)[1]
    found = [f for d in (tmp_path, os.path.dirname(art)) for f in os.listdir(d) if f.startswith("INJECTED")]
    assert found == []
