"""Trace files: what the engine writes is what the simulator reads."""

import json

import pytest

from specmoe.base.trace import LayerRouting, StepRecord, TraceWriter, read_trace
from specmoe.costmodel.shapes import PRESETS


def _records():
    return [
        StepRecord(0, "prefill", 2, 10, [LayerRouting(0, {1: 7, 3: 13}, fetched=[1, 3], hits=0)],
                   timings={"wall_s": 0.5}, transfer_bytes=4096),
        StepRecord(1, "draft", 2, 2, [LayerRouting(0, {1: 2, 5: 2})], draft_set={0: [1, 3]}),
        StepRecord(2, "verify", 2, 8, [LayerRouting(0, {1: 9, 5: 7}, fetched=[5], hits=1)],
                   accepted_lengths=[3, 1], draft_set={0: [1, 3]},
                   timings={"wall_s": 0.2, "compute_s": 0.05, "transfer_wait_s": 0.15}, transfer_bytes=2048),
    ]


def test_trace_round_trips(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, model=PRESETS["mixtral-8x7b"], config={"policy": "specmoe", "gamma": 3}) as tw:
        for r in _records():
            tw.write(r)
    header, records = read_trace(path)
    assert header["model"]["num_experts"] == 8 and header["config"]["gamma"] == 3
    assert records == _records()


def test_trace_is_json_lines_with_a_header_first(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, model={"name": "demo"}) as tw:
        tw.write(_records()[0])
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["format"] == "specmoe-trace"
    assert json.loads(lines[1])["layers"][0]["expert_tokens"] == {"1": 7, "3": 13}


def test_layer_distinct_counts_experts_with_tokens():
    assert LayerRouting(0, {1: 3, 2: 0, 7: 1}).distinct == 2


def test_unknown_step_kind_is_rejected():
    with pytest.raises(ValueError, match="kind"):
        StepRecord(0, "sample", 1, 1)


def test_non_trace_file_is_rejected_naming_it(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="x.jsonl"):
        read_trace(f)


def test_malformed_record_names_its_line(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as tw:
        tw.write(_records()[0])
    with open(path, "a") as f:
        f.write('{"step": 1}\n')
    with pytest.raises(ValueError, match="line 3"):
        read_trace(path)
