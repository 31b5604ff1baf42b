"""What `opweave run` reads and prints: prompts as token ids, text or a chat, and outputs with their text.

A line of a `--prompts` file is a JSON object with exactly one of

- `prompt_ids`: the prompt's token ids, fed as they are;
- `prompt`: text, tokenized with the special tokens the tokenizer adds (BOS), as the server's
  /v1/completions tokenizes a text prompt;
- `messages`: a chat, `[{"role": ..., "content": ...}, ...]`, through the tokenizer's chat template
  ending with the assistant's turn, as /v1/chat/completions builds its prompt;

and optionally `max_new_tokens` (a positive whole number; default `--max-new-tokens`). Any other key, two prompt keys, empty text and a
text line in a run without a tokenizer are refused, naming the file and line, before any rank starts.

The tokenizer is the server's (`opweave.serve.tokenizer.Tokenizer`, loaded by the CLI: this layer
does not import the server), so a text prompt gets the ids `opweave serve` gives it and an output
decodes as a server's completion does (special tokens skipped).
"""

from __future__ import annotations

import dataclasses
import json
import os

from opweave.errors import OpWeaveError
from opweave.runtime import checks
from opweave.runtime.checks import _kind, check_max_new_tokens, check_token_ids
from opweave.runtime.scheduler import Request

PROMPT_KEYS = ("prompt_ids", "prompt", "messages")
OTHER_KEYS = ("max_new_tokens",)


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer of a run (`Tokenizer`'s encode, encode_chat, has_chat_template and decode),
    or None and why there is none (said when a line holds text)."""

    tokenizer: object = None
    missing: str = "this run has none"


def run_tokenizer(folder: str | None, weights: str, load) -> RunTokenizer:
    """`run`'s tokenizer: `--tokenizer FOLDER`'s, else the `--weights` checkpoint's when it has a
    tokenizer.json, else none (token-id prompts only, outputs without text). `load`: a folder ->
    tokenizer (`Tokenizer.from_folder`); a tokenizer that is there but does not load is an error."""
    if folder is not None:
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise OpWeaveError(f"--tokenizer {folder}: no tokenizer.json (give a Hugging Face checkpoint folder)")
        return RunTokenizer(load(folder))
    if weights == "random":
        return RunTokenizer(None, "--weights random has none: give --tokenizer FOLDER")
    if not os.path.isfile(os.path.join(weights, "tokenizer.json")):
        return RunTokenizer(None, f"--weights {weights} has no tokenizer.json: give --tokenizer FOLDER")
    return RunTokenizer(load(weights))


def read_prompts(path: str, max_new_tokens: int, tokenizer: RunTokenizer) -> list[Request]:
    """Every non-blank line of a JSONL prompts file as a Request, checked (see the module docstring)."""
    out = []
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(iter(lambda: f.readline(checks.MAX_PROMPT_LINE_BYTES + 1), b""), 1):
                where = f"--prompts {path}: line {n}"
                if len(raw) > checks.MAX_PROMPT_LINE_BYTES:
                    raise OpWeaveError(f"{where}: longer than {checks.MAX_PROMPT_LINE_BYTES >> 20} MiB")
                request = parse_line(raw, where, max_new_tokens, tokenizer)
                if request is not None:
                    out.append(request)
    except OSError as e:
        raise OpWeaveError(f"--prompts {path}: cannot read ({e.strerror})") from None
    return out


def parse_line(raw: bytes, where: str, max_new_tokens: int, tokenizer: RunTokenizer) -> Request | None:
    """One line of a prompts file as a Request (index 0), or None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpWeaveError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    if not text.strip():
        return None
    try:
        item = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise OpWeaveError(f"{where}: not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(item, dict):
        raise OpWeaveError(f'{where}: expected an object like {{"prompt_ids": [1, 2, 3]}}, got {_kind(item)}')
    unknown = [k for k in item if k not in PROMPT_KEYS + OTHER_KEYS]
    if unknown:
        raise OpWeaveError(f"{where}: unknown key {json.dumps(unknown[0])[:40]} (a line holds one of 'prompt_ids', "
                           f"'prompt', 'messages', and may hold 'max_new_tokens')")
    given = [k for k in PROMPT_KEYS if k in item]
    if not given:
        raise OpWeaveError(f"{where}: no 'prompt_ids', 'prompt' or 'messages' (the prompt as token ids, text "
                           f"or a chat)")
    if len(given) > 1:
        raise OpWeaveError(f"{where}: both '{given[0]}' and '{given[1]}': give exactly one of 'prompt_ids', "
                           f"'prompt', 'messages'")
    new = check_max_new_tokens(item["max_new_tokens"], where) if "max_new_tokens" in item else max_new_tokens
    key = given[0]
    if key == "prompt_ids":
        ids = check_token_ids(item[key], where)
    elif key == "prompt":
        ids = _encode_text(_text(item[key], where, "prompt"), where, tokenizer)
    else:
        ids = _encode_chat(_messages(item[key], where), where, tokenizer)
    return Request(index=0, prompt=ids, max_new_tokens=new, source=where)


def _text(value, where: str, field: str, empty_ok: bool = False) -> str:
    """`value` as text: a string of valid Unicode (no lone surrogate), non-empty unless `empty_ok`."""
    if not isinstance(value, str):
        hint = " (a list of token ids goes in 'prompt_ids'; this line has no 'prompt_ids')" \
            if field == "prompt" and isinstance(value, list) else ""
        raise OpWeaveError(f"{where}: {field} must be text (a string), got {_kind(value)}{hint}")
    if not value and not empty_ok:
        raise OpWeaveError(f"{where}: {field} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise OpWeaveError(f"{where}: {field} holds invalid Unicode (a lone surrogate)") from None
    return value


def _messages(value, where: str) -> list[dict]:
    """A chat as `[{"role", "content"}, ...]`, both strings, the role non-empty."""
    if not isinstance(value, list):
        raise OpWeaveError(f'{where}: messages must be a list of {{"role": ..., "content": ...}} objects, '
                           f"got {_kind(value)}")
    if not value:
        raise OpWeaveError(f"{where}: messages is empty")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise OpWeaveError(f"{where}: messages[{i}] must be an object with 'role' and 'content', got {_kind(m)}")
        missing = [k for k in ("role", "content") if k not in m]
        extra = [k for k in m if k not in ("role", "content")]
        if missing or extra:
            problem = f"has no '{missing[0]}'" if missing else f"has an unknown key {json.dumps(extra[0])[:40]}"
            raise OpWeaveError(f"{where}: messages[{i}] {problem} (a message holds 'role' and 'content')")
        out.append({"role": _text(m["role"], where, f"messages[{i}].role"),
                    "content": _text(m["content"], where, f"messages[{i}].content", empty_ok=True)})
    return out


def _need(tokenizer: RunTokenizer, key: str, where: str):
    if tokenizer.tokenizer is None:
        raise OpWeaveError(f"{where}: '{key}' needs a tokenizer, and {tokenizer.missing} (or give the prompt's "
                           f"token ids in 'prompt_ids')")
    return tokenizer.tokenizer


def _encode_text(text: str, where: str, tokenizer: RunTokenizer) -> list[int]:
    ids = _need(tokenizer, "prompt", where).encode(text)
    if not ids:
        raise OpWeaveError(f"{where}: prompt gives no tokens")
    return ids


def _encode_chat(messages: list[dict], where: str, tokenizer: RunTokenizer) -> list[int]:
    tok = _need(tokenizer, "messages", where)
    if not tok.has_chat_template:
        raise OpWeaveError(f"{where}: 'messages' needs a chat template, and the tokenizer has none (give the "
                           f"text in 'prompt')")
    try:
        ids = tok.encode_chat(messages)
    except Exception as e:  # noqa: BLE001 - a template that fails on these messages (jinja), as the server says
        raise OpWeaveError(f"{where}: the chat template failed on these messages: "
                           f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if not ids:
        raise OpWeaveError(f"{where}: the chat template gives no tokens")
    return ids


def print_outputs(outputs: list[Request], tokenizer: RunTokenizer, as_json: bool, stats: dict) -> None:
    """`run`'s results on stdout. JSON: `{"outputs": [{"prompt_ids", "token_ids", "text"?, "error"?}],
    "stats": stats}`; else a line per request (`[i] N prompt tokens -> ids`) and, with a tokenizer,
    its text as a JSON string under it (one line, whatever the text holds). `text` (the output
    decoded, special tokens skipped) is there whenever the run has a tokenizer."""
    tok = tokenizer.tokenizer
    if as_json:
        print(json.dumps({"outputs": [{"prompt_ids": r.prompt, "token_ids": r.output}
                                      | ({"text": tok.decode(r.output)} if tok is not None else {})
                                      | ({"error": r.error} if r.error else {}) for r in outputs],
                          "stats": stats}))
        return
    for r in outputs:
        shown = f"error: {r.error}" if r.error else " ".join(map(str, r.output))
        print(f"[{r.index}] {len(r.prompt)} prompt tokens -> {shown}")
        if tok is not None and not r.error:
            print(f"    text: {json.dumps(tok.decode(r.output), ensure_ascii=False)}")
