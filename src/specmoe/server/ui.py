"""The web page at `/`: a playground and a live view of the engine.

The page is plain HTML, CSS and one script vendored under server/static/: no build
step, nothing fetched from elsewhere, so it works offline (its Content-Security-Policy
allows this server only). It generates through the same /v1 API as any client and
reads the live view from `/ui/events`, server-sent events built from the engine's own
counters (live.py), a few a second, computed only while a page is connected. Both are
behind the API key; `/ui/info` tells the page, without one, whether to ask for it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .live import LiveEvents, LiveView
from .loop import EngineLoop
from .protocol import READ_METHODS, APIError

STATIC = Path(__file__).with_name("static")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    # everything comes from this server: a page that would load a CDN script fails here, not offline
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
}


def static_files() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, media type) of the page's files, read once."""
    return {p.name: (p.read_bytes(), MEDIA_TYPES[p.suffix]) for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES}


def ui_router(loop: EngineLoop, model_name: str, authorize, key_required: bool) -> APIRouter:
    """`/` and `/ui/...`; `authorize` is the /v1 API-key dependency."""
    router = APIRouter()
    files = static_files()
    view = LiveView()
    loop.after_step.append(view.tick)

    @router.api_route("/", methods=READ_METHODS)
    async def index():
        body, media_type = files["index.html"]
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    @router.api_route("/ui/info", methods=READ_METHODS)
    async def info():
        return JSONResponse({"model": model_name, "api_key_required": key_required},
                            headers={"Cache-Control": "no-cache"})

    @router.api_route("/ui/events", methods=READ_METHODS, dependencies=[Depends(authorize)])
    async def events():
        return StreamingResponse(live_events(loop, view), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.api_route("/ui/{name}", methods=READ_METHODS)
    async def static(name: str):
        if name not in files or name == "index.html":
            raise APIError(404, f"no file {name} in the page's static files", code="not_found")
        body, media_type = files[name]
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return router


async def live_events(loop: EngineLoop, view: LiveView):
    """A page's live view: an event every `view.interval_s` until the page leaves, the engine
    stops or the server begins to shut down (an open page must not hold the shutdown up)."""
    view.watch()
    loop.call(view.capture)  # an idle engine answers with its state at once
    events = LiveEvents(loop.stats, view)
    try:
        while loop.alive and not loop.draining:
            yield f"data: {json.dumps(events.next(), separators=(',', ':'))}\n\n"
            await asyncio.sleep(view.interval_s)
    finally:
        view.unwatch()
        loop.call(view.stop_if_unwatched)  # if it was the last page, the engine stops counting now
