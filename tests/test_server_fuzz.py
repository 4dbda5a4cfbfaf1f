"""The HTTP API fuzzed against its own OpenAPI document, on a real server on loopback.

Bodies the document allows, bodies it does not (any JSON, mutated valid bodies, raw
bytes): every answer comes in time, is never a 5xx, and is either a completion that
matches the document or an OpenAI error object. Example counts are small and fixed
(derandomized) so that CI stays fast and repeatable; raise FUZZ_EXAMPLES to search longer.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schema_strategies import ANY_JSON, from_schema  # noqa: E402
from serving import ServeProcess, served_checkpoint  # noqa: E402

from specmoe.server import openapi  # noqa: E402
from specmoe.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = served_checkpoint(tmp_path_factory.mktemp("served"))
    # a short context bounds how long any accepted request generates
    served = ServeProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--max-model-len", "48")
    yield served
    served.stop()
    assert "Traceback" not in served.log(), served.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:  # the timeout is the "never hangs" check
        yield client


@pytest.fixture(scope="module")
def document(http):
    return http.get("/openapi.json").json()


def request_schema(document: dict, kind: str) -> dict:
    return document["paths"][ROUTES[kind]]["post"]["requestBody"]["content"]["application/json"]["schema"]


def check_answer(r: httpx.Response, kind: str, stream: bool) -> None:
    """No 5xx; an error is an OpenAI error object; a completion (or stream) matches the document."""
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        jsonschema.validate(r.json(), openapi.ERROR)
        return
    if not stream:
        jsonschema.validate(r.json(), openapi.COMPLETION if kind == "completion" else openapi.CHAT_COMPLETION)
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks  # an accepted request is answered, not failed
    assert any(c["choices"] and c["choices"][0]["finish_reason"] in ("stop", "length") for c in chunks), chunks


def post(http, kind: str, body) -> int:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(ROUTES[kind], content=content, headers={"Content-Type": "application/json"})
    check_answer(r, kind, stream=isinstance(body, dict) and body.get("stream") is True)
    return r.status_code


def test_the_document_names_exactly_the_fields_the_server_accepts():
    assert set(openapi.completion_request("m")["properties"]) == COMPLETION_FIELDS | {"prompt"}
    assert set(openapi.chat_request("m")["properties"]) == CHAT_FIELDS


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_bodies_the_document_allows_get_a_completion_or_an_error_object(http, document, kind):
    statuses = []

    @FUZZ
    @given(from_schema(request_schema(document, kind)))
    def run(body):
        statuses.append(post(http, kind, body))

    run()
    assert 200 in statuses  # the fuzzer reached generation, not only the checks before it


JSON = ANY_JSON | st.floats()  # and NaN and infinities, which JSON does not allow


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_valid_bodies_with_one_field_garbled_get_an_error_object_or_an_answer(http, document, kind):
    schema = request_schema(document, kind)

    @FUZZ
    @given(from_schema(schema), st.sampled_from(sorted(schema["properties"]) + ["surprise"]), JSON)
    def run(body, field, value):
        post(http, kind, {**body, field: value})

    run()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_any_json_or_bytes_gets_an_error_object(http, kind):
    @FUZZ
    @given(JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64))
    def run(raw):
        post(http, kind, raw)

    run()
