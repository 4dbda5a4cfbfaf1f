"""uvicorn's server with a graceful shutdown: on SIGTERM or SIGINT the engine loop drains
(no new request admitted, those in flight finish or get an error when the grace period
ends), uvicorn closes the listening socket and waits for the answers, and the process
exits 0. uvicorn itself would re-raise the signal once shut down, which ends the process
with the signal's status; a second Ctrl-C still exits at once (uvicorn's force exit).
"""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop, grace_s: float):
        super().__init__(config)
        self.engine_loop, self.grace_s = engine_loop, grace_s

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:  # the first signal; only assignments here: it runs as a signal handler
            self.engine_loop.drain(self.grace_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
