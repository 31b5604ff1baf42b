"""HTTP hardening: an ASGI middleware in front of the app and a stricter uvicorn protocol.

`Guard` (added by `app.make_app`) gives every request an id, sent back as `X-Request-Id`, then:
- refuses a `Host` that is not allowed (400), a missing or wrong API key (401), a declared
  `Content-Length` above the limit (413) before reading any of the body;
- cuts a body that grows past the limit (413) or is not received within the body timeout (408);
- ends quietly a request whose client left during its upload;
- answers an unexpected exception with a generic 500 naming the request id, and logs the
  traceback under that id.

`h11_protocol(...)` is uvicorn's h11 protocol plus what uvicorn lacks: a connection whose request
head is not complete within the header timeout is closed (slowloris), and a connection beyond the
open-connection cap is answered 503 and closed at once.

Only the standard library is imported here at module level: the CLI parses its flags with it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import uuid

from opweave.errors import OpWeaveError
from opweave.serve import protocol

MAX_REQUEST_BYTES = 4 << 20   # a request body above this is a 413
BODY_TIMEOUT_S = 30.0         # the whole body must arrive within this after the request head
HEADER_TIMEOUT_S = 10.0       # the request head must arrive within this after the connection or its first byte
MAX_CONNECTIONS = 1024        # open connections; more are answered 503 and closed
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # reachable without the API key (as in vLLM)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
REQUEST_ID = "opweave.request_id"                 # the scope key holding the request id

log = logging.getLogger("opweave.serve")
_CLOSE = {"Connection": "close"}


def request_id(scope) -> str:
    """The id `Guard` gave this request ("-" outside it)."""
    return scope.get(REQUEST_ID, "-")


def server_error_body(status: int, rid: str) -> dict:
    """A generic 5xx body: the details stay in the server's log, under `rid`."""
    if status == 503:
        message = f"the server cannot take this request now; retry later (request id {rid})"
    else:
        message = f"the server failed on this request; its log has the details (request id {rid})"
    return protocol.error_body(message, "server_error")


class Guard:
    """ASGI middleware: request id, Host and API key checks, body limits, quiet disconnects, generic 500s."""

    def __init__(self, app, max_request_bytes: int = MAX_REQUEST_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
                 api_key: str | None = None, allowed_hosts: frozenset[str] | None = None, on_error=None):
        from starlette.requests import ClientDisconnect

        self.app, self.max_request_bytes, self.body_timeout_s = app, max_request_bytes, body_timeout_s
        self._key = None if api_key is None else api_key.encode()
        self.allowed_hosts = allowed_hosts  # None: any Host
        self._on_error = on_error or (lambda status: None)
        self._gone = ClientDisconnect

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = scope[REQUEST_ID] = uuid.uuid4().hex
        headers = _headers(scope)
        has_body = b"transfer-encoding" in headers or headers.get(b"content-length", [b"0"])[0] != b"0"
        state = {"started": False, "body_done": not has_body}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                extra = [(b"x-request-id", rid.encode())]
                if not state["body_done"]:  # the body was not read: do not read it on this connection
                    extra.append((b"connection", b"close"))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            self._check(scope, headers)
            await self.app(scope, self._receive(receive, state), send_wrapper)
        except protocol.ApiError as e:
            if not state["started"]:
                await self._answer(send_wrapper, e.status, e.body(), e.headers)
        except self._gone:
            log.debug("request %s: the client left during its upload", rid)
        except Exception:  # noqa: BLE001 - a bug: the client gets a generic 500, the log the traceback
            log.exception("request %s failed", rid)
            if not state["started"]:
                await self._answer(send_wrapper, 500, server_error_body(500, rid), _CLOSE)

    def _check(self, scope, headers: dict[bytes, list[bytes]]) -> None:
        """Raises ApiError for a refused Host, a missing API key, or a declared body above the limit."""
        if self.allowed_hosts is not None:
            hosts = headers.get(b"host", [])
            name = host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else None
            if name not in self.allowed_hosts:
                shown = " ".join(h.decode("latin-1") for h in hosts)[:80] or "(none)"
                raise protocol.ApiError(400, f"the Host header {shown!r} is not served here (see --allowed-hosts)",
                                        code="host_not_allowed", headers=_CLOSE)
        if self._key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", [b""])[0].strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                raise protocol.ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        declared = headers.get(b"content-length", [b"0"])[0]
        if declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_request_bytes):
            raise protocol.ApiError(413, f"the request body of {declared[:20].decode()} bytes is over the limit "
                                         f"of {self.max_request_bytes} bytes", code="request_too_large",
                                    headers=_CLOSE)

    def _receive(self, receive, state: dict):
        """`receive`, with the body's size capped and its reading bounded in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        size = 0

        async def wrapped():
            nonlocal size
            if state["body_done"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise protocol.ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                        code="request_timeout", headers=_CLOSE) from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_request_bytes:
                    raise protocol.ApiError(413, f"the request body is over the limit of {self.max_request_bytes} "
                                                 "bytes", code="request_too_large", headers=_CLOSE)
            state["body_done"] = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return wrapped

    async def _answer(self, send, status: int, body: dict, headers: dict[str, str]) -> None:
        self._on_error(status)
        raw = json.dumps(body).encode()
        pairs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        pairs += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": pairs})
        await send({"type": "http.response.body", "body": raw})


def _headers(scope) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in scope.get("headers", []):
        out.setdefault(name.lower(), []).append(value)
    return out


def host_name(value: str) -> str | None:
    """The name in a Host header, lower case, without port or brackets: '[::1]:8000' -> '::1'; None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, port = value[1:].partition("]")
        if not sep or (port and not re.fullmatch(r":\d*", port)):
            return None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
        if not re.fullmatch(r"\d*", port):
            return None
    else:
        name = value  # a bare name, or a bare IPv6 address
    name = name.rstrip(".") if name != "." else name
    return name or None


def allowed_hosts(bind_host: str, extra: list[str] | tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names to accept, None for any; '*' in `extra` accepts any.

    Bound to loopback: the loopback names, the bound name and `extra`. Bound elsewhere: any Host,
    unless `extra` is given (then the loopback names and `extra`).
    """
    names = {host_name(e) or e.strip().lower() for e in extra if e.strip()}
    if "*" in names:
        return None
    bind = host_name(bind_host) or bind_host.lower()
    if bind in LOOPBACK_NAMES or bind.startswith("127."):
        return LOOPBACK_NAMES | {bind} | names
    return LOOPBACK_NAMES | names if names else None


# ---------------------------------------------------------------- uvicorn protocol
def h11_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int | None = MAX_CONNECTIONS,
                 retry_after_s: int = 1):
    """uvicorn's H11Protocol with a request-head timeout and an open-connection cap (pass as `Config(http=...)`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _raw_response(503, protocol.error_body("the server has too many open connections; retry later",
                                                  "server_error", code="too_many_connections"),
                         retry_after=retry_after_s)

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                log.warning("refused a connection: %d are open (the limit is %d)", len(self.connections) - 1,
                            max_connections)
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on a kept-alive connection has begun
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # a malformed request or a head over h11's size limit
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response begun on this connection
                self.transport.write(_raw_response(400, protocol.error_body(f"invalid HTTP request: {msg}",
                                                                            "invalid_request_error")))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug("closed a connection whose request head did not arrive within %g s", header_timeout_s)
                self.transport.close()

    return GuardedH11Protocol


def _raw_response(status: int, body: dict, retry_after: int | None = None) -> bytes:
    import http

    raw = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(raw)}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


# ---------------------------------------------------------------- flag values
_SIZE = re.compile(r"^\s*(\d+)\s*(|k|m|g|kib|mib|gib)\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str = "size") -> int:
    """`4194304`, `4m`, `4MiB`, `512k` -> a positive number of bytes (k, m, g are powers of 1024)."""
    m = _SIZE.match(text)
    shown = text if len(text) <= 40 else text[:40] + "..."
    if not m or len(m.group(1)) > 15 or int(m.group(1)) <= 0:
        raise OpWeaveError(f"bad {flag} '{shown}' (expected a positive number of bytes, e.g. 4194304, 512k, 4m)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()[:1]]


def parse_seconds(text: str, flag: str = "timeout") -> float:
    """`30`, `0.5` -> a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise OpWeaveError(f"bad {flag} '{shown}' (expected a positive number of seconds, e.g. 30)")
    return value


def parse_count(text: str, flag: str = "count") -> int:
    """`1024` -> a positive whole number."""
    if not re.fullmatch(r"\s*\d{1,9}\s*", text) or int(text) <= 0:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise OpWeaveError(f"bad {flag} '{shown}' (expected a positive whole number, e.g. 1024)")
    return int(text)


def parse_hosts(text: str) -> list[str]:
    """`example.com,10.0.0.5` or `*` -> the names to accept in `Host` besides loopback."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n != "*" and host_name(n) is None for n in names):
        raise OpWeaveError(f"bad --allowed-hosts '{text[:80]}' (expected a comma list of host names, or *)")
    return names


def parse_api_key(text: str) -> str:
    if not text.strip() or any(c.isspace() or not c.isprintable() for c in text):
        raise OpWeaveError("bad --api-key (expected a non-empty token without spaces)")
    return text
