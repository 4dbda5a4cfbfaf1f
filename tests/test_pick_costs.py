"""benchmarks/pick_costs.py: each way's cost per draft pick, measured from the draft's
acceptance, and BENCHMARKS.md's tables of it."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from specmoe.bench.draft_memory import block_cost_table, pick_cost_table
from specmoe.policies.specmoe.allocation import pick_cost

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pick_costs.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("pick_costs_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_ways_cost_comes_back_from_the_acceptance_it_predicts(script):
    """The acceptance the costs predict for a mix of ways, taken back to one way, gives
    that way's cost: the measurement inverts the model."""
    costs = {"int8": 0.0004, "int2": 0.009, "substitute": 0.06}
    shares = {"int8": 0.5, "int2": 0.2, "substitute": 0.3}
    a = math.exp(-16 * sum(share * costs[w] for w, share in shares.items()))
    record = {"acceptance_per_token": a, "picks_by_way": shares}
    assert script.per_pick(record, 16, costs, "substitute") == pytest.approx(0.06)
    assert script.per_pick(record, 16, costs, "int2") == pytest.approx(0.009)
    alone = {"acceptance_per_token": math.exp(-16 * 0.009), "picks_by_way": {"int2": 1.0}}
    assert script.per_pick(alone, 16, {}, "int2") == pytest.approx(0.009)


@pytest.mark.slow  # a long scenario (a whole run of the command): .ci/run runs it after make test
def test_the_script_measures_every_way_and_block_on_the_demo_model(tmp_path):
    """A short run end to end: a cost for every way and for int2 and substitution in every
    block, as the draft really held them, and the page's tables made from the document."""
    out = tmp_path / "pick-costs.json"
    subprocess.run([sys.executable, str(SCRIPT), "--num-prompts", "4", "--max-tokens", "8", "--json", str(out)],
                   check=True, capture_output=True)
    doc = json.loads(out.read_text())
    ways = {"full", "int8", "int4", "int3", "int2", "substitute"}
    assert set(doc["costs"]) == ways and set(doc["errors"]) == ways
    assert all(math.isfinite(c) for c in doc["costs"].values())
    for record in doc["alone"]:
        assert record["picks_by_way"] == {record["draft_quant"]: 1.0}
    assert all(0 < r["picks_by_way"]["substitute"] < 1 for r in doc["substituted"])
    assert [b["layer"] for b in doc["blocks"]] == list(range(8))
    for b in doc["blocks"]:  # the block held int2 (or half substituted), every other expert int8
        assert set(b["int2_record"]["picks_by_way"]) == {"int8", "int2"}
        assert set(b["substitute_record"]["picks_by_way"]) == {"int8", "substitute"}
        assert 0 < b["residual_share"] < 2 and b["weight"] > 0
    assert len(pick_cost_table([("demo", doc)]).splitlines()) == 2 + 5
    assert len(block_cost_table([("demo", doc)]).splitlines()) == 2 + 8


def test_the_tables_are_made_from_the_document():
    costs = {"full": 0.0, "int8": 0.0005, "int4": 0.002, "int3": 0.004, "int2": 0.008, "substitute": 0.06}
    errors = {"full": 0.0, "int8": 0.01, "int4": 0.1, "int3": 0.2, "int2": 0.4, "substitute": 1.2}
    blocks = [{"layer": 0, "residual_share": 0.98, "weight": 3.5, "int2": 0.03, "substitute": 0.3},
              {"layer": 1, "residual_share": 0.2, "weight": 0.15, "int2": 0.01, "substitute": 0.1}]
    # error_costs: what the engine's model said when the document was written; the table shows today's
    doc = {"costs": costs, "errors": errors, "error_costs": {w: e / 10 for w, e in errors.items()}, "blocks": blocks}
    rows = [line.strip("| ").split(" | ") for line in pick_cost_table([("demo", doc)]).splitlines()[2:]]
    model = {w: f"{pick_cost(e) / pick_cost(errors['int3']):.2f}" for w, e in errors.items()}
    assert rows[3] == ["demo", "int2", "0.400", "0.00800", "2.00", model["int2"]] and model["int2"] != "2.00"
    assert rows[4] == ["demo", "substitute", "1.200", "0.06000", "15.00", model["substitute"]]
    rows = [line.strip("| ").split(" | ") for line in block_cost_table([("demo", doc)]).splitlines()[2:]]
    assert rows == [["demo", "0", "0.980", "3.50", "0.03000", "1.50", "0.30000", "1.50"],
                    ["demo", "1", "0.200", "0.15", "0.01000", "0.50", "0.10000", "0.50"]]
