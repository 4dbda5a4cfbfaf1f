"""`specmoe serve --replicas N`: N engine replicas behind one OpenAI-compatible endpoint on
Ray Serve.

Each Serve replica runs `specmoe serve`'s own FastAPI app over its own engine, so every
endpoint, error and stream behaves as on one server. Serve's HTTP proxy sends each
request to the less loaded of two replicas picked at random (power of two choices; with
two replicas, the least loaded) and holds requests back while every replica has
`--max-batch-size` in flight. Serve replaces a replica whose process dies or whose engine
loop stopped (`check_health`) while the others keep answering. For /metrics each replica
reports its counters every second to one small actor (`Board`); the replica that answers
adds up what the board holds (`server.metrics.combine`). A replica that cannot start for
a reason the user can fix (a budget too small, a bad path) leaves its one-line error on
the board, and the deployment fails at once instead of retrying.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..api import LLM
from ..base.config import EngineConfig
from ..base.errors import SpecMoEError
from ..flags import engine_options
from ..server import metrics
from ..server.app import create_app
from ..server.command import bind, check_max_output_tokens, model_name, served_url, warn_if_open
from ..server.protocol import DEFAULT_MAX_OUTPUT_TOKENS
from .cluster import connect, cpu_threads, replica_resources, require_ray
from .options import ReplicaOptions

log = logging.getLogger("specmoe.server")

APP_NAME = "specmoe"
REPORT_EVERY_S = 1.0
GONE_AFTER_S = 5.0  # a replica silent this long is gone: its counters stay, its running requests do not
HEALTH_CHECK_S = 2.0  # how often Serve asks each replica (a dead one is replaced within about this)


class Board:
    """What the replicas tell each other and the driver (a Ray actor): the last counters
    each reported (replicas that were replaced stay), and why one could not start."""

    def __init__(self):
        self.reports: dict[str, tuple] = {}  # replica -> (ServerStats, http errors, when)
        self.startup_error: str | None = None

    def exchange(self, replica: str, stats, http_errors: dict) -> list[tuple]:
        """Keep `replica`'s report; return every replica's: (replica, stats, http errors, live)."""
        now = time.monotonic()
        self.reports[replica] = (stats, http_errors, now)
        return [(r, s, e, now - t < GONE_AFTER_S) for r, (s, e, t) in sorted(self.reports.items())]

    def failed(self, message: str) -> None:
        self.startup_error = self.startup_error or message

    def why_not_started(self) -> str | None:
        return self.startup_error


def render_cluster(reports: list[tuple], model: str) -> str:
    stats = metrics.combine([s for _, s, _, _ in reports], [live for *_, live in reports])
    errors = metrics.combine_counts([e for _, _, e, _ in reports])
    return metrics.render(stats, errors, model, replicas={r: s.requests for r, s, _, _ in reports})


class EngineServer:
    """One Serve replica: an engine and `specmoe serve`'s app over it. Serve calls
    `__serve_build_asgi_app__` after `__init__` (`serve.ingress()` without an app)."""

    def __init__(self, model: str | None, options: dict, name: str, api_key: str | None, board,
                 max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS):
        from ray import serve

        self._stop, self.llm, self.served = threading.Event(), None, None
        self.name, self.api_key, self.board = name, api_key, board
        self.max_output_tokens = max_output_tokens
        self.replica = serve.get_replica_context().replica_id.unique_id
        try:
            self.llm = LLM(model=model, **options)
        except SpecMoEError as exc:  # Serve reports only that the constructor failed: tell the driver why
            board.failed.remote(str(exc))
            raise

    def __serve_build_asgi_app__(self):
        app = create_app(self.llm.engine, self.name, api_key=self.api_key, max_output_tokens=self.max_output_tokens,
                         cluster_metrics=self.cluster_metrics)
        self.served = app.state.served
        threading.Thread(target=self._report_forever, name="specmoe-metrics", daemon=True).start()
        return app

    def _exchange(self):
        return self.board.exchange.remote(self.replica, self.served.loop.stats, dict(self.served.http_errors))

    async def cluster_metrics(self, served) -> str:
        return render_cluster(await self._exchange(), self.name)

    def _report_forever(self) -> None:
        import ray

        while not self._stop.wait(REPORT_EVERY_S):
            try:
                ray.get(self._exchange(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - the board restarts; serving goes on
                log.warning("cannot report metrics to the board: %s", exc)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop stopped is replaced."""
        loop = self.served.loop
        if not loop.alive:
            raise RuntimeError(f"the engine loop stopped: {loop.error}")

    def __del__(self):
        self._stop.set()
        if self.llm is not None:
            self.llm.close()


def start_serving(model: str | None, options: dict, placement: ReplicaOptions, *, name: str, host: str, port: int,
                  api_key: str | None = None, access_log: bool = False,
                  max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS) -> None:
    """Deploy `placement.replicas` engine replicas on the connected Ray cluster behind
    http://host:port; returns when every replica answers."""
    ray = require_ray()
    from ray import serve

    resources = replica_resources(placement, options.get("device", "auto"), ray.cluster_resources())
    options = {**options, "threads": cpu_threads(resources, options.get("threads"))}
    board = ray.remote(Board).options(num_cpus=0, max_restarts=-1).remote()
    logging_config = {"log_level": "WARNING", "enable_access_log": access_log}
    serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
    replica = serve.deployment(
        serve.ingress()(EngineServer), name="engine", num_replicas=placement.replicas, ray_actor_options=resources,
        max_ongoing_requests=options.get("max_batch_size", 32), health_check_period_s=HEALTH_CHECK_S,
        # an idle replica stops at once: it checks for requests still running every 0.2 s (Serve's
        # default, 2 s, kept every stop and every test's teardown waiting that long)
        graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.2,
        max_constructor_retry_count=1,  # a replica that cannot start fails the run
    )
    try:
        serve.run(replica.bind(model, options, name, api_key, board, max_output_tokens), name=APP_NAME,
                  route_prefix="/",
                  logging_config=logging_config)
    except RuntimeError:
        why = ray.get(board.why_not_started.remote())
        if why is not None:
            raise SpecMoEError(why) from None
        raise


def stop_serving() -> None:
    from ray import serve

    serve.shutdown()


def run_serve(args) -> int:
    """`specmoe serve --replicas N`: serve until interrupted (Ctrl-C or SIGTERM)."""
    if args.max_batch_size < 1:
        raise SpecMoEError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    check_max_output_tokens(args.max_output_tokens)
    placement = ReplicaOptions(args.replicas, args.replica_cpus, args.ray_address)
    options = engine_options(args, max_batch_size=args.max_batch_size)
    EngineConfig.from_kwargs(**options)  # a bad flag fails before Ray starts
    api_key = args.api_key or os.environ.get("SPECMOE_API_KEY") or None
    sock = bind(args.host, args.port)  # a busy port fails fast; Serve's proxy binds it again
    host, port = sock.getsockname()[:2]
    sock.close()
    name, model = model_name(args), args.model and str(Path(args.model).resolve())
    started = connect(args.ray_address)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the finally below
    try:
        start_serving(model, options, placement, name=name, host=args.host, port=port, api_key=api_key,
                      access_log=args.access_log, max_output_tokens=args.max_output_tokens)
        print(f"specmoe: serving {name} at {served_url(host, port)} on {args.replicas} replicas "
              f"(policy {args.policy}, batch up to {args.max_batch_size} each"
              f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
        warn_if_open(args.host, api_key)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        stop_serving()
        if started:
            require_ray().shutdown()
