"""`specmoe replay`: a trace recorded by the engine, executed at a (scaled) Mixtral layer
shape on the CPU, per policy; the mapping and derivation helpers; one-line errors."""

import json
import random
from collections import Counter

import pytest
from factories import random_prompts

from specmoe import LLM, SamplingParams
from specmoe.base.trace import LayerRouting, StepRecord
from specmoe.cli import main
from specmoe.tools.replay.schedule import LayerMap, split_verify

SMALL = ["--model-shape", "mixtral-8x7b", "--scale", "0.015625", "--layers", "1", "--max-steps", "2",
         "--device", "cpu"]
FIELDS = {"policy", "batch_size", "source", "layer_s", "model_step_s", "tokens_per_step", "decode_tokens_per_s",
          "decode_tokens_per_s_experts_only", "transfer_bytes_per_token", "fetched_per_layer", "predicted_layer_s",
          "prediction_error", "simulate_decode_tokens_per_s", "steps_timed", "pool_slots"}


@pytest.fixture(autouse=True)
def _caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def traces(tiny_ckpt, tmp_path_factory):
    """A specmoe and an ondemand trace of the same 4 prompts at batch 4 on a tiny Mixtral."""
    path = tiny_ckpt("mixtral")
    out = tmp_path_factory.mktemp("traces")
    prompts = random_prompts(4, 128, 3, 8, seed=5)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    files = {}
    for policy, extra in (("specmoe", {"gamma": 3}), ("ondemand", {})):
        files[policy] = out / f"{policy}-b4.jsonl"
        llm = LLM(model=str(path), device="cpu", policy=policy, offload="host", max_batch_size=4, max_model_len=64,
                  offload_dir=str(out), trace=str(files[policy]), **extra)
        llm.generate(prompts, params)
        llm.close()
    return files


def replay(argv, capsys):
    rc = main(["replay", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_replay_reports_every_policy_from_a_specmoe_trace(traces, capsys):
    rc, out, err = replay(["--trace", str(traces["specmoe"]), *SMALL, "--hardware", "h100-pcie5", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    recs = {r["policy"]: r for r in doc["records"]}
    assert set(recs) == {"ondemand", "overlap", "caching", "specmoe"}
    for r in recs.values():
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["batch_size"] == 4 and r["layer_s"] > 0 and r["steps_timed"] >= 1
    assert recs["specmoe"]["source"] == "exact" and recs["ondemand"]["source"] == "derived"
    assert recs["specmoe"]["transfer_bytes_per_step"] > 0
    assert 1.0 <= recs["specmoe"]["tokens_per_step"] <= 4.0
    assert all(recs[p]["tokens_per_step"] == 1.0 for p in ("ondemand", "overlap", "caching"))
    assert recs["ondemand"]["transfer_bytes_per_token"] >= recs["caching"]["transfer_bytes_per_token"]
    assert {s["over"] for s in doc["speedups"]} == {"ondemand", "overlap", "caching"}
    assert doc["config"]["replayed_shape"]["hidden"] == 64 and doc["config"]["moe_layers"] == 32
    assert any("oracle" in n for n in doc["assumptions"])


def test_a_decode_trace_gives_the_baselines_exact_routing(traces, capsys):
    rc, out, err = replay(["--trace", f"specmoe={traces['specmoe']}", "--trace", f"ondemand={traces['ondemand']}",
                           *SMALL, "--policies", "ondemand,caching,specmoe", "--hardware", "h100-pcie5", "--json"],
                          capsys)
    assert rc == 0, err
    recs = {r["policy"]: r for r in json.loads(out)["records"]}
    assert recs["ondemand"]["source"] == "exact" and recs["caching"]["source"] == "exact"
    assert recs["ondemand"]["trace"].endswith("ondemand-b4.jsonl")


def test_table_with_measured_profile_and_disk_tier(traces, tmp_path, capsys):
    out_json = tmp_path / "replay.json"
    rc, out, err = replay(["--trace", str(traces["specmoe"]), *SMALL, "--policies", "ondemand,specmoe",
                           "--offload", "disk", "--offload-dir", str(tmp_path), "--output", str(out_json)], capsys)
    assert rc == 0, err
    assert out.startswith("specmoe replay:") and "replay-measured" in out
    assert "specmoe speedup" in out
    doc = json.loads(out_json.read_text())
    assert doc["config"]["offload"] == "disk" and doc["hardware"]["slow_tier"] == "disk"
    assert [r["policy"] for r in doc["records"]] == ["ondemand", "specmoe"]


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--help"])
    assert exit_.value.code == 0 and "--model-shape" in capsys.readouterr().out


def test_layer_and_expert_mapping():
    m = LayerMap(trace_layers=(0, 2, 4), physical_layers=2, num_experts=8)
    assert [m.physical(m.rank(l)) for l in (0, 2, 4)] == [0, 1, 0]
    assert m.physical(3 * 5 + 1) == 1  # running ids (pass x L + rank) map like their rank
    assert m.counts({3: 2, 11: 5, 12: 1, 7: 0}) == {3: 7, 4: 1}
    assert m.experts([1, 9, 10]) == [1, 2]


def test_split_verify_keeps_per_expert_totals():
    counts = {0: 9, 3: 4, 5: 7, 6: 4}  # B=4, gamma=2: 12 positions, top-2: 24 picks
    r = StepRecord(step=0, kind="verify", batch_size=4, positions=12, layers=[LayerRouting(0, dict(counts))])
    parts = split_verify(r, random.Random(0))
    assert len(parts) == 3 and all(p.kind == "decode" and p.positions == 4 for p in parts)
    assert all(sum(p.layers[0].expert_tokens.values()) == 8 for p in parts)
    total = Counter()
    for p in parts:
        total.update(p.layers[0].expert_tokens)
    assert dict(total) == counts


@pytest.mark.parametrize("args, message", [
    (["--trace", "/nonexistent/t.jsonl"], "no such file"),
    (["--policies", "ondemand,resident"], "cannot be replayed"),
    (["--scale", "0"], "--scale"),
    (["--layers", "0"], "--layers"),
    (["--batch-sizes", "3"], "no trace recorded at batch size 3"),
    (["--trace", "bogus=x.jsonl"], "is not a policy"),
    (["--model-shape", "no-such-model"], "unknown model shape"),
    (["--dtype", "int8"], "--dtype"),
    (["--hardware", "no-such-gpu"], "unknown hardware profile"),
])
def test_bad_input_is_one_line_with_exit_2(traces, capsys, args, message):
    base = ["--trace", str(traces["specmoe"]), *SMALL]
    rc, out, err = replay(base + args, capsys)
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_a_file_that_is_not_a_trace_is_refused(tmp_path, capsys):
    bad = tmp_path / "notes.jsonl"
    bad.write_text('{"hello": 1}\n')
    rc, _, err = replay(["--trace", str(bad), *SMALL], capsys)
    assert rc == 2 and "header" in err


def test_what_does_not_fit_in_host_memory_is_refused_before_allocating(traces, tmp_path, capsys):
    huge = tmp_path / "config.json"  # one expert of 100 GB: no machine holds a layer of them
    huge.write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                                "num_hidden_layers": 2, "hidden_size": 65536,
                                "num_attention_heads": 64, "num_experts_per_tok": 2, "num_local_experts": 8,
                                "intermediate_size": 262144, "vocab_size": 1000, "torch_dtype": "bfloat16"}))
    rc, _, err = replay(["--trace", str(traces["specmoe"]), "--model-shape", str(huge), "--device", "cpu"], capsys)
    assert rc == 2 and "host memory" in err and "--layers" in err and "--scale" in err
