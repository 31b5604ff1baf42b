"""`opweave run` with text prompts: a `--prompts` line holds token ids, text or a chat; text goes
through the checkpoint's tokenizer and chat template as the server's endpoints do, outputs carry
their text whenever there is a tokenizer, and a bad line is one line naming file and line, exit 2.
End to end, a text prompt generates exactly what the same ids give as an id prompt."""

import json
import os
import shutil

import pytest

from serve_fixtures import write_tokenizer
from test_runtime import LAYERS, compile_pinned
from opweave.cli import main
from opweave.errors import OpWeaveError
from opweave.runtime.launch import read_requests
from opweave.runtime.run_io import RunTokenizer, print_outputs
from opweave.runtime.scheduler import Request
from opweave.serve.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world, how are you today?"}]
BOS_ID, ASSISTANT_ID = 1, 5  # serve_fixtures.SPECIAL_TOKENS: "<s>" and "<|assistant|>"


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """(checkpoint without a tokenizer, the same checkpoint with one, its Tokenizer, an artifact)."""
    plain = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    root = tmp_path_factory.mktemp("run_text")
    with_tok = shutil.copytree(plain, root / "ckpt_tok")
    with open(os.path.join(plain, "config.json")) as f:
        write_tokenizer(str(with_tok), vocab_size=json.load(f)["vocab_size"])
    art = str(root / "art")
    compile_pinned(plain, "afd", art)
    return plain, str(with_tok), Tokenizer.from_folder(str(with_tok)), art


def _file(tmp_path, *items) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))
    return str(path)


# ---------------------------------------------------------------- reading each form


def test_each_line_form_is_read(setup, tmp_path):
    _, _, tok, _ = setup
    path = _file(tmp_path, {"prompt_ids": [5, 6, 7]}, {"prompt": TEXT, "max_new_tokens": 3},
                 {"messages": CHAT}, "")
    reqs = read_requests(path, None, 4, RunTokenizer(tok))
    assert [(r.index, r.max_new_tokens) for r in reqs] == [(0, 4), (1, 3), (2, 4)]
    assert reqs[0].prompt == [5, 6, 7]
    # a completion prompt: the tokenizer's BOS, then the text (what /v1/completions feeds)
    assert reqs[1].prompt == tok.encode(TEXT) == tok.hf.encode(TEXT) and reqs[1].prompt[0] == BOS_ID
    # a chat: the template's text, its special tokens not added twice, ending with the assistant's turn
    chat = tok.hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert reqs[2].prompt == tok.encode_chat(CHAT) == tok.hf.encode(chat, add_special_tokens=False)
    assert reqs[2].prompt[0] == BOS_ID != reqs[2].prompt[1] and reqs[2].prompt[-1] == ASSISTANT_ID
    assert [r.source for r in reqs] == [f"--prompts {path}: line {n}" for n in (1, 2, 3)]


def test_id_lines_need_no_tokenizer(tmp_path):
    path = _file(tmp_path, {"prompt_ids": [5, 6]}, {"prompt_ids": [7], "max_new_tokens": 2})
    reqs = read_requests(path, "1,2", 4)
    assert [(r.prompt, r.max_new_tokens) for r in reqs] == [([1, 2], 4), ([5, 6], 4), ([7], 2)]


# ---------------------------------------------------------------- bad lines: one line, exit 2


@pytest.mark.parametrize("line,message", [
    ({"prompt": "hi", "foo": 1}, "unknown key \"foo\""),
    ({"prompt_ids": [1], "prompts": "x"}, "unknown key \"prompts\""),
    ({"prompt_ids": [1], "id": "x"}, "unknown key \"id\""),
    ({"prompt": "hi", "prompt_ids": [1]}, "both 'prompt_ids' and 'prompt': give exactly one of"),
    ({"prompt": "hi", "messages": CHAT}, "both 'prompt' and 'messages'"),
    ({"max_new_tokens": 3}, "no 'prompt_ids', 'prompt' or 'messages'"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": 5}, "prompt must be text (a string), got an integer"),
    ({"prompt": [1, 2]}, "prompt must be text (a string), got a list (a list of token ids goes in 'prompt_ids'"),
    ({"prompt": None}, "prompt must be text (a string), got null"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens must be a positive whole number, got 0"),
    ('{"prompt": "\\ud800"}', "prompt holds invalid Unicode (a lone surrogate)"),
    ({"messages": "hi"}, "messages must be a list of"),
    ({"messages": []}, "messages is empty"),
    ({"messages": ["hi"]}, "messages[0] must be an object with 'role' and 'content', got a string"),
    ({"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
    ({"messages": [{"content": "hi"}]}, "messages[0] has no 'role'"),
    ({"messages": [{"role": "user", "content": "hi", "name": "a"}]}, "messages[0] has an unknown key \"name\""),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be text (a string), got an integer"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages[0].role is empty"),
    ({"prompt_ids": [1, 999]}, "token id 999 is outside the model's vocabulary"),
    ("[1, 2]", 'expected an object like {"prompt_ids": [1, 2, 3]}, got a list'),
], ids=lambda v: json.dumps(v)[:40] if not isinstance(v, str) else v[:40])
def test_bad_lines_are_one_line_exit_2(setup, tmp_path, capsys, line, message):
    _, with_tok, _, art = setup
    path = _file(tmp_path, {"prompt": TEXT}, line)
    assert main(["run", art, "--weights", with_tok, "--prompts", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"opweave: error: --prompts {path}: line 2: "), err
    assert message in err[0], err


@pytest.mark.parametrize("line", [{"prompt": TEXT}, {"messages": CHAT}])
def test_text_lines_without_a_tokenizer(setup, tmp_path, capsys, line):
    plain, _, _, art = setup
    path = _file(tmp_path, {"prompt_ids": [5]}, line)
    key = next(iter(line))
    for weights, why in ((plain, f"--weights {plain} has no tokenizer.json: give --tokenizer FOLDER"),
                         ("random", "--weights random has none: give --tokenizer FOLDER")):
        assert main(["run", art, "--weights", weights, "--prompts", path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"opweave: error: --prompts {path}: line 2: '{key}' needs a tokenizer, and {why} (or give "
                       f"the prompt's token ids in 'prompt_ids')"]
    with pytest.raises(OpWeaveError, match=f"line 2: '{key}' needs a tokenizer, and this run has none"):
        read_requests(path, None, 4)


def test_tokenizer_flag(setup, tmp_path, capsys):
    plain, _, _, art = setup
    path = _file(tmp_path, {"messages": CHAT})
    assert main(["run", art, "--weights", plain, "--tokenizer", str(tmp_path), "--prompts", path]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"opweave: error: --tokenizer {tmp_path}: no tokenizer.json (give a Hugging Face checkpoint folder)"]
    no_template = write_tokenizer(str(tmp_path / "tok"), vocab_size=256, chat_template=None)
    assert main(["run", art, "--weights", plain, "--tokenizer", no_template, "--prompts", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 1: 'messages' needs a chat template, and the tokenizer has none" in err[0], err


# ---------------------------------------------------------------- outputs


def test_outputs_without_a_tokenizer_print_as_before(capsys):
    outputs = [Request(index=0, prompt=[5, 6], max_new_tokens=3, output=[7, 8, 9]),
               Request(index=1, prompt=[4], max_new_tokens=3, output=[3], error="non-finite logits at output token 1")]
    print_outputs(outputs, RunTokenizer(), False, {})
    assert capsys.readouterr().out.splitlines() == [
        "[0] 2 prompt tokens -> 7 8 9", "[1] 1 prompt tokens -> error: non-finite logits at output token 1"]
    print_outputs(outputs, RunTokenizer(), True, {"rounds": 3})
    assert json.loads(capsys.readouterr().out) == {"outputs": [
        {"prompt_ids": [5, 6], "token_ids": [7, 8, 9]},
        {"prompt_ids": [4], "token_ids": [3], "error": "non-finite logits at output token 1"}], "stats": {"rounds": 3}}


def test_outputs_with_a_tokenizer_carry_their_text(setup, capsys):
    _, _, tok, _ = setup
    ids = tok.encode('Hello "world"') + [2]  # BOS first and EOS last: special, skipped
    outputs = [Request(index=0, prompt=[5], max_new_tokens=9, output=ids)]
    print_outputs(outputs, RunTokenizer(tok), False, {})
    assert capsys.readouterr().out.splitlines() == [
        f"[0] 1 prompt tokens -> {' '.join(map(str, ids))}", '    text: "Hello \\"world\\""']
    print_outputs(outputs, RunTokenizer(tok), True, {})
    assert json.loads(capsys.readouterr().out)["outputs"] == [
        {"prompt_ids": [5], "token_ids": ids, "text": 'Hello "world"'}]


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_text_prompts_generate_what_their_ids_do(setup, tmp_path, capsys):
    """A run of a text and a chat prompt, and a run of their ids (the checkpoint without a
    tokenizer: output as before, no text), give the same tokens; the text is their decoding."""
    plain, with_tok, tok, art = setup
    text_file = _file(tmp_path, {"prompt": TEXT}, {"messages": CHAT, "max_new_tokens": 3})
    assert main(["run", art, "--weights", with_tok, "--prompts", text_file, "--max-new-tokens", "5", "--json"]) == 0
    by_text = json.loads(capsys.readouterr().out)["outputs"]
    ids_file = tmp_path / "ids.jsonl"
    ids_file.write_text(json.dumps({"prompt_ids": tok.encode(TEXT)}) + "\n"
                        + json.dumps({"prompt_ids": tok.encode_chat(CHAT), "max_new_tokens": 3}) + "\n")
    assert main(["run", art, "--weights", plain, "--prompts", str(ids_file), "--max-new-tokens", "5", "--json"]) == 0
    by_ids = json.loads(capsys.readouterr().out)["outputs"]
    assert [o["prompt_ids"] for o in by_text] == [tok.encode(TEXT), tok.encode_chat(CHAT)]
    assert [sorted(o) for o in by_ids] == [["prompt_ids", "token_ids"]] * 2
    assert [(o["prompt_ids"], o["token_ids"]) for o in by_text] == [(o["prompt_ids"], o["token_ids"]) for o in by_ids]
    assert [len(o["token_ids"]) for o in by_text] == [5, 3]
    assert [o["text"] for o in by_text] == [tok.decode(o["token_ids"]) for o in by_ids]
