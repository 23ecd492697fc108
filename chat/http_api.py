"""The OpenAI-compatible HTTP API (FastAPI): routes, auth, streaming, the bounded queue.

    /v1/models              the one model
    /v1/chat/completions    streaming (server-sent events ending with `data: [DONE]`) or not
    /v1/completions         a plain prompt, answered as one user message

`create_api(service, config)` is an app to mount at "/v1" beside the Gradio UI (app.py) or
serve alone (`ApiServer`, app.py --api-only). The logic is in chat/api.py; here each handler
parses the body, runs the request on a worker thread and relays its Progress.

Threading: a request's reply runs wholly on its own thread (the engine gate is held across
the reply's yields by one thread), relayed to the event loop through an asyncio queue. A
client that disconnects stops its reply (`ChatService.stop`) within one decode step.
At most `max_pending` requests are admitted (running or waiting for the engine); more get
429 with Retry-After.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import threading
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .api import ApiConfig, ApiError, ChatApi, ChatRequest, Progress

_SESSION_HEADER = "X-Session-Id"
_DISCONNECT_POLL_S = 0.25


class Admission:
    """A counter of admitted requests; `enter` raises 429 when `limit` are in."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s = limit, retry_after_s
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self._count >= self.limit:
                raise ApiError(429, f"the server is busy: {self.limit} requests are running or queued; retry later",
                               code="rate_limit_exceeded", kind="rate_limit_error",
                               headers={"Retry-After": str(self.retry_after_s)})
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1


class Generation:
    """One request's reply on its own thread, its Progress relayed to an asyncio queue."""

    def __init__(self, api: ChatApi, request: ChatRequest, session_hint: str | None):
        self.api, self.request, self.hint = api, request, session_hint
        self.session_id: str | None = None
        self.abandoned = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.checked = self.loop.time()  # when the client's connection was last checked (non-streaming)
        self.thread = threading.Thread(target=self._work, name="api-generation", daemon=True)

    def start(self, on_done) -> None:
        self._on_done = on_done
        self.thread.start()

    def _put(self, item) -> None:
        if not self.loop.is_closed():  # a server shutting down no longer listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _work(self) -> None:
        replies = self.api.run(self.request, self.hint)
        try:
            for progress in replies:
                self.session_id = progress.session_id
                self._put(progress)
                if self.abandoned.is_set():
                    replies.close()  # the service stores the text so far and stops, like Stop
                    break
        except Exception as error:  # relayed: ApiError/ChatError answer the client, others are a 500
            self._put(error)
        finally:
            self._put(None)
            self._on_done()

    def cancel(self) -> None:
        """The client went away: stop the reply within one decode step."""
        self.abandoned.set()
        if self.session_id is not None:
            self.api.service.stop(self.session_id)

    async def next(self, request: Request | None = None) -> Progress | None:
        """The next Progress (None at the end); raises the worker's error. With `request`, polls
        for a disconnect while waiting (and cancels); a streaming response needs no polling: the
        server cancels its body on a disconnect."""
        item = await (self.queue.get() if request is None else self._watching(request))
        if isinstance(item, Exception):
            raise item
        return item

    async def _watching(self, request: Request):
        """The next item, checking for a disconnect every _DISCONNECT_POLL_S also while items keep
        coming (a fast reply never leaves the queue idle for a whole poll)."""
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() - self.checked >= _DISCONNECT_POLL_S:
                self.checked = loop.time()
                if await request.is_disconnected():
                    self.cancel()
                    raise asyncio.CancelledError("client disconnected")
            try:
                return await asyncio.wait_for(self.queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _translate(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, LookupError):
        return ApiError(404, str(error), code="not_found")
    if isinstance(error, ValueError):  # ChatError and bad input: the message says how to fix it
        return ApiError(400, str(error))
    return ApiError(500, f"internal error: {error!r}", kind="server_error")


def _is_loopback(host: str | None) -> bool:
    if host in ("localhost", "testclient"):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def check_access(config: ApiConfig, headers, client_host: str | None) -> None:
    """401 without the right bearer key (when one is set); 403 for remote clients without one."""
    if config.api_key:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (the server's "
                                "API key, by default its password)", code="invalid_api_key",
                           kind="authentication_error")
    elif not config.allow_remote and not _is_loopback(client_host):
        raise ApiError(403, "this server answers API requests from other machines only with an API key; start "
                            "it with --password or --api-key (or --api-allow-remote)", code="forbidden",
                       kind="permission_error")


async def _json_body(request: Request, limit: int) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit:,} bytes", code="request_too_large")
    body = await request.body()
    if len(body) > limit:
        raise ApiError(413, f"the request body is larger than {limit:,} bytes", code="request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from error


class _Shapes:
    """OpenAI's response objects for chat ("chat.completion") or plain ("text_completion")."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _wrap(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def whole(self, final: Progress) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "finish_reason": final.finish, "logprobs": None}
            return self._wrap("chat.completion", [choice], final.usage())
        choice = {"index": 0, "text": final.text, "finish_reason": final.finish, "logprobs": None}
        return self._wrap("text_completion", [choice], final.usage())

    def chunk(self, delta: str, finish: str | None = None, first: bool = False) -> dict:
        if self.chat:
            content = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
            return self._wrap("chat.completion.chunk", [choice])
        return self._wrap("text_completion", [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}])

    def usage_chunk(self, final: Progress) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], final.usage())


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def create_api(service, config: ApiConfig = ApiConfig()) -> FastAPI:
    """The API app (routes relative to its mount point, "/v1")."""
    api = ChatApi(service, config)
    admission = Admission(config.max_pending, config.retry_after_s)
    def guard(request: Request) -> None:  # a dependency, not an HTTP middleware: those break streaming disconnects
        check_access(config, request.headers, request.client.host if request.client else None)

    app = FastAPI(title="Spotlight Chat API", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(guard)])
    app.state.chat_api = api
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", _SESSION_HEADER],
                           expose_headers=[_SESSION_HEADER])

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError):
        return _error_response(error)

    @app.get("/models")
    async def models():
        return {"object": "list", "data": [_model(config)]}

    @app.get("/models/{model_id}")
    async def model(model_id: str):
        if model_id != config.model_name:
            raise ApiError(404, f"no model {model_id!r}; this server has {config.model_name!r}", param="model",
                           code="model_not_found")
        return _model(config)

    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        parsed = api.parse_chat(await _json_body(request, config.max_body_bytes))
        return await _answer(api, admission, request, parsed, _Shapes(config.model_name, chat=True))

    @app.post("/completions")
    async def completions(request: Request):
        parsed = api.parse_completion(await _json_body(request, config.max_body_bytes))
        return await _answer(api, admission, request, parsed, _Shapes(config.model_name, chat=False))

    return app


def api_routes(service, config: ApiConfig = ApiConfig()) -> list:
    """The API mounted at /v1, as routes for another app (Gradio's: `launch(app_kwargs={"routes": ...})`)."""
    from starlette.routing import Mount

    return [Mount("/v1", app=create_api(service, config))]


def _model(config: ApiConfig) -> dict:
    return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "spotlight-chat"}


async def _answer(api: ChatApi, admission: Admission, request: Request, parsed: ChatRequest, shapes: _Shapes):
    """Admit, start the reply, wait for its first Progress (so errors get a status), then answer."""
    admission.enter()
    generation = Generation(api, parsed, request.headers.get(_SESSION_HEADER))
    generation.start(admission.leave)
    try:
        first = await generation.next(request)
    except Exception as error:
        raise _translate(error) from error
    if first is None:
        raise ApiError(500, "the reply ended without output", kind="server_error")
    headers = {_SESSION_HEADER: first.session_id}
    if not parsed.stream:
        final = first
        while (progress := await generation.next(request)) is not None:
            final = progress
        return JSONResponse(shapes.whole(final), headers=headers)
    return StreamingResponse(_events(generation, request, parsed, shapes, first), media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache"})


async def _events(generation: Generation, request: Request, parsed: ChatRequest, shapes: _Shapes, first: Progress):
    sent, final, progress = 0, first, first
    yield _sse(shapes.chunk("", first=True) if shapes.chat else shapes.chunk(""))
    try:
        while progress is not None:
            final = progress
            if len(progress.text) > sent:
                yield _sse(shapes.chunk(progress.text[sent:]))
                sent = len(progress.text)
            progress = await generation.next()
    except asyncio.CancelledError:
        generation.cancel()
        raise
    except Exception as error:  # after the headers went out: report in the stream, as OpenAI does
        yield _sse(_translate(error).body())
        return
    finally:
        if progress is not None:
            generation.cancel()
    yield _sse(shapes.chunk("", finish=final.finish))
    if parsed.include_usage:
        yield _sse(shapes.usage_chunk(final))
    yield _sse("[DONE]")


class ApiServer:
    """The API alone on uvicorn in a background thread (app.py --api-only runs it in the foreground).

        server = ApiServer(service, ApiConfig(), port=8000).start()   # server.url
        server.close()
    """

    def __init__(self, service, config: ApiConfig = ApiConfig(), host: str = "127.0.0.1", port: int = 8000):
        import uvicorn

        root = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, routes=api_routes(service, config))
        self.url = f"http://{host}:{port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(root, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        """Serve in this thread until interrupted."""
        self.server.run()

    def start(self) -> "ApiServer":
        self.thread = threading.Thread(target=self.server.run, name="api-server", daemon=True)
        self.thread.start()
        while not self.server.started:  # bounded by uvicorn's own startup; a failed bind ends the thread
            if not self.thread.is_alive():
                raise RuntimeError(f"the API server did not start on {self.url}; is the port in use?")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
