"""A graceful shutdown: on SIGTERM or SIGINT the server stops admitting, lets the
requests in flight finish within --shutdown-timeout, answers the rest with an error
(every client gets a final chunk or an error object, never a cut connection), and
exits 0 within a bounded time."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from serving import ServeProcess, served_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # a long scenario (it waits out a drain): .ci/run runs it after make test

GRACE_S = 3
LONG, SHORT = 200, 6  # tokens: a long request cannot finish within GRACE_S, a short one does
# a slow tier (an emulated 1 MB/s link) makes each step take ~0.15 s on the tiny model
SLOW = ("--policy", "ondemand", "--offload", "disk", "--offload-bandwidth", "1MB/s", "--device-memory", "30%",
        "--max-batch-size", "16", "--shutdown-timeout", str(GRACE_S))


def ask(url: str, max_tokens: int, stream: bool, out: dict) -> None:
    """One completion; `out` gets the status and either the JSON answer or the SSE events."""
    body = {"prompt": "the quick brown fox", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            if not stream:
                r = client.post("/v1/completions", json=body)
                out.update(status=r.status_code, body=r.json())
                return
            with client.stream("POST", "/v1/completions", json=body) as r:
                out["status"], out["events"] = r.status_code, []
                out["events"].extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as exc:  # a cut connection: what must not happen
        out["transport_error"] = repr(exc)


def start(url: str, max_tokens: int, stream: bool) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=ask, args=(url, max_tokens, stream, out), daemon=True)
    thread.start()
    return thread, out


def watch_live_view(url: str, out: dict) -> None:
    """An open web page: the live view's event stream, read until the server ends it."""
    try:
        with httpx.Client(base_url=url, timeout=120) as client, client.stream("GET", "/ui/events") as r:
            out["events"] = sum(1 for line in r.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as exc:
        out["transport_error"] = repr(exc)


def in_flight(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(("specmoe_running_requests", "specmoe_waiting_requests")))


def draining(url: str) -> bool:
    """Whether the server has taken the signal: /health answers 503, or the port is closed."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 503
    except httpx.HTTPError:
        return True


def wait_until(condition, timeout=60, what="") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def final_event(out: dict) -> dict:
    events = out["events"]
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])


SIGNALS = (signal.SIGTERM, signal.SIGINT)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A fresh server for each signal, both started at once: the second one loads while the
    first test waits on its slow tier and its drain."""
    model_dir = served_checkpoint(tmp_path_factory.mktemp("served"))
    started = {sig: ServeProcess(model_dir, tmp_path_factory.mktemp(sig.name) / "server.log", *SLOW, wait=False)
               for sig in SIGNALS}
    yield started
    for server in started.values():  # a test that failed before its signal leaves its server running
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


@pytest.mark.parametrize("sig", SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_requests_in_flight_and_exits_0(servers, sig):
    server = servers[sig]
    server.wait_until_ready()
    page: dict = {}
    threading.Thread(target=watch_live_view, args=(server.url, page), daemon=True).start()
    long = [start(server.url, LONG, stream) for stream in (True, False, True, False)]
    wait_until(lambda: in_flight(server.url) == len(long), what="the long requests to run")
    short = [start(server.url, SHORT, stream) for stream in (True, False)]
    wait_until(lambda: short[0][1].get("events"), what="the short requests to run")  # both came in one step
    signalled = time.monotonic()
    server.proc.send_signal(sig)
    wait_until(lambda: draining(server.url), what="the server to start draining")  # /health says so first
    late: dict = {}
    ask(server.url, SHORT, False, late)
    status = server.stop(timeout=GRACE_S + 20)
    # the drain takes GRACE_S; an open page's event stream must not hold the exit up beyond it
    assert status == 0 and time.monotonic() - signalled < GRACE_S + 5, server.log()
    assert page.get("events", 0) > 0, page
    for thread, _ in long + short:
        thread.join(10)
    # no new request is admitted: the port is closed, or the answer is 503
    assert "transport_error" in late or (late["status"] == 503 and late["body"]["error"]["code"] == "shutting_down")
    for (_, out), stream in zip(long, (True, False, True, False)):
        assert "transport_error" not in out, out
        error = final_event(out)["error"] if stream else out["body"]["error"]
        assert error["code"] == "shutting_down" and out["status"] == (200 if stream else 503), out
    for (_, out), stream in zip(short, (True, False)):
        assert "transport_error" not in out, out
        finish = final_event(out) if stream else out["body"]
        assert finish["choices"][0]["finish_reason"] == "length", out
    assert "Traceback" not in server.log(), server.log()
