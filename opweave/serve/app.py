"""The HTTP front end: an OpenAI-compatible FastAPI app over a running `Engine`, and its uvicorn runner.

    POST /v1/completions        prompt as text or token ids; streaming (SSE) or not; `echo`
    POST /v1/chat/completions   messages through the checkpoint's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while every rank runs, else 503 with the engine's error
    GET  /metrics               Prometheus text (`metrics.py`)
    POST /tokenize, /detokenize vLLM's tokenizer endpoints (`extra.py`)
    GET  /version               opweave's version
    GET|POST /ping              as /health (vLLM's and SageMaker's probe)

A request is validated (`protocol.py`), tokenized, checked against the plan's context, and submitted
to the engine, whose events arrive on an engine thread and are handed to the request's asyncio queue.
Tokens become text through `tokenizer.TextStream`; a stop string cancels the request in the engine
and finishes it with "stop". A client that goes away (mid-stream, or while waiting for a whole
response) cancels its request, which frees its batch slot within a round. A full queue is a 429 with
`Retry-After`; an engine that fails mid-request ends the request with a 5xx, or, once a stream has
started, with an error event (`data: {"error": ...}`) before `data: [DONE]`. A 5xx tells the client
only a generic message and the request id (`X-Request-Id`); the details go to the log under that id.
Limits on hosts, keys, sizes, times and connections are `guard.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from opweave.errors import OpWeaveError
from opweave.serve import extra, guard, protocol
from opweave.serve.engine import QueueFull, Sampling, SamplingError
from opweave.serve.logprobs import Formatter, entries
from opweave.serve.metrics import CONTENT_TYPE, Metrics
from opweave.serve.protocol import ApiError
from opweave.serve.tokenizer import TextStream, Tokenizer

RETRY_AFTER_S = 1            # what a 429 asks the client to wait
GRACEFUL_SHUTDOWN_S = 30.0   # running requests may finish this long after SIGTERM
HEALTH_POLL_S = 0.5          # how often the runner looks at the engine's health
log = logging.getLogger("opweave.serve")


def make_app(engine, tokenizer: Tokenizer, served_model_name: str | None = None,
             max_request_bytes: int = guard.MAX_REQUEST_BYTES, body_timeout_s: float = guard.BODY_TIMEOUT_S,
             api_key: str | None = None, allowed_hosts: frozenset[str] | None = None) -> FastAPI:
    """The app serving `engine` (already started) under `served_model_name` (default: the plan's model).

    The other arguments go to `guard.Guard`: body size and time limits, the API key (None: none),
    the accepted Host names (None: any).
    """
    name = served_model_name or engine.model
    metrics = Metrics(engine, name)
    app = FastAPI(title="OpWeave", docs_url=None, redoc_url=None, openapi_url=None)
    created = protocol.now()

    def count_error(status: int) -> None:
        metrics.http_errors.labels(str(status)).inc()

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, exc: ApiError):
        count_error(exc.status)
        body = exc.body()
        if exc.status >= 500:  # the details (an engine's error) go to the log, not to the client
            body = _server_error(guard.request_id(request.scope), exc.status, exc.message)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(protocol.error_body(str(exc.detail), protocol.error_type(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine.healthy:
            return {"status": "ok"}
        return JSONResponse(protocol.error_body(engine.error or "the engine is not running", "server_error"),
                            status_code=503)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "opweave", "max_model_len": engine.context}]}

    async def generate(http: HttpRequest, parse) -> Response:
        arrival = time.monotonic()
        req = parse(protocol.load_json(await http.body()))
        protocol.check_model(req.model, name)
        ids = _prompt_ids(req, tokenizer)
        sampling = _sampling(req, len(ids), engine.context, getattr(tokenizer, "sampling_defaults", (0.0, 1.0)),
                             engine.vocab_size, getattr(engine, "max_logprobs", None))
        echo = ""
        if req.echo:  # the prompt as given, or a token-id prompt decoded (as OpenAI and vLLM do)
            echo = req.text if req.text is not None else extra.decode_prompt(tokenizer, ids)
        runs = [_Run(engine, metrics, tokenizer, req, ids, arrival) for _ in range(req.n)]
        for run in runs[1:]:  # one response: the choices share its id and time
            run.rid, run.created = runs[0].rid, runs[0].created
        try:
            for i, run in enumerate(runs):  # choice i: its own sequence, seed + i when seeded
                seed = None if sampling.seed is None else sampling.seed + i
                run.submit(ids, dataclasses.replace(sampling, seed=seed), count_prompt=i == 0)
        except ApiError:
            for run in runs:  # nothing half-submitted: the choices already queued are cancelled
                run.close()
            raise
        if req.stream:
            return _EventStream(_stream(runs, guard.request_id(http.scope), echo), lambda: [r.close() for r in runs],
                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watch = asyncio.create_task(_cancel_on_disconnect(http, runs))
        try:
            texts = await asyncio.gather(*(_text(run, runs) for run in runs))
        finally:
            watch.cancel()
            for run in runs:
                run.close()
        failed = next((run for run in runs if run.error is not None), None)
        if failed is not None:
            raise ApiError(failed.error_status, failed.error)
        choices = [(echo + text, run.finish, run.logprobs_body(items)) for (text, items), run in zip(texts, runs)]
        return JSONResponse(protocol.response(req, runs[0].rid, runs[0].created, choices, _usage(runs)))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await generate(http, protocol.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await generate(http, protocol.parse_chat)

    extra.add_routes(app, engine, tokenizer, name, health)
    app.add_middleware(guard.Guard, max_request_bytes=max_request_bytes, body_timeout_s=body_timeout_s,
                       api_key=api_key, allowed_hosts=allowed_hosts, on_error=count_error)
    app.state.metrics = metrics
    return app


def _server_error(rid: str, status: int, detail: str) -> dict:
    """Logs a 5xx's detail under the request id; the generic body the client gets instead."""
    (log.error if status == 500 else log.warning)("request %s: %d: %s", rid, status, detail)
    return guard.server_error_body(status, rid)


def _prompt_ids(req: protocol.Request, tokenizer: Tokenizer) -> list[int]:
    if req.token_ids is not None:
        return list(req.token_ids)
    if req.messages is not None:
        try:
            return tokenizer.encode_chat(list(req.messages))
        except ValueError as e:
            raise ApiError(400, str(e).splitlines()[0], param="messages") from None
        except Exception as e:  # noqa: BLE001 - a chat template that fails on these messages (jinja)
            raise ApiError(400, f"the chat template failed on these messages: {str(e).splitlines()[0]}",
                           param="messages") from None
    ids = tokenizer.encode(req.text)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def _sampling(req: protocol.Request, prompt_len: int, context: int,
              defaults: tuple[float, float] = (0.0, 1.0), vocab_size: int | None = None,
              max_logprobs: int | None = None) -> Sampling:
    """The engine's sampling parameters; 400 when prompt + output cannot fit in the planned context
    or a value is out of the sampler's range (`Sampling.check`, naming the field)."""
    param = "messages" if req.kind == "chat" else "prompt"
    if prompt_len >= context:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; the model's context of {context} allows at "
                            f"most {context - 1}", param=param, code="context_length_exceeded")
    room = context - prompt_len
    if req.max_tokens is None:
        max_tokens = room if req.kind == "chat" else min(protocol.COMPLETION_DEFAULT_MAX_TOKENS, room)
    elif req.max_tokens > room:
        raise ApiError(400, f"max_tokens {req.max_tokens} + the prompt's {prompt_len} tokens exceed the model's "
                            f"context of {context}", param="max_tokens", code="context_length_exceeded")
    else:
        max_tokens = req.max_tokens
    temperature = defaults[0] if req.temperature is None else req.temperature
    top_p = defaults[1] if req.top_p is None else req.top_p
    sampling = Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=req.seed,
                        stop_token_ids=req.stop_token_ids, top_k=req.top_k, min_p=req.min_p,
                        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                        prompt_logprobs=req.prompt_logprobs)
    if vocab_size is not None:
        try:
            sampling.check(vocab_size, max_logprobs)
        except SamplingError as e:
            top = req.kind == "chat" and e.param == "logprobs" and bool(req.logprobs)  # chat's count is top_logprobs
            param = "top_logprobs" if top else e.param
            raise ApiError(400, str(e), param=param) from None
    return sampling


class _Run:
    """One request in the engine: its event queue, text stream, counts and outcome."""

    def __init__(self, engine, metrics: Metrics, tokenizer: Tokenizer, req: protocol.Request,
                 prompt_ids: list[int], arrival: float):
        self.engine, self.metrics, self.req = engine, metrics, req
        self.prompt_ids = prompt_ids
        self.formatter = None if req.logprobs is None else Formatter(
            tokenizer, req.kind, req.logprobs, previous=None if req.prompt_logprobs else prompt_ids[-1])
        self._entries: list = []  # log-probability entries not yet handed out with a piece
        self.text = TextStream(tokenizer, req.stop)
        # Tokens that end the request are counted but are not text (as OpenAI and vLLM do).
        eos = frozenset() if req.ignore_eos else frozenset(engine.eos_token_ids)
        self._ending_ids = eos | frozenset(req.stop_token_ids)
        self.rid, self.created = protocol.new_id(req.kind), protocol.now()
        self.prompt_tokens, self.tokens = len(prompt_ids), 0
        self.arrival, self.first, self.last = arrival, None, None
        self.finish: str | None = None
        self.error: str | None = None
        self.error_status = 500
        self.id: int | None = None
        self.done = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def submit(self, ids: list[int], sampling: Sampling, count_prompt: bool = True) -> None:
        """Queues the request in the engine (`count_prompt`: its prompt tokens count in the
        metrics; a request's further choices share its prompt)."""
        loop = asyncio.get_running_loop()

        def on_event(event) -> None:  # an engine thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped
                loop.call_soon_threadsafe(self._queue.put_nowait, event)

        try:
            self.id = self.engine.submit(ids, sampling, on_event)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:  # SamplingError names its field
            raise ApiError(400, str(e).splitlines()[0], param=getattr(e, "param", None)) from None
        except RuntimeError as e:
            raise ApiError(503, f"the engine is not running: {str(e).splitlines()[0]}") from None
        if count_prompt:
            self.metrics.prompt_tokens.inc(self.prompt_tokens)

    async def pieces(self):
        """The response's text, piece by piece, until the request ends (then `finish` or `error` is
        set): (text, the log-probability entries of the tokens since the last piece; [] when the
        request asks for none)."""
        while not self.done:
            event = await self._queue.get()
            if event.token is not None:
                self._token()
                self._learn_logprobs(event)
                piece = "" if event.token in self._ending_ids else self.text.add(event.token)
                if self.text.stopped:
                    self._end("stop")
                    self.engine.cancel(self.id)  # a stop string: the engine need not go on
                if piece or (self.done and self._entries):  # a stop string ends it: its figures go too
                    yield piece, self._take_entries()
                continue
            if event.finish_reason in ("stop", "length"):
                tail = self.text.flush()
                self._end(event.finish_reason)
                if tail or self._entries:
                    yield tail, self._take_entries()
            elif event.finish_reason == "cancelled":
                self._end("cancelled", 503, event.error or "the request was cancelled: the server is stopping")
            else:
                self._end("error", 500, f"the engine failed: {event.error or 'no reason given'}")

    def _learn_logprobs(self, event) -> None:
        if self.formatter is None:
            return
        if self.req.prompt_logprobs and event.prompt_logprobs is not None:  # the echoed prompt's, first
            self._entries += entries(self.prompt_ids, (None,) + tuple(event.prompt_logprobs))
        self._entries += entries([event.token], [event.logprob])

    def _take_entries(self) -> list:
        out, self._entries = self._entries, []
        return out

    def logprobs_body(self, items: list) -> dict | None:
        """The response's logprobs object for `items` (None when the request asks for none)."""
        return None if self.formatter is None else self.formatter.body(items)

    def _token(self) -> None:
        now = time.monotonic()
        self.metrics.token(arrival=self.arrival, previous=self.last, now=now, prompt_tokens=self.prompt_tokens)
        self.first = self.first or now
        self.last = now
        self.tokens += 1

    def _end(self, reason: str, status: int = 500, error: str | None = None) -> None:
        if self.done:
            return
        self.done, self.finish = True, reason
        self.error, self.error_status = error, status
        self.metrics.finished(reason, self.arrival, self.first, self.last, self.tokens, self.prompt_tokens)

    def close(self) -> None:
        """The response is over or abandoned: a request still in the engine is cancelled."""
        if not self.done and self.id is not None:
            self._end("cancelled")
            self.engine.cancel(self.id)


async def _text(run: _Run, runs: list[_Run]) -> tuple[str, list]:
    """A choice's whole text and log-probability entries; when it fails (`run.error` says why),
    the request's other choices (`runs`) are cancelled rather than waited for."""
    pieces, items = [], []
    async for piece, entries_ in run.pieces():
        pieces.append(piece)
        items += entries_
    if run.error is not None:
        for other in runs:
            other.close()
    return "".join(pieces), items


def _usage(runs: list[_Run]) -> dict:
    """The response's usage: the prompt once, the tokens of every choice."""
    return protocol.usage(runs[0].prompt_tokens, sum(run.tokens for run in runs))


async def _stream(runs: list[_Run], rid: str, echo: str = ""):
    """The response's server-sent events, the choices' pieces as they come (each chunk names its
    choice); `echo` (the prompt's text) is each completion choice's first chunk. A failing choice
    ends the stream with an error event."""
    run, req = runs[0], runs[0].req
    for i in range(len(runs)):
        if req.kind == "chat":
            yield protocol.sse(protocol.chunk(req, run.rid, run.created, None, None, role=True, index=i))
        if echo:
            yield protocol.sse(protocol.chunk(req, run.rid, run.created, echo, None, index=i))
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, choice: _Run) -> None:
        try:
            async for piece in choice.pieces():
                await queue.put((i, piece))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, choice)) for i, choice in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, piece = await queue.get()
            choice = runs[i]
            if piece is not None:
                text, items = piece
                yield protocol.sse(protocol.chunk(req, run.rid, run.created, text, None, index=i,
                                                  logprobs=choice.logprobs_body(items)))
                continue
            left -= 1
            if choice.error is not None:
                body = _server_error(rid, choice.error_status, choice.error)
                body["error"]["code"] = str(choice.error_status)
                yield protocol.sse(body)
                yield protocol.sse("[DONE]")
                return
            yield protocol.sse(protocol.chunk(req, run.rid, run.created, None if req.kind == "chat" else "",
                                              choice.finish, index=i))
    finally:
        for task in tasks:
            task.cancel()
    if req.include_usage:
        yield protocol.sse(protocol.usage_chunk(req, run.rid, run.created, _usage(runs)))
    yield protocol.sse("[DONE]")


class _EventStream(StreamingResponse):
    """A streaming response that calls `on_close` however it ends (finished, client gone, cancelled)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _cancel_on_disconnect(http: HttpRequest, runs: list[_Run]) -> None:
    """Waits for the client of a non-streaming request to go away, then cancels its choices."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            for run in runs:
                run.close()
            return


# ---------------------------------------------------------------- runner
def _uvicorn_server(config):
    """uvicorn's server, except that SIGINT/SIGTERM/SIGHUP stop it gracefully and are not raised again.

    (uvicorn re-raises a caught signal once it has shut down, so the process would die of it; a server
    stopped on request exits 0 instead.)
    """
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


def run_server(engine, tokenizer: Tokenizer, served_model_name: str | None, host: str, port: int,
               graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S, log_level: str = "info",
               max_request_bytes: int = guard.MAX_REQUEST_BYTES, body_timeout_s: float = guard.BODY_TIMEOUT_S,
               header_timeout_s: float = guard.HEADER_TIMEOUT_S, max_connections: int = guard.MAX_CONNECTIONS,
               api_key: str | None = None, allowed_hosts: tuple[str, ...] = ()) -> int:
    """Serves a started `engine` until a signal (exit status 0) or the engine fails (1); stops the engine.

    On SIGTERM/SIGINT the server stops accepting connections, lets running requests finish for up to
    `graceful_shutdown_s` (then cancels them), and stops the engine. The limits, the API key and
    the Host names besides loopback (`allowed_hosts`, '*' for any) are described in `guard.py`.
    """
    import uvicorn

    app = make_app(engine, tokenizer, served_model_name, max_request_bytes=max_request_bytes,
                   body_timeout_s=body_timeout_s, api_key=api_key,
                   allowed_hosts=guard.allowed_hosts(host, allowed_hosts))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_shutdown_s, lifespan="off", access_log=False,
                            http=guard.h11_protocol(header_timeout_s, max_connections))
    server = _uvicorn_server(config)

    async def main() -> None:
        async def watch() -> None:
            while engine.healthy and not server.should_exit:
                await asyncio.sleep(HEALTH_POLL_S)
            server.should_exit = True

        watcher = asyncio.create_task(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    except SystemExit:  # uvicorn exits when it cannot listen (the reason is in its log)
        raise OpWeaveError(f"cannot serve on {host}:{port} (see the log above)") from None
    finally:
        failed = not engine.healthy
        engine.stop()
    return 1 if failed else 0
