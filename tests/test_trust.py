"""Artifact trust: the runtime executes exactly the bytes it checked, and a keyed signature catches
an edit whose checksum was recomputed (which plain checksums cannot)."""

import json
import os
import shutil

import pytest

from test_runtime import compile_pinned
from opweave.errors import OpWeaveError
from opweave.artifact import (MANIFEST, SIGNATURE, load_artifact, load_program_source, read_key, read_manifest,
                              sha256_file, write_manifest)

KEY = b"k" * 32
INJECTED = "\nopen(__file__ + '.ran', 'w').close()\n"


@pytest.fixture(scope="module")
def artifact(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path_factory.mktemp("trust") / "art")
    compile_pinned(folder, "afd", art)
    return folder, art


def _copy(art, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    shutil.copytree(art, dst)
    return dst


def _sign(folder, key=KEY):
    manifest = json.load(open(os.path.join(folder, MANIFEST)))
    write_manifest(folder, manifest["model_hash"], manifest["plan_hash"], sign_key=key)


def _tamper_and_rehash(folder):
    """What an attacker with write access does: edit a module and fix its checksum."""
    path = os.path.join(folder, "rank_00.py")
    with open(path, "a") as f:
        f.write(INJECTED)
    manifest_path = os.path.join(folder, MANIFEST)
    manifest = json.load(open(manifest_path))
    manifest["files"]["rank_00.py"] = sha256_file(path)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)


def test_executes_the_checked_bytes_not_the_file_reopened(artifact, tmp_path):
    _, art = artifact
    folder = _copy(art, tmp_path)
    checked = load_artifact(folder, ["rank_00.py"])
    with open(os.path.join(folder, "rank_00.py"), "a") as f:  # swapped after the check
        f.write(INJECTED)
    module = load_program_source(checked, "rank_00.py")
    assert hasattr(module, "Program") and module.RANK == 0
    assert not os.path.exists(os.path.join(folder, "rank_00.py.ran"))


def test_signature_catches_a_rehashed_edit(artifact, tmp_path):
    _, art = artifact
    folder = _copy(art, tmp_path)
    _sign(folder)
    assert read_manifest(folder, KEY)["signed"] is True
    load_artifact(folder, verify_key=KEY)  # intact: passes
    _tamper_and_rehash(folder)
    load_artifact(folder)  # checksums alone cannot see it (documented)
    with pytest.raises(OpWeaveError, match="signature does not match"):
        load_artifact(folder, verify_key=KEY)


def test_wrong_key_and_unsigned_artifact_are_refused(artifact, tmp_path):
    _, art = artifact
    folder = _copy(art, tmp_path)
    with pytest.raises(OpWeaveError, match="not signed"):
        read_manifest(folder, KEY)
    _sign(folder)
    with pytest.raises(OpWeaveError, match="signature does not match"):
        read_manifest(folder, b"x" * 32)
    with open(os.path.join(folder, SIGNATURE), "w") as f:
        f.write("garbage")
    with pytest.raises(OpWeaveError, match="signature does not match"):
        read_manifest(folder, KEY)


def test_short_or_missing_key_files(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    with pytest.raises(OpWeaveError, match="at least 16 bytes"):
        read_key(str(short), "--verify-key")
    with pytest.raises(OpWeaveError, match="--sign-key .*: cannot read"):
        read_key(str(tmp_path / "nope"), "--sign-key")


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "a JSON list, expected an object"),
    ('{"format": "opweave-artifact/1", "files": ["rank_00.py"]}', "'files' must map"),
    ('{"format": "opweave-artifact/1", "files": {"../x": "' + "0" * 64 + '"}}', "not a plain name"),
    ('{"format": "opweave-artifact/1", "files": {"x": 3}}', "not a sha256"),
    ('{"format": "other"}', "format 'other'"),
    ("\xff\xfe", "truncated or not JSON"),
])
def test_malformed_manifests_are_one_line_errors(tmp_path, content, message):
    (tmp_path / MANIFEST).write_text(content, encoding="latin-1")
    with pytest.raises(OpWeaveError, match=message) as err:
        load_artifact(str(tmp_path))
    assert "\n" not in str(err.value)


def test_cli_signs_and_refuses_a_rehashed_edit(tiny_checkpoint, tmp_path, capsys):
    from opweave.cli import main

    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)  # a key others may read is refused
    art = str(tmp_path / "art")
    assert main(["compile", folder, "--cluster", "h100x2+l40sx2", "--tpot-slo", "50ms", "--context", "64",
                 "--max-batch", "4", "-o", art, "--sign-key", str(key), "--quiet"]) == 0
    assert os.path.isfile(os.path.join(art, SIGNATURE))
    capsys.readouterr()
    run = ["run", art, "--weights", folder, "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--json"]
    assert main(run + ["--verify-key", str(key)]) == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 2
    _tamper_and_rehash(art)
    assert main(run + ["--verify-key", str(key)]) == 2
    err = capsys.readouterr().err
    assert "signature does not match" in err and err.count("\n") == 1
    assert not any(n.endswith(".ran") for n in os.listdir(art))  # refused before any rank ran the edit


# ---------------------------------------------------------------- every reader goes through the check
def _readers(tmp_path):
    """Every reader of artifact files outside the launcher: (the file it reads, a call reading it)."""
    import torch

    from opweave.runtime.checks import artifact_model_config
    from opweave.runtime.entry import torchrun_commands
    from opweave.runtime.launch import planned_replica_sets
    from opweave.runtime.standalone import load_alone
    from opweave.runtime.timeline import write_trace
    from opweave.serve.engine import Engine

    stats = {"spans": {"0": []}, "round_s": []}
    return {
        "engine": ("rank_00.json", lambda art: Engine(art, "random")),
        "model config": ("model_config.json", artifact_model_config),
        "torchrun commands": ("plan.json", lambda art: torchrun_commands(art, "random", "p.jsonl", 2)),
        "replica sets": ("plan.json", planned_replica_sets),
        "standalone module": ("ops.json", lambda art: load_alone(os.path.join(art, "rank_00.py"), torch.device("cpu"))),
        "measured trace": ("trace.json", lambda art: write_trace(stats, str(tmp_path / "t.json"), art)),
    }


@pytest.mark.parametrize("reader", ["engine", "model config", "torchrun commands", "replica sets",
                                    "standalone module", "measured trace"])
def test_every_reader_refuses_a_file_that_fails_its_checksum(artifact, tmp_path, reader):
    _, art = artifact
    folder = _copy(art, tmp_path)
    name, read = _readers(tmp_path)[reader]
    read(folder)  # intact: reads
    with open(os.path.join(folder, name), "a") as f:
        f.write(" ")  # still the same JSON, no longer the checked bytes
    with pytest.raises(OpWeaveError, match=f"{name}: fails its checksum") as err:
        read(folder)
    assert "\n" not in str(err.value)


def _plan_only(folder, text):
    os.makedirs(folder)
    with open(os.path.join(folder, "plan.json"), "w") as f:
        f.write(text)
    write_manifest(folder, "m", "p")


@pytest.mark.parametrize("text, message", [
    ("{not json", "plan.json: not JSON"),
    ("[2]", "'replica_sets' must be a whole number of at least 1, got None"),
    ('{"tpot_ms": 5}', "'replica_sets' must be a whole number of at least 1, got None"),
    ('{"replica_sets": "2"}', "got '2'"),
    ('{"replica_sets": 0}', "got 0"),
])
def test_replica_sets_all_fails_loudly_on_a_damaged_plan(tmp_path, capsys, text, message):
    """`--replica-sets all` counts the plan's sets from plan.json, checked against the manifest: a
    damaged one is a one-line error naming it, never one set served quietly."""
    from opweave.cli import main
    from opweave.runtime.launch import planned_replica_sets

    folder = str(tmp_path / "art")
    _plan_only(folder, text)
    with pytest.raises(OpWeaveError, match=message) as err:
        planned_replica_sets(folder)
    assert os.path.join(folder, "plan.json") in str(err.value) and "\n" not in str(err.value)
    assert main(["run", folder, "--weights", "random", "--prompt-ids", "1,2", "--replica-sets", "all"]) == 2
    out = capsys.readouterr().err
    assert "plan.json" in out and out.count("\n") == 1


def test_replica_sets_all_refuses_an_edited_or_missing_plan(tmp_path):
    from opweave.runtime.launch import planned_replica_sets

    folder = str(tmp_path / "art")
    _plan_only(folder, '{"replica_sets": 3}')
    assert planned_replica_sets(folder) == 3
    with open(os.path.join(folder, "plan.json"), "w") as f:
        f.write('{"replica_sets": 4}')
    with pytest.raises(OpWeaveError, match="plan.json: fails its checksum"):
        planned_replica_sets(folder)
    os.remove(os.path.join(folder, "plan.json"))
    with pytest.raises(OpWeaveError, match="plan.json: missing from the artifact"):
        planned_replica_sets(folder)
    write_manifest(folder, "m", "p")  # a manifest that does not list it
    with pytest.raises(OpWeaveError, match="plan.json: not listed in the manifest"):
        planned_replica_sets(folder)
