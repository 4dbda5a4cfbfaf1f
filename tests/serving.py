"""Servers for the tests, on loopback only: a free port, the app in this process, and
waiting for a server subprocess to answer /health."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_process(engine, model_name: str, **app_options):
    """The app over `engine` (`create_app` options: api_key, ui), served by uvicorn on a
    thread of this process; yields its URL."""
    import uvicorn

    from specmoe.server.app import create_app
    from specmoe.server.command import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name, **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until_healthy(url: str, proc, log_path, timeout_s: float) -> None:
    """Until `url`/health answers 200; fails with the server's log if `proc` exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited with status {proc.returncode}:\n{log_path.read_text()}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not answer /health within {timeout_s} s:\n" \
            f"{log_path.read_text()}"
        time.sleep(0.2)


@contextmanager
def serve_subprocess(serve_args: list[str], log_path, timeout_s: float):
    """`specmoe serve` with `serve_args` in a subprocess on a free loopback port; yields its URL.
    Stops it afterwards and fails if its log shows a traceback."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specmoe.cli", "serve", "--port", str(port), *serve_args],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, log_path, timeout_s)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert "Traceback" not in log_text, log_text
