"""The HTTP API fuzzed by schemathesis against its own OpenAPI document, on a real server on loopback.

`specmoe serve` runs a tiny checkpoint with an API key (so that the document's security
and its 401s are exercised too). schemathesis reads /openapi.json and runs every check it
has, as `schemathesis run -c all` does (no 5xx; status codes, content types, headers and
bodies, each stream event too, as the document declares them; schema-valid bodies
accepted and invalid ones refused; undeclared methods 405 with `Allow`; a missing key
401; response times), over its coverage and fuzzing phases. Valid bodies must be accepted
short of the one limit the document cannot state: a text longer than the context in
tokens. The seed is fixed and the examples per operation few, so the suite stays fast and
repeatable; FUZZ_EXAMPLES=N searches longer, and benchmarks/api_fuzz.py runs the CLI at
100 against the bundled models.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
if sys.version_info < (3, 11):  # on tests/skip_allowlist.txt; missing on a later Python, it is an error
    pytest.skip("schemathesis needs Python >= 3.11 (the test extra installs it only there)", allow_module_level=True)
import schemathesis  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serving import ServeProcess, serve_in_process, served_checkpoint  # noqa: E402

from specmoe.server import openapi  # noqa: E402
from specmoe.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5"))
SEED = 40
API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = served_checkpoint(tmp_path_factory.mktemp("served"))
    # the most tokens a request may generate below the context: the fuzzer meets that limit in the document
    served = ServeProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--api-key", API_KEY, "--no-ui",
                          "--max-output-tokens", "64")
    yield served
    served.stop()
    assert "Traceback" not in served.log(), served.log()


def fuzz_config() -> schemathesis.Config:
    """`schemathesis run -c all -n EXAMPLES --seed SEED -H 'Authorization: Bearer KEY'`, without an
    example database or a crash cache (.schemathesis/): a run is the same run each time, and
    leaves nothing in the tree."""
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        "headers": {"Authorization": f"Bearer {API_KEY}"},
        "generation": {"max-examples": EXAMPLES, "database": "none"},
        "cache": {"enabled": False},
    })
    config.projects.default.checks.update(included_check_names=["all"])
    return config


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=fuzz_config())


schema = schemathesis.pytest.from_fixture("api")


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request):
    """schemathesis 4.32's lazy schemas name each operation's subtest through the pytest
    node's `_nodeid`, which pytest 9 no longer has: give it back (the public `nodeid`)."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def accepted_unless_longer_than_the_context(ctx, response, case):
    """schemathesis's positive_data_acceptance (a body the document allows is answered), but for
    the one limit no schema can state: a text longer than the context in tokens (a 400
    `context_length_exceeded` on the prompt or the messages; the tiny model has 256 positions)."""
    if response.status_code == 400:
        error = response.json()["error"]
        if error["code"] == "context_length_exceeded" and error["param"] in ("prompt", "messages"):
            return None
    return schemathesis.checks.positive_data_acceptance(ctx, response, case)


@schema.parametrize()
def test_every_operation_answers_as_its_document_says(case):
    case.call_and_validate(excluded_checks=[schemathesis.checks.positive_data_acceptance],
                           additional_checks=[accepted_unless_longer_than_the_context])


# --- what schemathesis does not send ------------------------------------------------------


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


@settings(max_examples=4 * EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64) | st.text(max_size=16).map(str.encode))
def test_bytes_that_are_not_a_json_object_get_an_error_object(http, raw):
    try:
        if isinstance(json.loads(raw), dict):
            return  # a JSON object: schemathesis's ground
    except (ValueError, UnicodeDecodeError):
        pass
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    jsonschema.validate(r.json(), openapi.ERROR)


def test_head_and_options_answer_as_rfc_9110_asks(http):
    get, head = http.get("/v1/models"), http.head("/v1/models")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    options = http.options("/v1/completions")
    assert options.status_code == 204 and options.headers["allow"] == "OPTIONS, POST"
    wrong = http.delete("/v1/models")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, HEAD, OPTIONS"


# --- the document itself ------------------------------------------------------------------


def request_fields(document: dict, path: str) -> set[str]:
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return set(body["properties"])


def test_the_document_names_the_fields_the_server_accepts_for_its_model():
    decoder = openapi.document(openapi.ServedModel("m", 64, 100, 100))
    translator = openapi.document(openapi.ServedModel("t", 64, 100, 100, ("eng_Latn", "fra_Latn"), seq2seq=True))
    languages = {"src_lang", "tgt_lang"}
    assert request_fields(decoder, "/v1/completions") == COMPLETION_FIELDS - languages
    assert request_fields(translator, "/v1/completions") == COMPLETION_FIELDS
    assert request_fields(decoder, "/v1/chat/completions") == CHAT_FIELDS
    assert "/v1/chat/completions" not in translator["paths"]  # a translation model does not chat
    tokenless = openapi.document(openapi.ServedModel("m", 64, 100))  # no tokenizer: token ids only, no chat
    assert "/v1/chat/completions" not in tokenless["paths"] and "/tokenize" not in tokenless["paths"]


def test_a_translation_model_documents_its_languages_and_does_not_chat():
    from specmoe import LLM

    llm = LLM(model="specmoe-demo-translate", device="cpu")
    with serve_in_process(llm.engine, "translate", ui=False) as url:
        document = httpx.get(url + "/openapi.json").json()
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    llm.close()
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["tgt_lang"]["enum"] == ["eng_Latn", "fra_Latn", None]
    assert "/v1/chat/completions" not in document["paths"]
    assert chat.status_code == 400 and "/v1/completions" in chat.json()["error"]["message"]
