"""lm-evaluation-harness against `specmoe serve`, as docs/EVALUATION.md tells users to run it.

`specmoe serve` runs the demo model with SpecMoE (experts offloaded, 30 % of them fit);
lm-eval's `local-completions` model, with nothing but the server's URL and model name,
runs a log-likelihood task (multiple choice) and a generation task built from the
held-out Python docs (benchmarks/eval_tasks.py), at a tiny size. Every per-question
log-likelihood and every generation must equal what lm-eval's `hf` model (transformers)
gives on the same checkpoint, and so must the metrics.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serving import free_port, wait_until_healthy  # noqa: E402

from specmoe.base.paths import DEMO_MODEL_DIR  # noqa: E402

pytestmark = pytest.mark.slow  # a long scenario: .ci/run runs it after make test

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["pydoc_mc", "pydoc_gen"]
ATOL = 1e-4
STARTUP_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("eval_tasks", ROOT / "benchmarks" / "eval_tasks.py")
    eval_tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_tasks)
    return eval_tasks.write_tasks(tmp_path_factory.mktemp("tasks"), questions=6, generations=3, max_gen_toks=8)


class Server:
    """`specmoe serve` in a subprocess; `url()` waits until it answers /health."""

    def __init__(self, log_path: Path):
        self.port, self.log_path = free_port(), log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specmoe.cli", "serve", "--port", str(self.port), "--device", "cpu",
                 "--policy", "specmoe", "--offload", "host", "--device-memory", "30%", "--max-model-len", "256"],
                stdout=log, stderr=subprocess.STDOUT)

    def url(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        wait_until_healthy(url, self.proc, self.log_path, STARTUP_TIMEOUT_S)
        return url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Started first: it loads while the transformers evaluation runs."""
    server = Server(tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.proc.terminate()
    server.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def quiet_offline(tmp_path_factory):
    """No model hub; lm-eval's dataset cache in a folder of the tests; one torch thread for
    transformers (on 2 busy cores, two threads make its small matmuls several times slower)."""
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            mp.setenv(name, "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)


def evaluate(task_dir, model, model_args: str | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, log_samples=True,
                           task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), device="cpu")


@pytest.fixture(scope="module")
def transformers_results(server, task_dir, quiet_offline):
    """lm-eval's `hf` model on the demo checkpoint (the server loads meanwhile)."""
    return evaluate(task_dir, "hf", f"pretrained={DEMO_MODEL_DIR},dtype=float32")


def per_question(results: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_evaluation(ours: dict, theirs: dict) -> None:
    ours_mc, theirs_mc = per_question(ours, "pydoc_mc"), per_question(theirs, "pydoc_mc")
    assert len(ours_mc) == len(theirs_mc) == 6
    for q, (a, b) in enumerate(zip(ours_mc, theirs_mc)):
        assert [float(x[0]) for x in a] == pytest.approx([float(x[0]) for x in b], abs=ATOL), f"question {q}"
        assert [str(x[1]) for x in a] == [str(x[1]) for x in b], f"question {q}: is_greedy"
    assert per_question(ours, "pydoc_gen") == per_question(theirs, "pydoc_gen")
    for task, metrics in (("pydoc_mc", ("acc,none", "acc_norm,none")), ("pydoc_gen", ("exact_match,none",))):
        for metric in metrics:
            assert ours["results"][task][metric] == theirs["results"][task][metric], (task, metric)


def test_lm_eval_through_the_server_equals_lm_eval_through_transformers(server, task_dir, transformers_results):
    ours = evaluate(task_dir, "local-completions",
                    f"base_url={server.url()}/v1/completions,model=specmoe-demo,num_concurrent=4")
    assert_same_evaluation(ours, transformers_results)


def test_lm_eval_with_the_offline_model_class_equals_transformers(task_dir, transformers_results):
    from specmoe.tools.harness import SpecMoELM

    lm = SpecMoELM(policy="caching", offload="host", device_memory="30%", batch_size=8, max_model_len=256)
    ours = evaluate(task_dir, lm)
    assert lm.llm.last_stats["transfer_bytes"] > 0  # experts really moved
    assert_same_evaluation(ours, transformers_results)
