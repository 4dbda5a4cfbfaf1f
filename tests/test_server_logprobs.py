"""Log-probabilities over HTTP: `/v1/completions` with `logprobs` and `echo` (OpenAI's
legacy format), `/v1/chat/completions` with `logprobs`/`top_logprobs`, streamed per
chunk, and the tokenizer endpoints lm-evaluation-harness uses.

The app runs in this process (uvicorn on a thread) over a tiny random Mixtral checkpoint
that carries the demo model's real byte-level BPE tokenizer, under resident, ondemand and
specmoe engines; values are checked against transformers' log-softmax.
"""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from factories import expert_share_budget, hf_logits, make_checkpoint  # noqa: E402
from serving import serve_in_process  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.paths import DEMO_MODEL_DIR  # noqa: E402

ATOL = 1e-4
MODEL = "tiny-bpe"
PROMPT = "The built-in function len returns the number of items"
MAX_LEN, BATCH = 128, 4
POLICIES = {
    "resident": {},
    "ondemand": {"offload": "host"},
    "specmoe": {"offload": "host", "gamma": 3, "draft_quant": "none"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Vocabulary and special ids of the demo tokenizer (<s> 0, </s> 1, <pad> 2)."""
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("bpe") / MODEL, vocab_size=4096,
                           bos_token_id=0, eos_token_id=1, pad_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, path / name)
    return path


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", max_batch_size=BATCH, max_model_len=MAX_LEN)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def servers(model_dir, offline):
    """policy -> base URL of the app over an engine with that policy, each started on first use."""
    started, llms = {}, []
    budget = expert_share_budget(offline, 0.5, BATCH, MAX_LEN)
    with ExitStack() as stack:

        def get(policy: str) -> str:
            if policy not in started:
                extra = {"device_memory": budget, **POLICIES[policy]} if policy != "resident" else {}
                llms.append(LLM(model=str(model_dir), device="cpu", policy=policy, max_batch_size=BATCH,
                                max_model_len=MAX_LEN, **extra))
                started[policy] = stack.enter_context(serve_in_process(llms[-1].engine, MODEL))
            return started[policy]

        yield get
    for llm in llms:
        llm.close()


@pytest.fixture(scope="module")
def http(servers):
    with httpx.Client(base_url=servers("resident"), timeout=60) as client:
        yield client


def completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0, "ignore_eos": True, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def reference(model_dir, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(model_dir, [ids])[0], dim=-1)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_echoed_completion_logprobs_equal_transformers_log_softmax(servers, offline, model_dir, policy):
    out = completion(servers(policy), prompt=PROMPT, max_tokens=8, logprobs=5, echo=True)
    choice = choice0(out)
    prompt_ids = offline.tokenizer.encode(PROMPT)
    generated = offline.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    ids = prompt_ids + generated
    want = reference(model_dir, ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - float(want[j - 1, ids[j]])) <= ATOL, f"position {j}"
        top = sorted(lp["top_logprobs"][j].values(), reverse=True)[:5]
        assert top == pytest.approx(want[j - 1].topk(5).values.tolist(), abs=ATOL), f"position {j}"
    assert choice["text"].startswith(PROMPT)
    assert "".join(lp["tokens"][: len(prompt_ids)]) == PROMPT
    assert out["usage"]["completion_tokens"] == 8


def choice0(out: dict) -> dict:
    assert len(out["choices"]) == 1
    return out["choices"][0]


def test_text_offsets_are_where_each_token_starts(http):
    lp = choice0(completion(str(http.base_url), prompt=PROMPT, max_tokens=0, logprobs=0, echo=True))["logprobs"]
    starts = [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == starts and "".join(lp["tokens"]) == PROMPT


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_only(http, offline):
    out = completion(str(http.base_url), prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    choice = choice0(out)
    want = offline.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(want), "completion_tokens": 0, "total_tokens": len(want)}
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and got[1:] == pytest.approx([p.logprob for p in want[1:]], abs=ATOL)


def test_without_echo_logprobs_cover_the_completion_only(http, offline):
    out = completion(str(http.base_url), prompt=PROMPT, max_tokens=6, logprobs=2)
    lp = choice0(out)["logprobs"]
    want = offline.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))[0].logprobs
    assert lp["token_logprobs"] == pytest.approx([p.logprob for p in want], abs=ATOL)
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])  # the 2 most likely and the chosen token
    assert lp["text_offset"][0] == 0 and not choice0(out)["text"].startswith(PROMPT)


def test_streamed_logprobs_add_up_to_the_whole_answer(http):
    body = dict(prompt=PROMPT, max_tokens=8, logprobs=3, echo=True)
    whole = choice0(completion(str(http.base_url), **body))["logprobs"]
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "temperature": 0, "ignore_eos": True,
                                                       "stream": True, **body}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert len(parts) >= 2  # the echoed prompt, then the generated tokens as they came
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole[key], key


@pytest.mark.parametrize("policy", ["resident", "specmoe"])
def test_chat_logprobs_are_the_models_in_chat_format(servers, offline, policy):
    client = openai.OpenAI(base_url=servers(policy) + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What does len do?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    prompt = "user: What does len do?\nassistant:"  # the demo tokenizer has no chat template
    want = offline.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert [c.logprob for c in content] == pytest.approx([p.logprob for p in want.logprobs], abs=ATOL)
    assert [[t.logprob for t in c.top_logprobs] for c in content][0] == pytest.approx(
        [v for _, v in want.logprobs[0].top], abs=ATOL)
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(bytes(c.bytes).decode() == c.token for c in content if c.token.isascii())


def test_streamed_chat_carries_logprobs_per_chunk(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "logprobs": True}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole and len(whole) == 5


BAD = [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": "5"}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"max_tokens": 0, "logprobs": True}, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p.split('/')[-1]}-{json.dumps(b)}" for p, b, _ in BAD])
def test_bad_logprobs_values_are_a_400_naming_the_field(http, path, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}
    r = http.post(path, json={"model": MODEL, **base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_gets_a_bad_request_for_too_many_logprobs(http):
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="between 0 and 20"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=25)


def test_tokenizer_endpoints_tokenize_like_the_server(http, offline):
    info = http.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("</s>", "<s>", MAX_LEN)
    ids = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert ids == offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    r = http.post("/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
