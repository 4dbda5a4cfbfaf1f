"""The FastAPI app: OpenAI-compatible endpoints over one `EngineLoop`.

`create_app(engine, model_name)` builds it; the engine thread starts and stops with the
app's lifespan. Handlers validate and tokenize on the event loop (cheap), then wait on
the request's queue while the engine thread generates.

Each concern has its own function below (errors, API key, /v1 routes, operations
routes, reading the body, answering whole or streamed); the handlers they register
share one `Served`. Endpoints carry no return annotation on purpose: FastAPI would
take it for a response model and validate every answer against it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..base.errors import SpecMoEError
from . import metrics, openapi, tokens
from .logprobs import LogprobsWriter, merge
from .loop import EngineLoop, RequestHandle
from .protocol import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    MAX_BODY_BYTES,
    READ_METHODS,
    APIError,
    GenerateRequest,
    chunk,
    new_id,
    parse_chat,
    parse_completion,
    parse_json,
    response,
    sse,
    usage,
)
from .ui import ui_router

log = logging.getLogger("specmoe.server")

CLIENT_CLOSED = 499  # the status logged for a request whose client left (nginx's convention)


@dataclass
class Served:
    """What the handlers share: the engine, the thread that runs it, and the app's settings and counters."""

    engine: Any
    model_name: str
    loop: EngineLoop
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS  # the most tokens one request may generate
    started: int = field(default_factory=lambda: int(time.time()))  # the model card's `created`
    http_errors: Counter[int] = field(default_factory=Counter)  # error responses by status, for /metrics
    # a replica of several (specmoe serve --replicas): async (served) -> the /metrics text of them all
    cluster_metrics: Callable[[Served], Awaitable[str]] | None = None


def create_app(engine, model_name: str, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS, ui: bool = True,
               cluster_metrics=None) -> FastAPI:
    """The app serving `engine` under `model_name`; with `api_key`, /v1 needs `Authorization: Bearer KEY`;
    a request generates at most `max_output_tokens` (None: as many as the context holds);
    with `ui`, the web page is at / (server/ui.py); `cluster_metrics` adds other replicas' counters to /metrics."""
    served = Served(engine, model_name, EngineLoop(engine), api_key, max_body_bytes, max_output_tokens,
                    cluster_metrics=cluster_metrics)
    app = FastAPI(title="specmoe", lifespan=run_engine_loop, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = openapi_document(served)
    app.state.engine_loop = served.loop
    app.state.served = served
    add_error_handlers(app, served)
    app.include_router(v1_router(served))
    app.include_router(tokenizer_router(served))
    add_operations_routes(app, served)
    if ui:
        app.include_router(ui_router(served.loop, model_name, require_api_key(api_key), api_key is not None))
    return app


def openapi_document(served: Served) -> Callable[[], dict]:
    """/openapi.json, written out (the handlers read raw bodies) for this model; built once, when first asked."""

    @functools.cache
    def document() -> dict:
        return openapi.document(openapi.served_model(served.engine, served.model_name, served.api_key is not None,
                                                     served.max_output_tokens))

    return document


@asynccontextmanager
async def run_engine_loop(app: FastAPI):
    """The app's lifespan: the engine thread runs while the app serves."""
    loop: EngineLoop = app.state.engine_loop
    loop.start()
    try:
        yield
    finally:
        await run_in_threadpool(loop.stop)  # stop() joins the thread: not on the event loop


# --- errors: always the OpenAI error object ------------------------------------------------


def error_response(served: Served, err: APIError, headers: dict | None = None) -> JSONResponse:
    served.http_errors[err.status] += 1
    if err.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def http_error_message(request: Request, exc: StarletteHTTPException) -> str:
    """Starlette's own errors (unknown path, wrong method) in the words OpenAI's API uses."""
    if exc.status_code == 404:
        return f"Invalid URL ({request.method} {request.url.path})"
    if exc.status_code == 405:
        return f"Method {request.method} is not allowed for {request.url.path}"
    return str(exc.detail)


def allowed_methods(exc: StarletteHTTPException) -> str:
    """The `Allow` of a 405 (RFC 9110 requires it): the route's methods, which Starlette's
    exception carries, and OPTIONS, which every path answers."""
    methods = {m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()}
    return ", ".join(sorted(methods | {"OPTIONS"}))


def add_error_handlers(app: FastAPI, served: Served) -> None:
    async def on_api_error(request: Request, exc: APIError):
        return error_response(served, exc)

    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code != 405:
            return error_response(served, APIError(exc.status_code, http_error_message(request, exc)))
        allow = {"Allow": allowed_methods(exc)}
        if request.method == "OPTIONS":  # no route takes OPTIONS: the router's 405 says which methods do
            return Response(status_code=204, headers=allow)
        return error_response(served, APIError(405, http_error_message(request, exc)), allow)

    async def on_bug(request: Request, exc: Exception):  # a bug in the server, not the request
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(served, APIError(500, "internal server error; see the server log",
                                               code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_bug)


# --- /v1 ----------------------------------------------------------------------------------


def require_api_key(api_key: str | None):
    """The /v1 dependency: without a key anyone may call; with one, `Authorization: Bearer KEY`."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                           "with the key the server was started with (--api-key)", code="invalid_api_key")

    return authorize


def model_card(served: Served) -> dict:
    return {"id": served.model_name, "object": "model", "created": served.started, "owned_by": "specmoe",
            "max_model_len": served.engine.max_model_len}


def v1_router(served: Served) -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key(served.api_key))])
    model_name = served.model_name

    @v1.api_route("/models", methods=READ_METHODS)
    async def list_models():
        return {"object": "list", "data": [model_card(served)]}

    @v1.api_route("/models/{name:path}", methods=READ_METHODS)
    async def get_model(name: str):
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           "model", "model_not_found")
        return model_card(served)

    @v1.post("/completions")
    async def completions(request: Request):
        body = await read_body(request, served.max_body_bytes)
        return await generate(served, request, parse_completion(body, model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, served.max_body_bytes)
        if served.engine.config.seq2seq is not None:  # its answer would be the transcript, translated
            raise APIError(400, "this model translates (encoder-decoder) and does not chat: send the text to "
                           "/v1/completions, with src_lang and tgt_lang", "messages")
        return await generate(served, request, parse_chat(body, model_name, served.engine.tokenizer))

    return v1


def tokenizer_router(served: Served) -> APIRouter:
    """vLLM's /tokenizer_info, /tokenize and /detokenize (server/tokens.py), behind the API key like /v1."""
    router = APIRouter(dependencies=[Depends(require_api_key(served.api_key))])
    engine = served.engine

    @router.api_route("/tokenizer_info", methods=READ_METHODS)
    async def get_tokenizer_info():
        return tokens.tokenizer_info(engine.tokenizer, engine.max_model_len)

    @router.post("/tokenize")
    async def post_tokenize(request: Request):
        body = await read_body(request, served.max_body_bytes)
        return await run_in_threadpool(tokens.tokenize, body, engine.tokenizer, engine.max_model_len,
                                       served.model_name)

    @router.post("/detokenize")
    async def post_detokenize(request: Request):
        body = await read_body(request, served.max_body_bytes)
        return tokens.detokenize(body, engine.tokenizer, served.model_name)

    return router


# --- operations ---------------------------------------------------------------------------


def add_operations_routes(app: FastAPI, served: Served) -> None:
    """/health and /metrics: outside /v1, so they need no API key."""
    loop = served.loop

    @app.api_route("/health", methods=READ_METHODS)
    async def health():
        if loop.draining:  # a load balancer should send new requests elsewhere
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if loop.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": f"the engine loop stopped: {loop.error}"}, status_code=503)

    @app.api_route("/metrics", methods=READ_METHODS)
    async def get_metrics():
        if served.cluster_metrics is not None:
            text = await served.cluster_metrics(served)
        else:
            text = metrics.render(loop.stats, dict(served.http_errors), served.model_name)
        return Response(text, media_type=metrics.CONTENT_TYPE)


# --- generation ---------------------------------------------------------------------------


async def read_body(request: Request, max_body_bytes: int) -> dict:
    """The JSON body, read in parts so that an oversized one is refused before it is all in memory."""
    too_large = APIError(413, f"the request body is larger than {max_body_bytes} bytes", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise too_large
    raw = bytearray()
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > max_body_bytes:  # Content-Length may be absent (chunked) or lie
                raise too_large
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return parse_json(bytes(raw))


async def generate(served: Served, request: Request, req: GenerateRequest):
    """Tokenize, hand the request to the engine thread, and answer whole or as a stream."""
    engine = served.engine
    try:
        # a long prompt must not block the loop; an encoder-decoder model's prompt is its source
        source_ids, prompt_ids = await run_in_threadpool(engine.request_ids, req.prompt, req.src_lang, req.tgt_lang)
    except SpecMoEError as exc:
        raise APIError(400, str(exc), req.prompt_param) from None
    params = req.sampling_params(len(prompt_ids), engine.max_model_len, served.max_output_tokens)
    handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop(), source_ids, want_stats=req.specmoe_stats)
    served.loop.submit(handle)
    rid = new_id(req.kind)
    if req.stream:
        return StreamingResponse(stream_events(served, handle, req, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await complete(served, request, handle, req, rid)


async def complete(served: Served, request: Request, handle: RequestHandle, req: GenerateRequest, rid: str):
    """The whole answer; if the client leaves first, the engine drops the request at its next step."""
    result = asyncio.ensure_future(collect(handle))
    gone = asyncio.ensure_future(disconnected(request))
    client_left = True  # until the result is in (also when this handler is cancelled)
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        client_left = not result.done()
    finally:
        gone.cancel()
        if client_left:
            result.cancel()
            served.loop.cancel(handle)
    if client_left:
        return Response(status_code=CLIENT_CLOSED)
    got = result.result()  # raises an engine APIError
    use = usage(len(handle.prompt_ids), len(got.token_ids))
    # formatting the log-probabilities of a long echoed prompt takes a while: off the event loop
    logprobs = await run_in_threadpool(whole_logprobs, served, req, handle, got)
    text = echo_text(served, req, handle) + got.text if req.echo else got.text
    answer = response(req.kind, rid, served.model_name, text, got.finish_reason, use, logprobs)
    return {**answer, "specmoe_stats": got.stats} if req.specmoe_stats else answer


def echo_text(served: Served, req: GenerateRequest, handle: RequestHandle) -> str:
    if isinstance(req.prompt, str):
        return req.prompt
    tokenizer = served.engine.tokenizer
    return tokenizer.decode(handle.prompt_ids) if tokenizer is not None else ""


def logprobs_writer(served: Served, req: GenerateRequest, handle: RequestHandle) -> LogprobsWriter | None:
    """None unless the request asked for logprobs; an echoed prompt's tokens are written first."""
    if req.logprobs is None:
        return None
    return LogprobsWriter(served.engine.tokenizer, req.kind, context=None if req.echo else handle.prompt_ids)


def whole_logprobs(served: Served, req: GenerateRequest, handle: RequestHandle, got: Collected) -> dict | None:
    writer = logprobs_writer(served, req, handle)
    if writer is None:
        return None
    parts = [writer.add(handle.prompt_ids, got.prompt_logprobs)] if req.echo else []
    return merge(parts + [writer.add(got.token_ids, got.logprobs)])


async def stream_events(served: Served, handle: RequestHandle, req: GenerateRequest, rid: str):
    """Server-sent events: a chunk per piece of text, then the finish (and usage), then [DONE]."""
    model_name = served.model_name
    settled = False  # the engine is done with the request (finished or failed)
    writer = logprobs_writer(served, req, handle)
    try:
        if req.kind == "chat":
            yield sse(chunk("chat", rid, model_name, role=True))
        completion_tokens = 0
        echoed = not req.echo  # an echoed prompt goes first, with the log-probabilities the first delta brings
        while True:
            delta = await handle.queue.get()
            if delta.error is not None:
                settled = True
                yield sse(delta.error.body())
                break
            if not echoed:
                echoed = True
                logprobs = writer and writer.add(handle.prompt_ids, delta.prompt_logprobs)
                yield sse(chunk(req.kind, rid, model_name, text=echo_text(served, req, handle), logprobs=logprobs))
            completion_tokens += len(delta.token_ids)
            if delta.text or (writer and delta.token_ids):
                logprobs = writer and writer.add(delta.token_ids, delta.logprobs)
                yield sse(chunk(req.kind, rid, model_name, text=delta.text, logprobs=logprobs))
            if delta.finish_reason is not None:
                settled = True
                last = chunk(req.kind, rid, model_name, finish_reason=delta.finish_reason)
                yield sse({**last, "specmoe_stats": delta.stats} if req.specmoe_stats else last)
                if req.include_usage:
                    use = usage(len(handle.prompt_ids), completion_tokens)
                    yield sse(chunk(req.kind, rid, model_name, use=use))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not settled:  # the client went away mid-stream (the generator was closed)
            served.loop.cancel(handle)


@dataclass
class Collected:
    """A finished request, put together from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    stats: dict | None = None


async def collect(handle: RequestHandle) -> Collected:
    """A request's whole output, once it has finished."""
    got, pieces = Collected(), []
    while True:
        delta = await handle.queue.get()
        if delta.error is not None:
            raise delta.error
        pieces.append(delta.text)
        got.token_ids += delta.token_ids
        got.logprobs += delta.logprobs
        got.prompt_logprobs = got.prompt_logprobs or delta.prompt_logprobs
        if delta.finish_reason is not None:
            got.stats = delta.stats
            got.text, got.finish_reason = "".join(pieces), delta.finish_reason
            return got


async def disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
