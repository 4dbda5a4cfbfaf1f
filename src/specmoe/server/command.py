"""`specmoe serve`: load the model, bind the socket, run uvicorn until interrupted.

SIGTERM or SIGINT (Ctrl-C) starts a graceful shutdown: the listening socket closes, no
new request is admitted (503 `shutting_down`, /health 503), requests in flight get
`--shutdown-timeout` seconds to finish and are then answered with that error (a final
SSE event for streams), and the process exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ..api import LLM
from ..base.errors import SpecMoEError
from ..flags import add_engine_args, engine_options
from .protocol import DEFAULT_MAX_OUTPUT_TOKENS

DEMO_MODEL_NAME = "specmoe-demo"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (continuous batching, streaming)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "Concurrent requests are decoded together in the same steps.",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--max-batch-size", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECMOE_API_KEY if set)")
    p.add_argument("--served-model-name", help="model name clients use (default: the model directory's name)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, stop admitting and give requests in flight this long to finish; "
                        "then answer them with an error and exit (default 30; a second Ctrl-C exits at once)")
    p.add_argument("--max-output-tokens", type=int, default=DEFAULT_MAX_OUTPUT_TOKENS, metavar="N",
                   help="the most tokens one request may generate: a larger max_tokens is a 400, and a chat "
                        f"without max_tokens stops there (default {DEFAULT_MAX_OUTPUT_TOKENS}; at most the context)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the web page (playground and live view) at /")
    p.set_defaults(func=run_serve)


def check_max_output_tokens(n: int) -> None:
    if n < 1:
        raise SpecMoEError(f"--max-output-tokens must be at least 1, got {n}")


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).resolve().name if args.model else DEMO_MODEL_NAME


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a one-line error that says what to change."""
    if not 0 <= port <= 65535:
        raise SpecMoEError(f"--port {port} is not a TCP port (0..65535)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise SpecMoEError(f"--host {host!r} is not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise SpecMoEError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port") from None
    sock.listen(2048)
    return sock


def served_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def warn_if_open(host: str, api_key: str | None) -> None:
    if host not in LOOPBACK and not api_key:
        print(f"specmoe: warning: listening on {host} without --api-key: anyone who can reach this port "
              "can use the model", file=sys.stderr, flush=True)


def run_serve(args) -> int:
    try:
        import uvicorn

        from .app import create_app  # fastapi: an optional dependency
        from .graceful import GracefulServer  # uvicorn's server, draining on SIGTERM
    except ModuleNotFoundError as exc:
        raise SpecMoEError(f"specmoe serve needs {exc.name}: pip install 'specmoe[serve]'") from None
    if args.max_batch_size < 1:
        raise SpecMoEError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    if not 0 <= args.shutdown_timeout <= 24 * 3600:  # also refuses nan
        raise SpecMoEError(f"--shutdown-timeout must be 0..86400 seconds, got {args.shutdown_timeout}")
    check_max_output_tokens(args.max_output_tokens)
    api_key = args.api_key or os.environ.get("SPECMOE_API_KEY") or None
    sock = bind(args.host, args.port)  # before loading the model: a busy port fails fast
    llm = LLM(model=args.model, **engine_options(args, max_batch_size=args.max_batch_size))
    name = model_name(args)
    app = create_app(llm.engine, name, api_key=api_key, max_output_tokens=args.max_output_tokens, ui=not args.no_ui)
    host, port = sock.getsockname()[:2]
    print(f"specmoe: serving {name} at {served_url(host, port)} (policy {args.policy}, "
          f"batch up to {args.max_batch_size}, context {llm.engine.max_model_len}, "
          f"at most {min(args.max_output_tokens, llm.engine.max_model_len - 1)} tokens a request"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    if not args.no_ui:
        print(f"specmoe: the web page (playground, live view) is at {served_url(host, port).removesuffix('/v1')}/",
              file=sys.stderr, flush=True)
    warn_if_open(args.host, api_key)
    # uvicorn's own limit only cuts connections that outlive the engine's answer to them
    config = uvicorn.Config(app, log_level="info" if args.access_log else "warning", access_log=args.access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + 10)
    try:
        GracefulServer(config, app.state.engine_loop, args.shutdown_timeout).run(sockets=[sock])
    finally:
        sock.close()
        llm.close()
    return 0
