"""The OpenAI wire format: request validation, response bodies, and error bodies.

`parse_completion` and `parse_chat` read a request's JSON body into a `Request` (prompt not yet
tokenized), `parse_tokenize` and `parse_detokenize` the bodies of vLLM's /tokenize and
/detokenize, or raise `ApiError`, whose `body()` is an OpenAI-style error object
(`{"error": {"message", "type", "param", "code"}}`) and `status` its HTTP status. Every field has
its documented effect (docs/serve.md) or is refused with a 400 naming it: fields the server
cannot honour (penalties, logit_bias) are accepted only at their neutral value, and a field this
module does not know is refused. `n` choices are n requests of the engine on the same
prompt (choice i draws with seed + i when a seed is given).

`temperature` and `top_p` left out of a request are None here: the server then uses the
checkpoint's recommended sampling (`generation_config.json` with `do_sample`), or greedy decoding
when it recommends none (`Tokenizer.sampling_defaults`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import time
import uuid

from opweave.kernels.logprobs import MAX_TOP_LOGPROBS

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TEMPERATURE = 2.0               # OpenAI's accepted range is [0, 2]
MAX_N = 64                          # choices one request may ask for (`n`)


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or error_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated completion or chat request; exactly one of `text`, `token_ids`, `messages` is set."""

    kind: str                                  # "completion" or "chat"
    model: str
    max_tokens: int | None                     # None: the default (chat: up to the context)
    stream: bool
    include_usage: bool                        # stream_options.include_usage
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    temperature: float | None  # None: the server's default (module docstring)
    top_p: float | None
    seed: int | None
    top_k: int = 0                             # 0: off
    min_p: float = 0.0                         # 0: off
    min_tokens: int = 0                        # EOS is banned before this many output tokens
    ignore_eos: bool = False                   # the model's EOS ids do not end the request
    echo: bool = False                         # completions: the prompt's text comes before the output
    n: int = 1                                 # choices, each its own sequence from the prompt
    logprobs: int | None = None                # top log-probabilities per output token (None: none)
    prompt_logprobs: bool = False              # completions: `echo` with `logprobs`: the prompt's too
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None


MAX_JSON_DEPTH = 64  # nesting levels a request body may have
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = [1 if b in b"[{" else -1 for b in range(256)]


def load_json(raw: bytes) -> dict:
    """The body as a JSON object; 400 for invalid UTF-8 or JSON, nesting deeper than MAX_JSON_DEPTH,
    or a lone surrogate (an unpaired `\\ud800` escape) in any string."""
    too_deep = ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if _json_depth(raw) > MAX_JSON_DEPTH:
        raise too_deep
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        path = _surrogate_path(body)
        raise ApiError(400, f"'{path}' holds invalid Unicode (a lone surrogate)", param=path) from None
    return body


def _json_depth(raw: bytes) -> int:
    """The deepest nesting of [ and { outside strings, counted without recursion."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def _surrogate_path(body: dict) -> str:
    """Where the first string that is not valid Unicode lies, e.g. `messages[0].content`."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _valid_unicode(value):
            return path
        if isinstance(value, dict):
            for key, item in value.items():
                shown = key.encode("utf-8", "backslashreplace").decode()
                if not _valid_unicode(key):
                    return f"{path}.{shown}" if path else shown
                stack.append((f"{path}.{shown}" if path else shown, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return "body"


def _valid_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# Every field a request may hold; any other is refused with a 400 naming it (docs/serve.md).
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "n", "stream", "stream_options", "stop", "stop_token_ids", "temperature",
    "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos", "user", "logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "response_format"}


def _known_fields(body: dict, fields: frozenset) -> None:
    unknown = sorted(k for k in body if k not in fields)
    if unknown:
        raise ApiError(400, f"unknown field '{unknown[0]}' (the fields this server takes are listed in "
                            f"docs/serve.md)", param=unknown[0])


def parse_completion(body: dict) -> Request:
    _known_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        text, ids = None, tuple(int(t) for t in prompt)
        if min(ids) < 0:
            raise ApiError(400, f"'prompt' holds a negative token id ({min(ids)})", param="prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "one prompt per request is supported, got a batch of prompts", param="prompt")
    else:
        raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids", param="prompt")
    echo = _flag(body, "echo", False)
    if body.get("suffix") is not None:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}",
                       param="logprobs")
    if body.get("best_of") not in (None, body.get("n", 1) or 1):
        raise ApiError(400, "'best_of' must equal 'n' (every sequence drawn is returned)", param="best_of")
    return Request(kind="completion", text=text, token_ids=ids, echo=echo, logprobs=logprobs,
                   prompt_logprobs=echo and logprobs is not None, **_common(body))


def parse_chat(body: dict) -> Request:
    _known_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, False, 0, [], "none"):
            raise ApiError(400, f"'{name}' is not supported", param=name)
    wanted = _flag(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}",
                       param="top_logprobs")
    if top and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "'response_format' is not supported (only {\"type\": \"text\"})",
                       param="response_format")
    common = _common(body)
    if "max_completion_tokens" in body and "max_tokens" not in body:
        common["max_tokens"] = _max_tokens(body, "max_completion_tokens")
    return Request(kind="chat", messages=parsed, logprobs=(top or 0) if wanted else None, **common)


def _message(m, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"{param} must be an object with a 'role'", param=param)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is understood
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"{param}.content: only text parts are supported", param=param)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}.content must be a string", param=param)
    return {"role": m["role"], "content": content}


def _common(body: dict) -> dict:
    """The fields both endpoints share, checked."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (a string)", param="model")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be an integer from 1 to {MAX_N}, got {n!r}", param="n")
    temperature = _number(body, "temperature", None)
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}, got {temperature:g}",
                       param="temperature")
    top_p = _number(body, "top_p", None)
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p:g}", param="top_p")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if _number(body, name, neutral) != neutral:
            raise ApiError(400, f"'{name}' is not supported (only its neutral value {neutral:g})", param=name)
    if body.get("logit_bias") not in (None, {}):
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "'user' must be a string", param="user")
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    if not _is_int(top_k) or top_k < 0:
        raise ApiError(400, f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k!r}", param="top_k")
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise ApiError(400, f"'min_p' must be between 0 and 1, got {min_p:g}", param="min_p")
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise ApiError(400, f"'min_tokens' must be a non-negative integer, got {min_tokens!r}", param="min_tokens")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool) and ignore_eos is not None:
        raise ApiError(400, "'ignore_eos' must be true or false", param="ignore_eos")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    for key in options:
        if key != "include_usage":
            raise ApiError(400, f"'stream_options.{key}' is not supported", param=f"stream_options.{key}")
    if not isinstance(options.get("include_usage", False), (bool, type(None))):
        raise ApiError(400, "'stream_options.include_usage' must be true or false",
                       param="stream_options.include_usage")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    return dict(model=model, max_tokens=_max_tokens(body, "max_tokens"), stream=bool(stream),
                include_usage=bool(options.get("include_usage")), stop=_stop(body.get("stop")),
                stop_token_ids=tuple(int(t) for t in stop_ids), temperature=temperature, top_p=top_p,
                seed=None if seed is None else int(seed), top_k=int(top_k), min_p=min_p,
                min_tokens=int(min_tokens), ignore_eos=bool(ignore_eos), n=int(n))


def _max_tokens(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    if value < 1:
        raise ApiError(400, f"'{name}' must be at least 1, got {value}", param=name)
    return int(value)


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    return tuple(s for s in stop if s)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", param=name)
    return float(value)


def _flag(body: dict, name: str, default: bool) -> bool:
    """A true/false field; null or absent is `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", param=name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model(model: str | None, served: str) -> None:
    """404 (OpenAI's `model_not_found`) when a request names a model this server does not serve."""
    if model is not None and model != served:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves '{served}'",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------- /tokenize and /detokenize (vLLM's shapes)
@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """A validated /tokenize body: exactly one of `text` and `messages` is set."""

    model: str | None
    add_special_tokens: bool                   # default: true for a prompt, false for messages
    return_token_strs: bool
    add_generation_prompt: bool = True         # messages only
    text: str | None = None
    messages: tuple[dict, ...] | None = None


TOKENIZE_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "add_special_tokens",
                                  "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def parse_tokenize(body: dict) -> TokenizeRequest:
    """`{"prompt": str}` or `{"messages": [...]}`, each with its own optional flags (as vLLM's
    TokenizeCompletionRequest and TokenizeChatRequest)."""
    if "prompt" in body and "messages" in body:
        raise ApiError(400, "give either 'prompt' or 'messages', not both", param="messages")
    chat = "messages" in body
    if not chat and "add_generation_prompt" in body:
        raise ApiError(400, "'add_generation_prompt' applies only to 'messages'", param="add_generation_prompt")
    _known_fields(body, TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_PROMPT_FIELDS)
    model = _optional_model(body)
    common = dict(model=model, add_special_tokens=_flag(body, "add_special_tokens", not chat),
                  return_token_strs=_flag(body, "return_token_strs", False))
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        return TokenizeRequest(messages=tuple(_message(m, i) for i, m in enumerate(messages)),
                               add_generation_prompt=_flag(body, "add_generation_prompt", True), **common)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' or 'messages' is required", param="prompt")
    if not isinstance(body["prompt"], str):
        raise ApiError(400, "'prompt' must be a string", param="prompt")
    return TokenizeRequest(text=body["prompt"], **common)


def parse_detokenize(body: dict) -> tuple[str | None, tuple[int, ...]]:
    """(model or None, token ids) of a /detokenize body; ids are checked against the vocabulary later."""
    _known_fields(body, DETOKENIZE_FIELDS)
    model = _optional_model(body)
    tokens = body.get("tokens")
    if tokens is None:
        raise ApiError(400, "'tokens' is required", param="tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    if tokens and min(tokens) < 0:
        raise ApiError(400, f"'tokens' holds a negative token id ({min(tokens)})", param="tokens")
    return model, tuple(tokens)


def _optional_model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    return model


# ---------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: Request, rid: str, created: int, choices: list[tuple], use: dict) -> dict:
    """The whole (non-streaming) response: one choice per (text, finish reason[, its logprobs
    object, `opweave.serve.logprobs`]), in index order."""
    choices = [(c[0], c[1], c[2] if len(c) > 2 else None) for c in choices]
    if req.kind == "chat":
        body = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                 "finish_reason": finish} for i, (text, finish, lp) in enumerate(choices)]
        obj = "chat.completion"
    else:
        body = [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                for i, (text, finish, lp) in enumerate(choices)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": body, "usage": use}


def chunk(req: Request, rid: str, created: int, text: str | None, finish: str | None,
          role: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    """One streamed chunk of choice `index`: new text and/or the finish reason (chat: `role`
    opens the message), with the log-probabilities of its tokens when asked."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: Request, rid: str, created: int, use: dict) -> dict:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [], "usage": use}


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def now() -> int:
    return int(time.time())
