"""The FastAPI app: OpenAI-compatible endpoints over one `EngineLoop`.

`create_app(engine, model_name)` builds it; the engine thread starts and stops with the
app's lifespan. Handlers validate and tokenize on the event loop (cheap), then wait on
the request's queue while the engine thread generates.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import Counter
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import SpecMoEError
from . import metrics
from .loop import EngineLoop, RequestHandle
from .protocol import (
    MAX_BODY_BYTES, APIError, GenerateRequest, chunk, new_id, parse_chat, parse_completion, parse_json,
    response, sse, usage,
)

log = logging.getLogger("specmoe.server")

CLIENT_CLOSED = 499  # the status logged for a request whose client left (nginx's convention)


def create_app(engine, model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app serving `engine` under `model_name`; with `api_key`, /v1 needs `Authorization: Bearer KEY`."""
    loop = EngineLoop(engine)
    http_errors: Counter[int] = Counter()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            await run_in_threadpool(loop.stop)

    app = FastAPI(title="specmoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = loop

    # --- errors: always the OpenAI error object ----------------------------------------

    def error_response(err: APIError) -> JSONResponse:
        http_errors[err.status] += 1
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):  # a bug in the server, not the request
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error; see the server log", code="internal_error"))

    # --- /v1 ------------------------------------------------------------------------------

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                           "with the key the server was started with (--api-key)", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "specmoe",
                "max_model_len": engine.max_model_len}

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str):
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           "model", "model_not_found")
        return model_card()

    @v1.post("/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion(await read_body(request), model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat(await read_body(request), model_name, engine.tokenizer))

    app.include_router(v1)

    # --- operations --------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if loop.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": f"the engine loop stopped: {loop.error}"}, status_code=503)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(loop.stats, dict(http_errors), model_name), media_type=metrics.CONTENT_TYPE)

    # --- generation -------------------------------------------------------------------

    async def read_body(request: Request) -> dict:
        too_large = APIError(413, f"the request body is larger than {max_body_bytes} bytes", code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise too_large
        raw = bytearray()
        try:
            async for part in request.stream():
                raw += part
                if len(raw) > max_body_bytes:
                    raise too_large
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the body") from None
        return parse_json(bytes(raw))

    async def generate(request: Request, req: GenerateRequest):
        try:
            prompt_ids = await run_in_threadpool(engine.encode, req.prompt)
        except SpecMoEError as exc:
            raise APIError(400, str(exc), req.prompt_param) from None
        params = req.sampling_params(len(prompt_ids), engine.max_model_len)
        handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop())
        loop.submit(handle)
        rid = new_id(req.kind)
        if req.stream:
            return StreamingResponse(stream(handle, req, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await complete(request, handle, req, rid)

    async def complete(request: Request, handle: RequestHandle, req: GenerateRequest, rid: str):
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
                loop.cancel(handle)
        if client_left:
            return Response(status_code=CLIENT_CLOSED)
        text, completion_tokens, finish_reason = result.result()  # raises an engine APIError
        return response(req.kind, rid, model_name, text, finish_reason, usage(len(handle.prompt_ids), completion_tokens))

    async def stream(handle: RequestHandle, req: GenerateRequest, rid: str):
        settled = False  # the engine is done with the request (finished or failed)
        try:
            if req.kind == "chat":
                yield sse(chunk("chat", rid, model_name, role=True))
            completion_tokens = 0
            while True:
                delta = await handle.queue.get()
                if delta.error is not None:
                    settled = True
                    yield sse(delta.error.body())
                    break
                completion_tokens += len(delta.token_ids)
                if delta.text:
                    yield sse(chunk(req.kind, rid, model_name, text=delta.text))
                if delta.finish_reason is not None:
                    settled = True
                    yield sse(chunk(req.kind, rid, model_name, finish_reason=delta.finish_reason))
                    if req.include_usage:
                        use = usage(len(handle.prompt_ids), completion_tokens)
                        yield sse(chunk(req.kind, rid, model_name, use=use))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not settled:  # the client went away mid-stream
                loop.cancel(handle)

    return app


async def collect(handle: RequestHandle) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of a request, once it has finished."""
    pieces, tokens = [], 0
    while True:
        delta = await handle.queue.get()
        if delta.error is not None:
            raise delta.error
        pieces.append(delta.text)
        tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            return "".join(pieces), tokens, delta.finish_reason


async def disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
