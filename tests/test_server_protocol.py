"""The server's pieces without a model: request parsing, incremental text, the engine loop.

The app tests run in-process (FastAPI's TestClient) over a fake engine that produces
known tokens, so they are fast and can make an engine step fail on purpose.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from specmoe.base.errors import SpecMoEError  # noqa: E402
from specmoe.engine.scheduler import Scheduler  # noqa: E402
from specmoe.engine.sequence import Sequence  # noqa: E402
from specmoe.engine.stats import RunCounters  # noqa: E402
from specmoe.server.app import create_app  # noqa: E402
from specmoe.server.detok import IncrementalText, releasable  # noqa: E402
from specmoe.server.protocol import (
    APIError,
    fallback_chat_prompt,
    parse_chat,
    parse_completion,
    parse_json,
    render_chat,
)

# --- incremental text ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "stops", "want"), [
    ("hello wor", ("world",), "hello "),  # "wor" may become "world": held back
    ("hello world and more", ("world",), "hello "),  # never past a stop string
    ("hello w", ("xyz",), "hello w"),  # nothing to hold back
    ("abc\ufffd", (), "abc"),  # an incomplete UTF-8 character waits for its last byte
    ("ab", ("b", "abc"), "a"),  # the earliest stop wins
])
def test_releasable_holds_back_what_may_still_change(text, stops, want):
    assert releasable(text, stops) == want


class ByteTokenizer:
    """Token id = one byte; decoding replaces incomplete UTF-8 with U+FFFD, like byte-level BPE."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streamed_pieces_add_up_to_the_final_text_without_broken_characters():
    data = list("naïve → done".encode())
    stream = IncrementalText(ByteTokenizer(), stops=("done",))
    pieces = [stream.update(data[:i]) for i in range(1, len(data) + 1)]
    final = "naïve → "
    pieces.append(stream.update(data, final_text=final))
    assert "".join(pieces) == final
    assert all("\ufffd" not in p for p in pieces)


# --- parsing -------------------------------------------------------------------------------------


def test_completion_defaults_are_openai_defaults():
    req = parse_completion({"prompt": "hi"}, "m")
    assert (req.temperature, req.top_p, req.max_tokens, req.stream) == (1.0, 1.0, None, False)
    assert req.sampling_params(prompt_len=3, max_model_len=100).max_tokens == 16
    assert req.sampling_params(prompt_len=95, max_model_len=100).max_tokens == 5  # the default fits the context


def test_chat_without_max_tokens_may_fill_the_context():
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, "m", tokenizer=object())
    assert req.sampling_params(prompt_len=30, max_model_len=100).max_tokens == 70


def test_neutral_values_of_unimplemented_fields_are_accepted():
    body = {"prompt": "hi", "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "echo": False,
            "best_of": 1, "user": "alice", "n": 1, "stop": "x"}
    assert parse_completion(body, "m").stop == ("x",)


def test_a_batch_of_one_prompt_is_unwrapped():
    assert parse_completion({"prompt": [[5, 6]]}, "m").prompt == [5, 6]
    assert parse_completion({"prompt": ["hey"]}, "m").prompt == "hey"


def test_text_content_parts_are_joined():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]}, "m", object())
    assert req.prompt == "user: ab\nassistant:"


def test_models_without_a_chat_template_use_role_colon_content_lines():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert fallback_chat_prompt(messages) == "system: be brief\nuser: hi\nassistant:"

    class NoTemplate:
        chat_template = None

    assert render_chat(NoTemplate(), messages) == fallback_chat_prompt(messages)


def test_a_chat_template_that_fails_is_a_400():
    class Broken:
        chat_template = "x"

        def apply_chat_template(self, messages):
            raise SpecMoEError("roles must alternate")

    with pytest.raises(APIError) as err:
        render_chat(Broken(), [{"role": "user", "content": "x"}])
    assert err.value.status == 400 and "roles must alternate" in err.value.message


def test_max_tokens_past_what_the_prompt_leaves_ends_at_the_context():
    req = parse_completion({"prompt": "hi", "max_tokens": 50}, "m")
    assert req.sampling_params(prompt_len=95, max_model_len=100).max_tokens == 5  # finish_reason "length"
    with pytest.raises(APIError, match="at most 99") as err:  # more than any prompt leaves: the document's bound
        parse_completion({"prompt": "hi", "max_tokens": 100}, "m").sampling_params(3, 100)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100}, "m", object())
    with pytest.raises(APIError) as err:
        chat.sampling_params(3, 100)
    assert err.value.param == "max_completion_tokens"


def test_the_servers_max_output_tokens_bounds_max_tokens_and_the_chat_default():
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, "m", object())
    assert chat.sampling_params(3, 100).max_tokens == 97  # no limit: what the context leaves
    assert chat.sampling_params(3, 100, max_output_tokens=30).max_tokens == 30
    assert parse_completion({"prompt": "hi"}, "m").sampling_params(3, 100, max_output_tokens=8).max_tokens == 8
    assert parse_completion({"prompt": "hi", "max_tokens": 30}, "m").sampling_params(3, 100, 30).max_tokens == 30
    with pytest.raises(APIError, match=r"^'max_tokens' must be at most 30, got 31: .*--max-output-tokens") as err:
        parse_completion({"prompt": "hi", "max_tokens": 31}, "m").sampling_params(3, 100, 30)
    assert err.value.status == 400 and err.value.param == "max_tokens" and "\n" not in err.value.message
    with pytest.raises(APIError, match="at most 30, got 100") as err:  # past the context too: the lower bound
        parse_completion({"prompt": "hi", "max_tokens": 100}, "m").sampling_params(3, 100, 30)
    assert err.value.code == "context_length_exceeded"


def test_serve_refuses_a_max_output_tokens_below_one_in_one_line_before_loading(capsys):
    from factories import run_cli

    code, _, err = run_cli(capsys, "serve", "--max-output-tokens", "0", "--port", "0")
    assert code == 2 and err.strip() == "specmoe: error: --max-output-tokens must be at least 1, got 0"


def test_integral_numbers_are_integers_as_json_schema_counts_them():
    req = parse_completion(parse_json(b'{"prompt": [5.0, 1e1], "max_tokens": 4.0, "n": 1.0}'), "m")
    assert req.prompt == [5, 10] and req.max_tokens == 4
    with pytest.raises(APIError, match="'max_tokens' must be an integer"):
        parse_completion(parse_json(b'{"prompt": "x", "max_tokens": 4.5}'), "m")


def test_an_unpaired_surrogate_is_a_400_not_a_tokenizer_crash():
    with pytest.raises(APIError, match="unpaired UTF-16 surrogate"):
        parse_json(b'{"prompt": "a\\ud800b"}')
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}  # a pair is one character


def test_huge_integers_and_infinities_are_rejected():
    with pytest.raises(APIError):
        parse_json(b"1" * 5000)  # past Python's int string limit
    with pytest.raises(APIError, match="temperature"):
        parse_completion(parse_json(b'{"prompt": "x", "temperature": 1e999}'), "m")


# --- the app over a fake engine ------------------------------------------------------------------


class FakeTokenizer:
    chat_template = None

    def encode(self, text):
        return [ord(c) % 50 + 3 for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakePolicy:
    broken = False

    def stats(self):
        if self.broken:
            raise RuntimeError("stats broke")
        return {"transfer_bytes": 7}


class FakeEngine:
    """The Engine surface the server uses; each step appends one known token per sequence."""

    max_model_len = 64

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.scheduler = Scheduler(max_batch_size=4)
        self.counters = RunCounters()
        self.policy = FakePolicy()
        self.fail_next_step = False
        self._next = 0

    def encode(self, prompt):
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def request_ids(self, prompt, src_lang=None, tgt_lang=None):
        return None, self.encode(prompt)

    def add_request(self, prompt, params, source_ids=None):
        seq = Sequence(self._next, self.encode(prompt), params)
        self._next += 1
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id):
        self.scheduler.cancel(request_id)

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        self.scheduler.admit(free_slots=4)
        running = [s for s in self.scheduler.running if not s.finished]
        for seq in running:
            seq.output_ids.append(len(seq.output_ids))  # tokens 0, 1, 2, ... -> "abc..."
            text = self.tokenizer.decode(seq.output_ids)
            if any(s in text for s in seq.params.stop):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_tokens:
                seq.finish_reason = "length"
        self.counters.add_step(0.0, len(running), len(running))
        done = self.scheduler.retire()
        for seq in done:
            text = self.tokenizer.decode(seq.output_ids)
            for s in seq.params.stop:
                text = text[: text.find(s)] if s in text else text
            seq.text = text
        return done


@pytest.fixture
def fake():
    engine = FakeEngine()
    with TestClient(create_app(engine, "fake")) as client:
        yield engine, client


def test_fake_completion_and_stream_agree(fake):
    _, client = fake
    body = {"prompt": "hi", "max_tokens": 6, "stop": "ef", "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["choices"][0]["text"] == "abcd" and plain["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "abcd"


def test_a_failing_engine_step_is_a_500_error_object_and_the_server_keeps_serving(fake):
    engine, client = fake
    engine.fail_next_step = True
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error" and "boom" in r.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()["choices"][0]["text"] == "abc"


def test_without_an_api_key_v1_is_open(fake):
    _, client = fake
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake"
    assert client.get("/v1/models/other").status_code == 404


def test_metrics_report_transfer_bytes_and_batch(fake):
    _, client = fake
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    text = client.get("/metrics").text
    assert 'specmoe_transfer_bytes_total{model="fake"} 7' in text
    assert 'specmoe_requests_finished_total{model="fake",finish_reason="length"} 1' in text


def test_a_dead_engine_loop_fails_health_and_requests_but_not_the_server(fake):
    engine, client = fake
    engine.policy.broken = True  # raises outside a step: the loop thread ends
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500 and "stats broke" in r.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and "stats broke" in health.json()["error"]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
