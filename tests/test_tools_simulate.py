"""`specmoe simulate`: records per policy and batch size, assumptions, errors."""

import argparse
import json

import numpy as np
import pytest

from specmoe.base.config import MAX_GAMMA
from specmoe.base.trace import LayerRouting, StepRecord, TraceWriter
from specmoe.costmodel.cost_model import Scenario, estimate
from specmoe.costmodel.hardware import load_profile
from specmoe.costmodel.routing import RoutingModel, acceptance_for_tokens_per_step
from specmoe.costmodel.shapes import PRESETS
from specmoe.tools import simulate

REQUIRED_FIELDS = {"policy", "batch_size", "decode_tokens_per_s", "transfer_bytes_per_token", "step_s",
                   "tokens_per_step", "speedup_vs_ondemand", "speedup_vs_overlap", "speedup_vs_caching", "fits"}


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="specmoe")
    simulate.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))


def test_json_has_a_record_per_policy_and_batch(capsys):
    rc, out, _ = run(["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--batch-sizes", "1,16,256",
                      "--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    recs = doc["records"]
    for policy in ("ondemand", "overlap", "caching", "specmoe", "auto"):
        assert sorted(r["batch_size"] for r in recs if r["policy"] == policy) == [1, 16, 256]
    for r in recs:
        assert REQUIRED_FIELDS <= set(r)
    assert all(r["speedup_vs_ondemand"] == 1.0 for r in recs if r["policy"] == "ondemand")
    assert {r["chosen_policy"] for r in recs if r["policy"] == "auto"} <= set(simulate.POLICY_ROWS)
    assert doc["config"]["model_shape"] == "mixtral-8x7b"


def test_defaults_are_stated_when_there_is_no_trace(capsys):
    rc, out, _ = run(["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--batch-sizes", "4",
                      "--json"], capsys)
    text = " ".join(json.loads(out)["assumptions"])
    assert "assumed (no trace)" in text and "acceptance" in text and "locality" in text


def test_auto_rows_name_the_exact_plan(capsys):
    rc, out, _ = run(["--model-shape", "mixtral-8x7b", "--hardware", "a100-80gb", "--batch-sizes", "1,16,256",
                      "--json"], capsys)
    auto = {r["batch_size"]: (r["chosen_policy"], r["gamma"], r["draft_experts"], r["draft_quant"])
            for r in json.loads(out)["records"] if r["policy"] == "auto"}
    assert auto == {1: ("host", None, None, None), 16: ("specmoe", MAX_GAMMA, 2, "int8"),
                    256: ("specmoe", MAX_GAMMA, 0, "int8")}


def test_paper_setting_reports_specmoe_speedup(capsys):
    rc, out, _ = run(["--model-shape", "nllb-moe-54b", "--hardware", "h100-pcie5", "--batch-sizes", "256",
                      "--gamma", "10", "--draft-experts", "4", "--tokens-per-step", "7.265", "--json"], capsys)
    recs = {r["policy"]: r for r in json.loads(out)["records"]}
    spec, ondemand = recs["specmoe"], recs["ondemand"]
    assert spec["tokens_per_step"] == pytest.approx(7.265, abs=1e-3)
    # the record's speedup: tokens per sequence per second, from its own step times ...
    assert spec["speedup_vs_ondemand"] == pytest.approx(7.265 * ondemand["step_s"] / spec["step_s"], rel=1e-6)
    # ... which are the cost model's for the paper's setting, asked directly
    sc = Scenario(PRESETS["nllb-moe-54b"], load_profile("h100-pcie5"))
    a = acceptance_for_tokens_per_step(7.265, 10)
    want = estimate("specmoe", sc, 256, gamma=10, draft_experts=4, acceptance=a).step_s
    assert (spec["step_s"], ondemand["step_s"]) == pytest.approx((want, estimate("ondemand", sc, 256).step_s), rel=1e-9)


def test_table_output_names_policies_and_assumptions(capsys):
    rc, out, _ = run(["--model-shape", "llama-4-scout", "--hardware", "h100-pcie5-ssd", "--batch-sizes", "1,8"],
                     capsys)
    assert rc == 0
    assert "specmoe" in out and "caching" in out and "assumed" in out


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    rc, _, _ = run(["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--batch-sizes", "1,16",
                    "--json", "--plot", str(png)], capsys)
    assert rc == 0 and png.stat().st_size > 1000


def _demo_trace(path, E=16, k=2, B=4, gamma=3):
    m = RoutingModel(0.8, 0.4)
    rng = np.random.default_rng(0)
    q = m.hotness(E)
    with TraceWriter(path, model={"name": "demo", "num_experts": E, "top_k": k}, config={"gamma": gamma}) as tw:
        for step in range(10):
            for kind, L in (("decode", 1), ("verify", gamma + 1)):
                counts = {}
                for e in rng.choice(E, size=B * L * k, p=q):
                    counts[int(e)] = counts.get(int(e), 0) + 1
                tw.write(StepRecord(step, kind, B, B * L, [LayerRouting(0, counts)],
                                    accepted_lengths=[2, 3, 0, 1] if kind == "verify" else [],
                                    draft_set={0: [0, 1, 2, 3]} if kind == "verify" else {}))


def test_trace_supplies_routing_and_acceptance_and_says_so(tmp_path, capsys):
    trace = tmp_path / "demo.jsonl"
    _demo_trace(trace)
    rc, out, _ = run(["--trace", str(trace), "--model-shape", "nllb-moe-54b", "--hardware", "h100-pcie5",
                      "--batch-sizes", "16", "--json"], capsys)
    doc = json.loads(out)
    assert rc == 0
    assert doc["config"]["acceptance_source"].startswith("trace")
    assert doc["config"]["acceptance"] == pytest.approx(6 / 9)  # 6 accepted, 3 rejections
    assert any("fitted to trace" in a and "E=128" in a for a in doc["assumptions"])


@pytest.mark.parametrize("argv,needle", [
    (["--model-shape", "gpt-5", "--hardware", "h100-pcie5"], "unknown model shape"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "tpu-v9"], "unknown hardware profile"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--batch-sizes", "1,x"], "--batch-sizes"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--batch-sizes", "0"], "--batch-sizes"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--draft-experts", "8"], "--draft-experts"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--acceptance", "1.5"], "--acceptance"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--gamma", "0"], "--gamma"),
    (["--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--trace", "/nonexistent.jsonl"], "trace"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv, needle, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    assert needle in err and err.count("\n") == 1
