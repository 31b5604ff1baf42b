"""Faults and bad input at run time: a dead rank, a tampered artifact, bad weights, long prompts."""

import json
import multiprocessing
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_runtime import compile_pinned, requests
from opweave.cli import main
from opweave.errors import OpWeaveError
from opweave.runtime.launch import RunConfig, run
from opweave.runtime.scheduler import Request


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path_factory.mktemp("faults") / "art")
    compile_pinned(folder, "afd", art)
    return folder, art


def test_killed_rank_stops_the_run_and_names_it(setup, monkeypatch):
    folder, art = setup
    monkeypatch.setenv("OPWEAVE_FAULT_KILL", "1:2")
    # no wall-clock bound (a loaded machine is slow): the death is named, not a stall or a timeout
    with pytest.raises(OpWeaveError, match=r"^rank 1 died \(killed by signal 9\)$"):
        run(RunConfig(artifact=art, weights=folder, device="cpu", requests=requests()))
    assert multiprocessing.active_children() == []  # no process left behind: every rank was reaped


def _copy(art, tmp_path):
    import shutil

    dst = str(tmp_path / "copy")
    shutil.copytree(art, dst)
    return dst


def test_tampered_and_truncated_artifacts_are_refused(setup, tmp_path):
    folder, art = setup
    bad = _copy(art, tmp_path)
    with open(os.path.join(bad, "rank_01.py"), "a") as f:
        f.write("\n# edited\n")
    with pytest.raises(OpWeaveError, match="rank_01.py: fails its checksum"):
        run(RunConfig(artifact=bad, weights=folder, device="cpu", requests=requests()))
    with open(os.path.join(bad, "manifest.json"), "w") as f:
        f.write('{"format": "opweave-artif')
    with pytest.raises(OpWeaveError, match="manifest.json: truncated"):
        run(RunConfig(artifact=bad, weights=folder, device="cpu", requests=requests()))


def _broken_checkpoint(folder, tmp_path, edit):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_and_misshapen_weights_are_named(setup, tmp_path):
    folder, art = setup
    key = "model.layers.1.mlp.down_proj.weight"
    missing = _broken_checkpoint(folder, tmp_path / "a", lambda t: t.pop(key))
    with pytest.raises(OpWeaveError, match=f"checkpoint has no tensor '{key}'"):
        run(RunConfig(artifact=art, weights=missing, device="cpu", requests=requests()))
    wrong = _broken_checkpoint(folder, tmp_path / "b", lambda t: t.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(OpWeaveError, match=f"tensor '{key}' has shape \\(3, 3\\)"):
        run(RunConfig(artifact=art, weights=wrong, device="cpu", requests=requests()))


def test_long_prompt_is_rejected_alone(setup):
    folder, art = setup
    reqs = (Request(index=0, prompt=[1] * 100, max_new_tokens=4), Request(index=1, prompt=[5, 6, 7], max_new_tokens=4))
    out = run(RunConfig(artifact=art, weights=folder, device="cpu", requests=reqs))
    assert "does not fit the planned context of 64" in out[0].error and out[0].output == []
    assert out[1].error is None and len(out[1].output) == 4


def test_world_size_must_match_the_devices(setup, capsys):
    folder, art = setup
    assert main(["run", art, "--weights", folder, "--prompt-ids", "1,2,3", "--device", "cuda"]) == 2
    assert "the plan has 3 ranks but this machine has 0 CUDA device(s)" in capsys.readouterr().err


def test_run_cli_json_and_bad_input(setup, capsys, tmp_path):
    folder, art = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [9, 8], "max_new_tokens": 2}\n')
    assert main(["run", art, "--weights", folder, "--prompts", str(prompts), "--max-new-tokens", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [len(o["token_ids"]) for o in data["outputs"]] == [3, 2]
    assert data["outputs"][0]["prompt_ids"] == [5, 6, 7]
    prompts.write_text('{"prompt": "hello"}\n')
    assert main(["run", art, "--weights", folder, "--prompts", str(prompts)]) == 2
    assert "line 1" in capsys.readouterr().err
    assert main(["run", str(tmp_path), "--weights", folder, "--prompt-ids", "1"]) == 2
    assert "not an OpWeave artifact" in capsys.readouterr().err
    assert main(["run", art, "--weights", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err


@pytest.mark.slow
def test_per_node_commands_run_the_artifact(setup, tmp_path):
    """`opweave run --torchrun` prints per-node commands; started by hand on this machine they
    run the same program (the entry point torchrun would start)."""
    import socket
    import subprocess
    import sys

    from opweave.runtime.entry import torchrun_commands

    folder, art = setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    commands = torchrun_commands(art, folder, str(prompts), 3)
    assert commands and all("opweave.runtime.entry" in c for c in commands)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = sum(1 for n in os.listdir(art) if n.startswith("rank_") and n.endswith(".json"))
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, "-m", "opweave.runtime.entry", art, "--weights", folder,
                               "--prompts", str(prompts), "--max-new-tokens", "3"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    from hf_fixtures import hf_generate
    assert json.loads(outs[0])["outputs"][0]["token_ids"] == hf_generate(folder, [5, 6, 7], 3)[1]
