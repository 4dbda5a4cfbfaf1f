"""`specmoe serve` in a subprocess on a free loopback port, driven by the official openai client.

The server runs once for the module on a tiny random Mixtral checkpoint with a tiny
character-level BPE tokenizer and a chat template, with an API key. Outputs are greedy
and compared with offline `LLM.generate` on the same checkpoint.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from factories import make_checkpoint  # noqa: E402
from serving import WORDS, ServeProcess, serve_in_process, write_tokenizer  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402

API_KEY = "test-key-123"
MAX_TOKENS = 24
PROMPTS = [" ".join(WORDS[i % len(WORDS): i % len(WORDS) + 2 + i % 5]) + f" {i}" for i in range(16)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("served") / "tiny-mixtral")
    write_tokenizer(path, [" ".join(WORDS)] * 4 + PROMPTS)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    served = ServeProcess(model_dir, tmp_path_factory.mktemp("server-log") / "server.log",
                          "--api-key", API_KEY, "--max-batch-size", "32", "--no-ui")
    yield served.url
    served.stop()
    assert "Traceback" not in served.log(), served.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model=str(model_dir), device="cpu")
    yield llm
    llm.close()


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def metric(http, name: str, **labels) -> float:
    text = http.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics:\n{text}")


# --- the happy paths ---------------------------------------------------------------------------


def test_no_ui_flag_leaves_no_page_at_the_root(http):
    assert [http.get(path).status_code for path in ("/", "/ui/info")] == [404, 404]


def test_models_lists_the_model_directory_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny-mixtral"]


def test_completion_matches_offline_generate(client, offline):
    out = client.completions.create(model="tiny-mixtral", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    want = offline.generate([PROMPTS[0]], greedy())[0]
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_accepts_token_ids(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    out = client.completions.create(model="tiny-mixtral", prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == offline.generate([ids], greedy(8))[0].text


def test_chat_completion_goes_through_the_chat_template(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy fox"}]
    out = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0)
    want = offline.chat(messages, greedy())
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_chat_concatenates_to_the_non_streamed_text(client):
    kw = dict(model="tiny-mixtral", messages=[{"role": "user", "content": "quick brown"}], max_tokens=MAX_TOKENS,
              temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS == whole.usage.completion_tokens


def test_stream_ends_with_done_and_never_shows_a_stop_string(client, http):
    kw = dict(model="tiny-mixtral", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    stop = full[6:8]
    want = full[: full.find(stop)]
    body = dict(kw, stop=[stop, "never-seen"], ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    plain = client.completions.create(stop=[stop, "never-seen"], extra_body={"ignore_eos": True}, **kw)
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == (want, "stop")


def test_concurrent_clients_get_the_offline_greedy_outputs(client, offline, http):
    steps0 = metric(http, "specmoe_decode_steps_total")
    seq_steps0 = metric(http, "specmoe_decode_sequence_steps_total")
    start = threading.Barrier(len(PROMPTS))

    def ask(prompt):
        start.wait()
        out = client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, PROMPTS))
    want = [(o.text, o.finish_reason, len(o.token_ids)) for o in offline.generate(PROMPTS, greedy())]
    assert got == want
    steps = metric(http, "specmoe_decode_steps_total") - steps0
    mean_batch = (metric(http, "specmoe_decode_sequence_steps_total") - seq_steps0) / steps
    assert mean_batch > 2, f"requests were not batched together (mean batch {mean_batch:.2f})"


def test_metrics_are_prometheus_text(http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("specmoe_requests_total", "specmoe_generation_tokens_total", "specmoe_generation_tokens_per_second",
                 "specmoe_running_requests", "specmoe_transfer_bytes_total", "specmoe_acceptance_rate"):
        assert re.search(rf"^# TYPE {name} (counter|gauge)$", r.text, re.M), name
    assert metric(http, "specmoe_requests_total") >= 1
    assert metric(http, "specmoe_generation_tokens_total") >= 1


def test_client_that_disconnects_mid_stream_is_aborted(http, offline):
    aborted0 = metric(http, "specmoe_requests_finished_total", finish_reason="abort")
    prompt = PROMPTS[3]
    room = offline.engine.max_model_len - len(offline.tokenizer.encode(prompt))
    body = dict(prompt=prompt, max_tokens=room, temperature=0, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        next(r.iter_lines())  # the first token is there; now go away
    deadline = time.monotonic() + 60
    while metric(http, "specmoe_requests_finished_total", finish_reason="abort") == aborted0:
        assert time.monotonic() < deadline, "the sequence was not aborted"
        time.sleep(0.05)
    assert metric(http, "specmoe_running_requests") == 0
    assert http.get("/health").status_code == 200


def test_client_that_gives_up_on_a_plain_request_is_aborted(http, server, offline):
    """The client closes its connection once the server reports the request running (an
    event, not a timeout that a fast machine would lose), and the server aborts it."""
    aborted0 = metric(http, "specmoe_requests_finished_total", finish_reason="abort")
    done0 = metric(http, "specmoe_requests_finished_total", finish_reason="length")
    prompt = PROMPTS[4]
    room = offline.engine.max_model_len - len(offline.tokenizer.encode(prompt))
    body = json.dumps(dict(prompt=prompt, max_tokens=room, temperature=0, ignore_eos=True)).encode()
    url = urlsplit(server)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (url.netloc.encode(), API_KEY.encode(), len(body), body))
        deadline = time.monotonic() + 60
        while metric(http, "specmoe_running_requests") < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.002)
    assert metric(http, "specmoe_requests_finished_total", finish_reason="length") == done0, \
        f"all {room} tokens were done before the client left"
    deadline = time.monotonic() + 60
    while metric(http, "specmoe_requests_finished_total", finish_reason="abort") == aborted0:
        assert time.monotonic() < deadline, "the sequence was not aborted"
        time.sleep(0.05)
    assert metric(http, "specmoe_running_requests") == 0


# --- bad input ---------------------------------------------------------------------------------

GOOD = {"model": "tiny-mixtral", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny-mixtral", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (case id, path, body: dict or raw bytes, status, param)
BAD = [
    ("malformed-json", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("not-utf8", "/v1/completions", b"\xff\xfe{}", 400, None),
    ("empty-body", "/v1/completions", b"", 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, None),
    ("deep-nesting", "/v1/completions", b"[" * 200_000, 400, None),
    ("nan", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("missing-prompt", "/v1/completions", {"model": "tiny-mixtral"}, 400, "prompt"),
    ("prompt-wrong-type", "/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt"),
    ("prompt-bool-ids", "/v1/completions", {**GOOD, "prompt": [True, 5]}, 400, "prompt"),
    ("prompt-batch", "/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt-id-outside-vocab", "/v1/completions", {**GOOD, "prompt": [5, 100_000]}, 400, "prompt"),
    ("empty-prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("max-tokens-string", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("max-tokens-float", "/v1/completions", {**GOOD, "max_tokens": 4.5}, 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-past-context", "/v1/completions", {**GOOD, "max_tokens": 10_000}, 400, "max_tokens"),
    ("max-tokens-huge", "/v1/completions", {**GOOD, "max_tokens": 10**40}, 400, "max_tokens"),
    ("prompt-past-context", "/v1/completions", {**GOOD, "prompt": "lazy dog " * 200}, 400, "prompt"),
    ("unknown-field", "/v1/completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("unsupported-value", "/v1/completions", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("n-2", "/v1/completions", {**GOOD, "n": 2}, 400, "n"),
    ("temperature-negative", "/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("temperature-string", "/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("seed-huge", "/v1/completions", {**GOOD, "seed": 2**70}, 400, "seed"),
    ("stop-not-strings", "/v1/completions", {**GOOD, "stop": [1]}, 400, "stop"),
    ("stop-too-many", "/v1/completions", {**GOOD, "stop": list("abcde")}, 400, "stop"),
    ("stop-too-long", "/v1/completions", {**GOOD, "stop": "x" * 5000}, 400, "stop"),
    ("stream-not-bool", "/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("stream-options-without-stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("chat-missing-messages", "/v1/chat/completions", {"model": "tiny-mixtral"}, 400, "messages"),
    ("chat-bad-role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages.0.role"),
    ("chat-image-part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0"),
    ("chat-content-number", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]},
     400, "messages.0.content"),
    ("chat-tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown-model", "/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
]


def assert_error(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_an_openai_error_and_the_server_lives(http, path, body, status, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    error = assert_error(http.post(path, **kw), status, param)
    if status == 404:
        assert error["code"] == "model_not_found"
    assert http.get("/health").json() == {"status": "ok"}


def test_prompt_past_context_says_context_length_exceeded(http):
    error = assert_error(http.post("/v1/completions", json={**GOOD, "prompt": "lazy dog " * 200}), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "256" in error["message"]


def test_one_request_generates_at_most_the_servers_max_output_tokens(offline):
    """What one request may cost (specmoe serve --max-output-tokens): a chat without
    max_tokens filled the context, on the demo model 1,016 tokens, past a fuzzer's 10 s limit
    on two busy cores. The document states the limit, a larger max_tokens is a one-line 400
    that names the flag, and a chat without max_tokens stops there."""
    with serve_in_process(offline.engine, "m", max_output_tokens=20, ui=False) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        body = http.get("/openapi.json").json()["paths"]
        schemas = {path: body[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
                   for path in ("/v1/completions", "/v1/chat/completions")}
        assert [schemas["/v1/completions"]["max_tokens"]["maximum"], schemas["/v1/chat/completions"]["max_tokens"][
            "maximum"], schemas["/v1/chat/completions"]["max_completion_tokens"]["maximum"]] == [20, 20, 20]
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the lazy dog"}],
                                                       "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 20 and chat["choices"][0]["finish_reason"] == "length"
        done = http.post("/v1/completions", json={"prompt": "the", "max_tokens": 20, "ignore_eos": True}).json()
        assert done["usage"]["completion_tokens"] == 20
        for path, field, body in (("/v1/completions", "max_tokens", {"prompt": "the"}),
                                  ("/v1/chat/completions", "max_completion_tokens",
                                   {"messages": [{"role": "user", "content": "the"}]})):
            error = assert_error(http.post(path, json={**body, field: 21}), 400, field)
            assert "\n" not in error["message"] and f"'{field}' must be at most 20, got 21" in error["message"]
            assert "--max-output-tokens" in error["message"]


def test_unknown_url_and_wrong_method_get_openai_errors(http):
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.post("/v1/models", json={}), 405)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_one_mib_is_413(http, chunked):
    raw = json.dumps({**GOOD, "prompt": "a" * (1 << 20)}).encode()
    content = iter([raw[i:i + 65536] for i in range(0, len(raw), 65536)]) if chunked else raw
    r = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 413)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {API_KEY}", API_KEY])
def test_missing_or_wrong_api_key_is_401(server, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.post(server + "/v1/completions", json=GOOD, headers=headers)
    error = assert_error(r, 401)
    assert error["code"] == "invalid_api_key"
    assert httpx.get(server + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server + "/health").status_code == 200  # operations endpoints stay open


def test_openai_client_raises_on_a_bad_key(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# --- speculation behind the server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_server(model_dir, offline, tmp_path_factory):
    """The app over a `specmoe`-policy engine (experts offloaded to host memory, half of
    them fit on the device), served by uvicorn on a thread of this process."""
    batch, max_len = 8, offline.engine.max_model_len
    e = offline.engine
    experts = e.policy.runtime.expert_bytes * len(e.policy.runtime.expert_keys)
    budget = int(e.model.weights.nbytes + e.cache.bytes_per_token() * batch * max_len + 0.5 * experts)
    llm = LLM(model=str(model_dir), device="cpu", policy="specmoe", offload="host", device_memory=budget,
              max_batch_size=batch, gamma=3)
    with serve_in_process(llm.engine, "tiny-mixtral") as url:
        yield url
    llm.close()


def test_speculative_batches_give_the_offline_greedy_outputs(spec_server, offline):
    client = openai.OpenAI(base_url=spec_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = PROMPTS[:8]

    def ask(prompt):
        chunks = client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [o.text for o in offline.generate(prompts, greedy(ignore_eos=True))]
    with httpx.Client(base_url=spec_server) as http:
        assert metric(http, "specmoe_draft_tokens_total") > 0
        assert 0 <= metric(http, "specmoe_acceptance_rate") <= 1
        assert metric(http, "specmoe_transfer_bytes_total") > 0
