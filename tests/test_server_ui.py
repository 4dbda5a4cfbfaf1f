"""The web page's HTTP side (server/ui.py): the page and its files, the live event stream
behind the API key, `--no-ui`, and the per-answer statistics the playground shows
(`specmoe_stats`), on a real engine served in this process. The page itself, in a real
browser, is tests/test_ui_browser.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from factories import random_prompts  # noqa: E402
from serving import serve_in_process  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from specmoe import LLM  # noqa: E402
from specmoe.server.app import create_app  # noqa: E402
from specmoe.server.ui import STATIC  # noqa: E402

MODEL = "tiny-mixtral"
KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    llm = LLM(model=str(tiny_ckpt("mixtral")), device="cpu", policy="specmoe", offload="host", device_memory="50%",
              draft_quant="none", draft_experts=2, gamma=3, max_batch_size=4, max_model_len=64)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def url(llm):
    with serve_in_process(llm.engine, MODEL, api_key=KEY) as url:
        yield url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.links += [v for k, v in attrs if k in ("src", "href") and v]


def completion(http, prompt, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    r = http.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def transfer_bytes(http) -> int:
    line = next(line for line in http.get("/metrics").text.splitlines()
                if line.startswith("specmoe_transfer_bytes_total{"))
    return int(float(line.rsplit(" ", 1)[1]))


def read_events(http, n: int, headers=AUTH) -> list[dict]:
    events = []
    with http.stream("GET", "/ui/events", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == n:
                    break
    return events


# --- the page ------------------------------------------------------------------------------


def test_page_and_every_file_it_links_are_served_without_a_key(http):
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    parser = Links()
    parser.feed(page.text)
    assert {"/ui/app.js", "/ui/style.css", "/ui/icon.svg"} <= set(parser.links)
    for link in parser.links:
        assert http.get(link).status_code == 200, link


def test_page_may_load_nothing_from_another_origin(http):
    assert "default-src 'self'" in http.get("/").headers["content-security-policy"]
    for path in STATIC.iterdir():  # vendored files: works offline, no CDN (an XML namespace is a name, not a load)
        assert not re.search(r'(?<!xmlns=")https?://|//cdn|@import', path.read_text()), path.name


def test_an_unknown_page_file_is_a_404(http):
    assert http.get("/ui/missing.js").status_code == 404


def test_info_tells_the_page_a_key_is_needed(http):
    assert http.get("/ui/info").json() == {"model": MODEL, "api_key_required": True}


def test_no_ui_serves_no_page(llm):
    client = TestClient(create_app(llm.engine, MODEL, ui=False))  # no lifespan: the engine loop never starts
    assert [client.get(p).status_code for p in ("/", "/ui/app.js", "/ui/events")] == [404, 404, 404]


# --- the live view's events ----------------------------------------------------------------


def status_of_events(http, headers) -> int:
    with http.stream("GET", "/ui/events", headers=headers) as r:  # a stream: never read to its end
        return r.status_code


def test_events_need_the_api_key(http):
    assert status_of_events(http, {}) == 401
    assert status_of_events(http, {"Authorization": "Bearer wrong"}) == 401


def test_events_report_the_engine_and_the_counters_metrics_reports(http):
    completion(http, random_prompts(1, seed=3)[0])
    events = read_events(http, 3)
    engine = next(e["engine"] for e in events if "engine" in e)
    assert (engine["policy"], engine["experts"], len(engine["state"])) == ("specmoe", 8, 2)
    metrics = http.get("/metrics").text
    assert f"specmoe_generation_tokens_total{{model=\"{MODEL}\"}} {events[-1]['generated_tokens']}" in metrics


# --- per-answer statistics -----------------------------------------------------------------


def test_an_answer_carries_its_engine_stats_only_when_asked(http):
    prompt = random_prompts(1, seed=4)[0]
    plain, asked = completion(http, prompt), completion(http, prompt, specmoe_stats=True)
    stats = asked["specmoe_stats"]
    assert "specmoe_stats" not in plain and plain["choices"] == asked["choices"]
    assert (stats["policy"], stats["completion_tokens"]) == ("specmoe", asked["usage"]["completion_tokens"])
    # every decode step gives 1 + accepted tokens; the first token comes from the prefill
    assert stats["steps"] + stats["accepted"] == stats["completion_tokens"] - 1
    assert stats["tokens_per_step"] == pytest.approx((stats["completion_tokens"] - 1) / stats["steps"])


def test_a_streamed_answer_ends_with_its_engine_stats(http):
    body = {"model": MODEL, "prompt": random_prompts(1, seed=5)[0], "max_tokens": 12, "temperature": 0,
            "stream": True, "specmoe_stats": True}
    with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["specmoe_stats"]["completion_tokens"] for c in chunks if "specmoe_stats" in c] == [12]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_answers_share_the_bytes_moved(http):
    before = transfer_bytes(http)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: completion(http, p, specmoe_stats=True), random_prompts(4, seed=6)))
    moved = sum(a["specmoe_stats"]["transfer_bytes"] for a in answers)
    assert moved == pytest.approx(transfer_bytes(http) - before, abs=len(answers))  # each share is rounded
    assert moved > 0


def test_specmoe_stats_must_be_a_boolean(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "specmoe_stats": "yes"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "specmoe_stats"
