"""Bad input refused before any rank starts, by name: weight files (FIFOs, shard indexes, files that
are not safetensors, integer weights), the checkpoint's config against the artifact's, prompt files
and ids, contexts beyond the model's trained positions, damaged artifact files for `dump`, profile
grids too large for memory; and non-finite logits reported per request."""

import contextlib
import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_runtime import compile_pinned
from opweave.cli import main
from opweave.errors import OpWeaveError
from opweave.models.checkpoint import INDEX_FILE, CheckpointReader
from opweave.runtime.launch import RunConfig, read_requests, run
from opweave.runtime.scheduler import Request, Scheduler

LAYERS = 3
FFN_KEY = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS)
    art = str(tmp_path_factory.mktemp("inputs") / "art")
    compile_pinned(folder, "afd", art)
    return folder, art


@contextlib.contextmanager
def within(seconds: int):
    """Fails the test instead of hanging it (a FIFO opened for reading blocks forever)."""
    def expire(*_):
        raise AssertionError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _copy(folder, dst, edit=None):
    shutil.copytree(folder, dst)
    if edit is not None:
        tensors = load_file(os.path.join(dst, "model.safetensors"))
        edit(tensors)
        save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def _prelaunch_error(art, weights, requests=None) -> str:
    """The message of a run refused before its ranks start (a rank's would say "rank N failed")."""
    reqs = requests or (Request(index=0, prompt=[5, 6, 7], max_new_tokens=2),)
    with within(30), pytest.raises(OpWeaveError) as info:
        run(RunConfig(artifact=art, weights=weights, device="cpu", requests=reqs))
    message = str(info.value)
    assert "failed" not in message and "\n" not in message, message
    return message


# ---------------------------------------------------------------- weight files


def test_fifo_among_the_weights_is_refused_by_name(setup, tmp_path):
    folder, art = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    os.remove(os.path.join(ckpt, "model.safetensors"))
    os.mkfifo(os.path.join(ckpt, "model.safetensors"))
    with within(10), pytest.raises(OpWeaveError, match="model.safetensors: the weights file is a FIFO"):
        CheckpointReader(ckpt)
    assert "model.safetensors: the weights file is a FIFO" in _prelaunch_error(art, ckpt)


def test_fifo_shard_named_by_the_index_is_refused(setup, tmp_path):
    folder, _ = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    keys = list(load_file(os.path.join(ckpt, "model.safetensors")))
    os.mkfifo(os.path.join(ckpt, "model-00002.safetensors"))
    with open(os.path.join(ckpt, INDEX_FILE), "w") as f:
        json.dump({"weight_map": {**{k: "model.safetensors" for k in keys}, "extra": "model-00002.safetensors"}}, f)
    with within(10), pytest.raises(OpWeaveError, match="model-00002.safetensors: the weights file listed in .* is a FIFO"):
        CheckpointReader(ckpt)


@pytest.mark.parametrize("index,message", [
    ('{"weight_map": {"a": "model.safeten', "shard index is not valid JSON"),
    ("[1, 2]", "no 'weight_map' object"),
    ('{"metadata": {}}', "no 'weight_map' object"),
    ('{"weight_map": {"a": "model-00009.safetensors"}}', "lists model-00009.safetensors, which is not in the"),
    ('{"weight_map": {"a": "../elsewhere.safetensors"}}', "not a file name in the checkpoint folder"),
])
def test_bad_shard_index_is_named(setup, tmp_path, index, message):
    folder, _ = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    with open(os.path.join(ckpt, INDEX_FILE), "w") as f:
        f.write(index)
    with pytest.raises(OpWeaveError) as info:
        CheckpointReader(ckpt)
    assert str(info.value).startswith(os.path.join(ckpt, INDEX_FILE) + ":") and message in str(info.value)


def test_index_naming_a_file_without_the_tensor(setup, tmp_path):
    folder, _ = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    keys = list(load_file(os.path.join(ckpt, "model.safetensors")))
    save_file({"other": torch.zeros(2)}, os.path.join(ckpt, "other.safetensors"))
    with open(os.path.join(ckpt, INDEX_FILE), "w") as f:
        json.dump({"weight_map": {**{k: "model.safetensors" for k in keys}, FFN_KEY: "other.safetensors"}}, f)
    with pytest.raises(OpWeaveError, match=f"other.safetensors: has no tensor '{FFN_KEY}'"):
        CheckpointReader(ckpt).get(FFN_KEY)


def test_file_that_is_not_safetensors_is_named(setup, tmp_path):
    folder, art = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    with open(os.path.join(ckpt, "x.safetensors"), "wb") as f:
        f.write(b"\x00garbage bytes, not a safetensors header")
    message = _prelaunch_error(art, ckpt)
    assert message.startswith(os.path.join(ckpt, "x.safetensors") + ": not a safetensors file"), message


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_non_floating_weights_are_named_with_their_dtype(setup, tmp_path, dtype):
    folder, art = setup
    ckpt = _copy(folder, tmp_path / "ckpt", lambda t: t.__setitem__(FFN_KEY, t[FFN_KEY].to(dtype)))
    with pytest.raises(OpWeaveError) as info:
        run(RunConfig(artifact=art, weights=ckpt, device="cpu", requests=(Request(index=0, prompt=[5], max_new_tokens=2),)))
    name = str(dtype).removeprefix("torch.")
    assert f"tensor '{FFN_KEY}' has dtype {name}; weights must be of a floating-point dtype" in str(info.value)


# ---------------------------------------------------------------- the checkpoint's config


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", LAYERS + 1, f"config.json has num_hidden_layers {LAYERS + 1}, the artifact was compiled for {LAYERS}"),
    ("rms_norm_eps", 1e-5, "config.json has rms_norm_eps 1e-05, the artifact was compiled for 1e-06"),
    ("num_key_value_heads", 4, "config.json has num_key_value_heads 4, the artifact was compiled for 2"),
    ("vocab_size", 300, "config.json has vocab_size 300, the artifact was compiled for 256"),
])
def test_checkpoint_config_must_match_the_artifact(setup, tmp_path, field, value, message):
    folder, art = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[field] = value
    with open(path, "w") as f:
        json.dump(config, f)
    assert _prelaunch_error(art, ckpt) == f"--weights {ckpt}: {message}"


def test_rope_theta_mismatch_is_named(setup, tmp_path):
    folder, art = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_parameters"]["rope_theta"] = 10000.0
    with open(path, "w") as f:
        json.dump(config, f)
    assert "config.json has rope rope_theta (full_attention layers) 10000.0" in _prelaunch_error(art, ckpt)


def test_checkpoint_without_config_is_refused(setup, tmp_path):
    folder, art = setup
    ckpt = _copy(folder, tmp_path / "ckpt")
    os.remove(os.path.join(ckpt, "config.json"))
    assert _prelaunch_error(art, ckpt).startswith(f"--weights {ckpt}: no config.json")


# ---------------------------------------------------------------- non-finite logits


def test_nan_weights_end_every_request_with_an_error(tiny_checkpoint, tmp_path):
    """A NaN in one layer's weights makes every logit NaN: each request ends with the error, the
    run itself ends cleanly. The colocated plan runs TP 2, so the sample is the vocab-split one."""
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS)
    ckpt = _copy(folder, tmp_path / "ckpt", lambda t: t[FFN_KEY].__setitem__((0, 0), float("nan")))
    art = str(tmp_path / "art")
    compile_pinned(folder, "colocated", art)
    reqs = tuple(Request(index=i, prompt=p, max_new_tokens=3) for i, p in enumerate([[5, 6, 7], [9], [1, 2]]))
    out = run(RunConfig(artifact=art, weights=ckpt, device="cpu", requests=reqs))
    assert [(r.error, r.output) for r in out] == [("non-finite logits at output token 1", [])] * 3


def test_sampler_marks_rows_with_non_finite_logits():
    from opweave.kernels import get_backend
    from opweave.models.ops import NON_FINITE_TOKEN, Sample
    from opweave.models.registry import resolve

    logits = torch.randn(5, 1, 300)
    logits[1, 0, 7] = float("nan")
    logits[2, 0, 299] = float("inf")
    logits[3, 0, 0] = float("-inf")
    expected = torch.argmax(logits[:, -1], dim=-1)
    expected[1:4] = NON_FINITE_TOKEN
    assert torch.equal(Sample(resolve("tiny-gemma3").cfg)(logits), expected)
    for backend in ("torch", "triton"):  # the kernel path of with_kernels (Triton interpreted on CPU)
        assert torch.equal(get_backend(backend).argmax(logits[:, -1].contiguous()), expected), backend


def _scheduler(prompts, rows=2, context=64):
    reqs = [Request(index=i, prompt=p, max_new_tokens=4) for i, p in enumerate(prompts)]
    return reqs, Scheduler(reqs, num_microbatches=1, rows=rows, context=context, eos_ids=())


def test_scheduler_ends_only_the_request_with_non_finite_logits():
    """A row whose logits were not finite ends its request with an error naming the output
    token; the freed slot takes the next request and the other row carries on."""
    reqs, sched = _scheduler([[1, 2], [3], [4, 5, 6]])
    sched.plan()
    sched.learn(0, 0, [10, -1])
    assert reqs[1].error == "non-finite logits at output token 1" and reqs[1].output == []
    assert reqs[1] in sched.done and reqs[0].error is None
    sched.plan()  # the freed slot takes the next request's prompt
    step = sched.take(1, 0)
    assert step.rows[1].tokens == (4, 5, 6) and step.rows[1].first == 0
    assert step.rows[0].decode and step.rows[0].first == 2
    sched.learn(1, 0, [11, 20])
    sched.plan()
    sched.learn(2, 0, [-1, 21])
    assert reqs[0].error == "non-finite logits at output token 3" and reqs[0].output == [10, 11]
    assert reqs[2].output == [20, 21] and reqs[2].error is None
    r = 3
    while sched.active:
        sched.plan()
        sched.learn(r, 0, [0, 22])
        r += 1
    assert reqs[2].output == [20, 21, 22, 22] and reqs[2].error is None


def test_scheduler_learns_an_eos_late_and_cancels_the_planned_steps():
    """Tokens are learned two rounds after the plan: steps planned for a request that has
    meanwhile emitted EOS idle (their row takes the next request only in a round not yet planned)."""
    reqs = [Request(index=0, prompt=[1], max_new_tokens=9), Request(index=1, prompt=[2, 3], max_new_tokens=2)]
    sched = Scheduler(reqs, num_microbatches=1, rows=1, context=64, eos_ids=(7,))
    sched.plan(), sched.plan(), sched.plan()  # rounds 0..2: prefill, then two decode steps
    sched.learn(0, 0, [7])  # round 0 sampled EOS
    assert reqs[0].output == [7] and reqs[0] in sched.done
    assert sched.take(1, 0).rows[0].idle and sched.take(2, 0).rows[0].idle  # cancelled
    sched.plan()  # round 3: the slot's next request
    assert sched.take(3, 0).rows[0].tokens == (2, 3)
    sched.learn(1, 0, [5])  # a step that ran before the EOS was known: dropped
    assert reqs[0].output == [7]
    sched.plan()
    sched.learn(3, 0, [8])
    sched.learn(4, 0, [9])
    assert reqs[1].output == [8, 9] and not sched.active


# ---------------------------------------------------------------- --context and the trained positions


def test_context_beyond_max_position_embeddings(tiny_checkpoint, tmp_path, capsys):
    from opweave.compiler.steps import check_context
    from opweave.compiler.frontend import run_front_end

    folder = tiny_checkpoint("gemma3", num_hidden_layers=2)  # max_position_embeddings 256
    capsys.readouterr()  # the fixture's own progress lines
    argv = ["compile", folder, "--cluster", "h100x1", "--tpot-slo", "50ms", "--context", "512", "--quiet",
            "-o", str(tmp_path / "art")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--context 512 is beyond" in err[0] and "max_position_embeddings 256" in err[0], err
    assert "--allow-long-context" in err[0] and not (tmp_path / "art").exists()
    fe = run_front_end(folder)
    warned = []
    check_context(fe.source, fe.graph, 512, True, warned.append)
    check_context(fe.source, fe.graph, 256, False, warned.append)  # at the limit: fine
    assert len(warned) == 1 and "max_position_embeddings 256" in warned[0]


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("line,message", [
    (b'{"prompt_ids": [1, true, 3]}', "prompt_ids[1] is a boolean (true), not a token id"),
    (b'{"prompt_ids": [1, 2.0]}', "prompt_ids[1] is a floating-point number (2.0), not a token id"),
    (b'{"prompt_ids": [1, "2"]}', 'prompt_ids[1] is a string ("2"), not a token id'),
    (b'{"prompt_ids": [-4]}', "prompt_ids[0] = -4 is not a token id (negative)"),
    (b'{"prompt_ids": [9223372036854775808]}', "prompt_ids[0] = 9223372036854775808 is not a token id (does not fit int64)"),
    (b'{"prompt_ids": []}', "prompt_ids is empty"),
    (b'{"prompt_ids": "1,2"}', "prompt_ids must be a list of token ids, got a string"),
    (b'{"prompt_ids": [1], "max_new_tokens": 0}', "max_new_tokens must be a positive whole number, got 0"),
    (b'{"prompt_ids": [1], "max_new_tokens": true}', "positive whole number, got true"),
    (b'{"prompt_ids": [1], "max_new_tokens": 2.5}', "positive whole number, got 2.5"),
    (b'{"prompt_ids": [1], "max_new_tokens": "4"}', 'positive whole number, got "4"'),
    (b'[1, 2, 3]', 'expected an object like {"prompt_ids": [1, 2, 3]}, got a list'),
    (b'{"prompt": [1]}', "no 'prompt_ids'"),
    (b'{"prompt_ids": [1, 2', "not JSON"),
    (b'[' * 100000, "not JSON"),
    (b'\xff\xfe{"prompt_ids": [1]}', "not UTF-8 text (byte 0xff at column 1)"),
], ids=lambda v: v[:40].decode("latin-1") if isinstance(v, bytes) else "")
def test_prompt_file_lines_are_checked(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt_ids": [5, 6]}\n\n' + line + b"\n")
    with pytest.raises(OpWeaveError) as info:
        read_requests(str(path), None, 4)
    assert str(info.value).startswith(f"--prompts {path}: line 3: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_good_prompts_keep_their_source(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [5, 6]}\n{"prompt_ids": [7], "max_new_tokens": 2}\n')
    reqs = read_requests(str(path), "1, 2,3", 4)
    assert [(r.index, r.prompt, r.max_new_tokens) for r in reqs] == [(0, [1, 2, 3], 4), (1, [5, 6], 4), (2, [7], 2)]
    assert [r.source for r in reqs] == ["--prompt-ids", f"--prompts {path}: line 1", f"--prompts {path}: line 2"]


@pytest.mark.parametrize("ids,message", [
    ("1,x", "'x' is not a whole number"),
    ("1,2.5", "'2.5' is not a whole number"),
    ("1,-2", "ids[1] = -2 is not a token id (negative)"),
    ("99999999999999999999", "does not fit int64"),
    (",", "no token ids"),
    ("", "no token ids"),
])
def test_prompt_ids_flag_is_checked(ids, message):
    with pytest.raises(OpWeaveError, match="^--prompt-ids: ") as info:
        read_requests(None, ids, 4)
    assert message in str(info.value)


def test_prompt_ids_outside_the_vocabulary_are_refused_before_the_ranks(setup, tmp_path, capsys):
    folder, art = setup
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [5, 6]}\n{"prompt_ids": [7, 256]}\n')
    assert main(["run", art, "--weights", "random", "--prompts", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"opweave: error: --prompts {path}: line 2: token id 256 is outside the model's vocabulary "
                   "(0 to 255)"]
    assert main(["run", art, "--weights", folder, "--prompt-ids", "1,300"]) == 2
    assert "--prompt-ids: token id 300 is outside" in capsys.readouterr().err


def test_prompt_file_that_never_ends_a_line_is_refused(tmp_path, monkeypatch):
    import opweave.runtime.checks as checks

    monkeypatch.setattr(checks, "MAX_PROMPT_LINE_BYTES", 1 << 10)
    with within(10), pytest.raises(OpWeaveError, match="^--prompts /dev/zero: line 1: longer than"):
        read_requests("/dev/zero", None, 4)


# ---------------------------------------------------------------- dump of a damaged artifact


@pytest.mark.parametrize("what,name", [("ranks", "rank_01.json"), ("plan", "plan.json")])
@pytest.mark.parametrize("text,message", [
    ('{"rank": 1, "stag', "is truncated or not JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ("7", "holds a JSON int, not an object"),
    ("{}", "not a readable"),
    ('{"stages": 5, "rank": "x"}', "not a readable"),
])
def test_dump_of_damaged_artifact_files(setup, tmp_path, capsys, what, name, text, message):
    _, art = setup
    bad = str(tmp_path / "art")
    shutil.copytree(art, bad)
    with open(os.path.join(bad, name), "w") as f:
        f.write(text)
    assert main(["dump", bad, "--what", what]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"opweave: error: {os.path.join(bad, name)}: ") and message in err[0], err


def test_dump_refuses_a_fifo_without_blocking(setup, tmp_path, capsys):
    _, art = setup
    bad = str(tmp_path / "art")
    shutil.copytree(art, bad)
    os.remove(os.path.join(bad, "rank_01.json"))
    os.mkfifo(os.path.join(bad, "rank_01.json"))
    with within(10):
        assert main(["dump", bad, "--what", "ranks"]) == 2
    assert "rank_01.json: the rank program is a FIFO" in capsys.readouterr().err


# ---------------------------------------------------------------- profile grids and memory


def test_profile_grid_too_large_for_memory_is_refused_up_front(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny-gemma3", "--batches", "1000000000", "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs about" in err[0] and "lower --batches or --contexts" in err[0], err
    assert not out.exists()
    assert main(["profile", "--model", "tiny-gemma3", "--contexts", "9" * 400, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bad context length" in err and err.count("\n") == 1


def test_profile_out_of_memory_is_one_line(monkeypatch):
    import opweave.profile.measure as measure

    def fail(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes.\nmore")

    monkeypatch.setattr(measure, "_measure_ops", fail)
    with pytest.raises(OpWeaveError, match="ran out of memory .*can't allocate memory.*lower --batches") as info:
        measure.profile("tiny-gemma3", batches=(1,), contexts=(64,), measure_links=False)
    assert "\n" not in str(info.value)
