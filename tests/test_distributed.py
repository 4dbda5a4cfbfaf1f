"""Engine replicas on a local Ray cluster started by this module (2 CPUs, half a CPU per
replica): offline generation over 2 replicas against one engine, a replica killed through
Ray mid-run, and `serve --replicas 2` on Ray Serve driven by the openai client against the
single-process server, before and after one replica is killed.

Ray's own startup (the cluster, then Serve's controller and proxy) takes 10-30 s on 2
cores; the cluster starts once for the module. The module is the slow set (about 100 s of
one worker's time within make test, a third of it): .ci/run runs it after make test."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")  # ray.serve (1-2 s to import) only where Serve runs: serve_port
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from factories import make_checkpoint, random_prompts, run_cli  # noqa: E402
from serving import free_port, serve_in_process  # noqa: E402

from specmoe import LLM, SamplingParams, SpecMoEError  # noqa: E402
from specmoe.base.paths import default_model_dir  # noqa: E402
from specmoe.distributed import ReplicaOptions, ReplicatedLLM  # noqa: E402
from specmoe.distributed.cluster import cpu_threads  # noqa: E402
from specmoe.distributed.serve import start_serving, stop_serving  # noqa: E402

NAME = "tiny-mixtral"
REPLICA_CPUS = 0.5
# SpecMoE with the experts on disk and int8 draft copies: seeded sampling then depends on
# nothing but the sequence itself, so it must match one engine too
ENGINE = dict(device="cpu", policy="specmoe", offload="disk", device_memory="50%", draft_quant="int8",
              max_model_len=64, max_batch_size=4)
PROMPTS = random_prompts(12, 128, 3, 20, seed=5)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(len(PROMPTS))]
TEXTS = [f"The built-in function {w} returns" for w in ("len", "sum", "max", "min", "abs", "any", "all", "id")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Mixtral with the demo model's tokenizer (its vocabulary and special ids)."""
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("replicas") / NAME, vocab_size=4096,
                           bos_token_id=0, eos_token_id=1, pad_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_engine(model_dir):
    # on a replica's threads (cpu_threads): torch's float32 products may add in another order
    # on another thread count, and a seeded sample then take another token
    llm = LLM(model=str(model_dir), **ENGINE, threads=cpu_threads({"num_cpus": REPLICA_CPUS}, None))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def replicas(cluster, model_dir):
    """Chunks of 2 prompts: 6 for the 12 prompts, so that each replica holds two at a time."""
    with ReplicatedLLM(str(model_dir), replicas=2, replica_cpus=REPLICA_CPUS, **{**ENGINE, "max_batch_size": 2}) as llm:
        yield llm


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


# --- offline ------------------------------------------------------------------------------------


def test_generate_over_two_replicas_writes_one_engines_outputs_in_order(cluster, model_dir, one_engine, tmp_path,
                                                                        capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli(capsys, "generate", "--replicas", 2, "--replica-cpus", REPLICA_CPUS, "--model",
                                model_dir, "--prompts-file", prompts, "--max-tokens", 8, "--ignore-eos",
                                "--batch-size", 3, "--output", out, "--json", "--device", "cpu", "--policy",
                                "specmoe", "--offload", "disk", "--device-memory", "50%", "--max-model-len", 64)
    assert code == 0, err
    want = one_engine.generate(PROMPTS, GREEDY)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(len(PROMPTS)))  # each once, in input order
    assert [line["token_ids"] for line in lines] == token_ids(want)
    stats = json.loads(stdout)["stats"]
    assert stats["token_ids_sha256"] == one_engine.last_stats["token_ids_sha256"]
    assert stats["num_requests"] == len(PROMPTS) and stats["generated_tokens"] == 8 * len(PROMPTS)
    assert [r["chunks"] > 0 for r in stats["replicas"]] == [True, True]  # both replicas took a share
    assert sum(r["num_requests"] for r in stats["replicas"]) == len(PROMPTS)


def test_seeded_sampling_over_replicas_matches_one_engine(replicas, one_engine):
    assert token_ids(replicas.generate(PROMPTS, SEEDED)) == token_ids(one_engine.generate(PROMPTS, SEEDED))


def test_a_replica_killed_mid_run_is_restarted_and_every_prompt_completes_once(replicas, one_engine):
    victim = replicas.replicas[1]
    before = ray.get(victim.worker.remote())
    finished = []

    def kill_on_first_result(n):
        if not finished:  # one chunk of 6 is done: replica 1 holds one or two it has not finished
            ray.kill(victim, no_restart=False)
        finished.append(n)

    got = replicas.generate(PROMPTS, GREEDY, progress=kill_on_first_result)
    assert token_ids(got) == token_ids(one_engine.generate(PROMPTS, GREEDY))
    after = ray.get(victim.worker.remote())
    assert after != before  # the replica runs in a new process
    stats = replicas.last_stats["replicas"][1]
    assert stats["restarts"] == 1 and stats["workers"][-1] == after and stats["chunks"] >= 1
    assert sum(finished) == len(PROMPTS)  # no prompt counted twice


def test_a_budget_too_small_is_the_replicas_one_line_error(cluster, model_dir):
    with pytest.raises(SpecMoEError, match="raise --device-memory to at least"):
        ReplicatedLLM(str(model_dir), replicas=1, replica_cpus=REPLICA_CPUS,
                      **{**ENGINE, "device_memory": "1KiB"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replica_on_a_gpu_gets_one_and_matches_one_engine_there(cluster, model_dir):
    want = LLM(model=str(model_dir), **{**ENGINE, "device": "cuda"}).generate(PROMPTS, GREEDY)
    with ReplicatedLLM(str(model_dir), replicas=1, **{**ENGINE, "device": "auto"}) as llm:
        device = ray.get(llm.replicas[0].__ray_call__.remote(lambda replica: str(replica.llm.engine.device)))
        assert device.startswith("cuda")  # Ray gave the replica a GPU and the engine took it
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == token_ids(want)


# --- online: Ray Serve --------------------------------------------------------------------------


SERVED = {**ENGINE, "offload": "host"}


@pytest.fixture(scope="module")
def serve_port(cluster):
    """Serve's proxy binds its port once per cluster: every deployment here uses it."""
    pytest.importorskip("ray.serve")
    yield free_port()
    stop_serving()


@dataclass
class Deployment:
    url: str
    answered: int = 0  # requests it has answered, as the tests count them (ask_served)


@pytest.fixture(scope="module")
def served(serve_port, model_dir):
    start_serving(str(model_dir), SERVED, ReplicaOptions(2, REPLICA_CPUS), name=NAME, host="127.0.0.1",
                  port=serve_port)
    return Deployment(f"http://127.0.0.1:{serve_port}")


@pytest.fixture(scope="module")
def single_server(one_engine):
    with serve_in_process(one_engine.engine, NAME) as url:
        yield url


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask_all(url: str) -> list[tuple[str, str]]:
    """8 concurrent clients, each a completion whole and a chat completion streamed."""
    api, start = client(url), threading.Barrier(len(TEXTS))

    def ask(text):
        start.wait()
        whole = api.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0)
        stream = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                             max_tokens=12, temperature=0, stream=True)
        return whole.choices[0].text, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(len(TEXTS)) as pool:
        return list(pool.map(ask, TEXTS))


def ask_served(served: Deployment) -> list[tuple[str, str]]:
    answers = ask_all(served.url)
    served.answered += 2 * len(TEXTS)
    return answers


def metric_lines(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{")}


def wait_for(condition, timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def replica_actors() -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")]


def test_a_serve_replica_that_cannot_start_is_the_users_one_line_error(serve_port, model_dir):
    with pytest.raises(SpecMoEError, match="raise --device-memory to at least"):
        start_serving(str(model_dir), {**SERVED, "device_memory": "1KiB"}, ReplicaOptions(1, REPLICA_CPUS),
                      name=NAME, host="127.0.0.1", port=serve_port)


def settled(served: Deployment) -> dict[str, float]:
    """Per replica, the requests /metrics counts, once it counts every request answered so far
    (each replica reports every second)."""
    total = lambda: sum(metric_lines(served.url, "specmoe_requests_total").values())  # noqa: E731
    wait_for(lambda: total() == served.answered, 30, f"every replica's report of {served.answered} requests")
    return metric_lines(served.url, "specmoe_replica_requests_total")


def test_serve_replicas_answer_concurrent_clients_like_one_server(served, single_server):
    want = ask_all(single_server)
    assert ask_served(served) == want
    assert all(whole and streamed for whole, streamed in want)


def test_metrics_add_up_both_replicas(served):
    before = settled(served)
    ask_served(served)
    after = settled(served)
    grew = {replica: n - before.get(replica, 0) for replica, n in after.items() if n > before.get(replica, 0)}
    assert len(grew) == 2 and sum(grew.values()) == 2 * len(TEXTS)  # both took some of these requests


def test_a_killed_serve_replica_is_replaced_while_the_other_answers(served, single_server):
    settled(served)  # the victim has reported all it answered
    victim = replica_actors()[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    assert ask_served(served) == ask_all(single_server)  # at once, without retries
    wait_for(lambda: len(replica_actors()) == 2 and victim not in replica_actors(), what="a new replica")
    from ray import serve

    wait_for(lambda: serve.status().applications["specmoe"].deployments["engine"].replica_states == {"RUNNING": 2},
             what="the new replica to run")
    settled(served)  # the counters, the dead replica's included
