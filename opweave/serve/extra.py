"""The endpoints beside generation that vLLM's clients and tools expect, in vLLM's shapes.

    POST /tokenize      {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"[, "token_strs"]}
    POST /detokenize    {"tokens"} -> {"prompt"}
    GET  /version       {"version": opweave's version}
    GET|POST /ping      what /health answers (200 while every rank runs, else 503)

They touch neither the engine nor the batch: only the tokenizer, the plan's context and the
engine's health. Request bodies are validated in `protocol.py` like every other request.
"""

from __future__ import annotations

from fastapi import FastAPI, Request as HttpRequest

import opweave
from opweave.serve import protocol
from opweave.serve.protocol import ApiError
from opweave.serve.tokenizer import Tokenizer


def add_routes(app: FastAPI, engine, tokenizer: Tokenizer, name: str, health) -> None:
    """Adds the routes above to `app`, serving model `name`; `health` is the app's /health handler."""

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        req = protocol.parse_tokenize(protocol.load_json(await http.body()))
        protocol.check_model(req.model, name)
        if req.messages is not None:
            ids = chat_ids(tokenizer, list(req.messages), req.add_generation_prompt, req.add_special_tokens)
        else:
            ids = list(tokenizer.hf.encode(req.text, add_special_tokens=req.add_special_tokens))
        out = {"count": len(ids), "max_model_len": engine.context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = tokenizer.hf.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        model, ids = protocol.parse_detokenize(protocol.load_json(await http.body()))
        protocol.check_model(model, name)
        vocab = len(tokenizer.hf)
        if ids and max(ids) >= vocab:
            raise ApiError(400, f"'tokens' holds the id {max(ids)}, outside the tokenizer's vocabulary of {vocab}",
                           param="tokens")
        return {"prompt": decode_prompt(tokenizer, list(ids))}

    @app.get("/version")
    async def version():
        return {"version": opweave.__version__}

    app.add_api_route("/ping", health, methods=["GET", "POST"])


def chat_ids(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool,
             add_special_tokens: bool) -> list[int]:
    """The ids of `messages` through the checkpoint's chat template; with the defaults (generation prompt,
    no added special tokens) exactly the prompt /v1/chat/completions submits (`Tokenizer.encode_chat`)."""
    if not tokenizer.has_chat_template:
        raise ApiError(400, "the model's tokenizer has no chat template: tokenize a 'prompt' instead",
                       param="messages")
    try:
        text = tokenizer.hf.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a chat template that fails on these messages (jinja)
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ApiError(400, f"the chat template failed on these messages: {reason}", param="messages") from None
    return list(tokenizer.hf.encode(text, add_special_tokens=add_special_tokens))


def decode_prompt(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A prompt's ids as text, special tokens written out (BOS included), as vLLM's /detokenize and its
    `echo` of token-id prompts give them: unlike generated text, nothing of the prompt is dropped."""
    return tokenizer.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
