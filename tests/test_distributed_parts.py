"""The parts of `--replicas` that need no Ray cluster: which replica takes which chunk and
when results leave, merged statistics, the replicas' resources, prompt files read as
they are needed, /metrics added up over replicas, and the command line's errors.
(tests/test_distributed.py runs the replicas themselves on a local Ray cluster.)"""

from __future__ import annotations

import json
import random

import pytest
from factories import run_cli

from specmoe import LLM, SamplingParams, SpecMoEError
from specmoe.base.prompts import iter_prompts_file
from specmoe.distributed.cluster import cpu_threads, replica_resources
from specmoe.distributed.options import ReplicaOptions
from specmoe.distributed.replica import ChunkRun
from specmoe.distributed.runstats import TokenHash, merge_runs, replica_stats
from specmoe.distributed.schedule import Schedule, chunked, paired
from specmoe.engine.stats import RunCounters, token_ids_sha256
from specmoe.server.loop import ServerStats, Snapshot
from specmoe.server.metrics import combine, render

GREEDY = SamplingParams(max_tokens=4)


def schedule_of(n_prompts: int, size: int, replicas: int, **kw) -> Schedule:
    return Schedule(chunked(paired(range(n_prompts), GREEDY), size), replicas, **kw)


# --- the schedule ----------------------------------------------------------------------------


def test_chunks_alternate_between_replicas_up_to_the_depth_each():
    schedule = schedule_of(20, 2, replicas=2, depth=2)
    sent = schedule.assign()
    assert [(replica, chunk.index) for replica, chunk in sent] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert schedule.assign() == []  # both hold two: nothing more until one finishes
    schedule.finish(1, sent[1][1], "r1")
    assert [(replica, chunk.index) for replica, chunk in schedule.assign()] == [(1, 4)]


def test_results_leave_in_input_order_whatever_order_they_finish_in():
    schedule = schedule_of(12, 2, replicas=3, depth=2)
    sent = {chunk.index: (replica, chunk) for replica, chunk in schedule.assign()}
    order = [3, 1, 5, 0, 2, 4]
    released = []
    for index in order:
        replica, chunk = sent[index]
        released += [c.index for c, _ in schedule.finish(replica, chunk, index)]
        assert released == list(range(len(released)))  # never one before an earlier one
    assert released == list(range(6)) and schedule.assign() == [] and schedule.done


def test_no_chunk_is_read_more_than_the_lookahead_past_the_oldest_unfinished():
    schedule = schedule_of(100, 1, replicas=2, depth=2, lookahead=5)
    in_flight = schedule.assign()
    in_flight.pop(0)  # chunk 0 never finishes: every later result waits for it
    for _ in range(10):
        for replica, chunk in in_flight:
            schedule.finish(replica, chunk, None)
        in_flight = schedule.assign()
    assert (schedule.read, schedule.emitted) == (5, 0)  # 0 and 4 more, however often a replica is free


def test_a_lost_replicas_chunks_go_to_the_others_and_each_leaves_once():
    rng = random.Random(0)
    schedule = schedule_of(40, 3, replicas=3, depth=2)
    in_flight, emitted = [], []
    dead = 1
    while not schedule.done:
        in_flight += schedule.assign()
        replica, chunk = in_flight.pop(rng.randrange(len(in_flight)))
        if replica == dead:
            schedule.lose(replica, chunk)
        else:
            emitted += [(c.index, c.prompts) for c, _ in schedule.finish(replica, chunk, None)]
    assert [i for i, _ in emitted] == list(range(14))
    assert [p for _, prompts in emitted for p in prompts] == list(range(40))
    assert dead not in schedule.held


def test_losing_every_replica_is_an_error_that_says_where_to_look():
    schedule = schedule_of(4, 2, replicas=1)
    (replica, chunk), _ = schedule.assign()
    with pytest.raises(SpecMoEError, match="every replica died.*logs"):
        schedule.lose(replica, chunk)


def test_one_params_per_prompt_must_match_the_prompts():
    with pytest.raises(SpecMoEError, match="one SamplingParams per prompt"):
        list(paired(["a", "b", "c"], [GREEDY, GREEDY]))
    assert [p for _, p in paired(["a", "b"], GREEDY)] == [GREEDY, GREEDY]


# --- statistics ----------------------------------------------------------------------------------


def chunk_run(generated: int, decode_tokens: int, seq_steps: int, drafted: int, accepted: int, worker="h:1",
              **stats) -> ChunkRun:
    base = {"policy": "specmoe", "num_requests": 2, "generated_tokens": generated, "prompt_tokens": 10,
            "transfer_bytes": 1000, "wall_s": 2.0, "decode_s": 1.0, "batch_size": 2, "cache_hit_rate": 0.5}
    counters = RunCounters(decode_s=1.0, seq_steps=seq_steps, decode_tokens=decode_tokens, drafted=drafted,
                           accepted=accepted)
    return ChunkRun([], {**base, **stats}, counters, worker)


def test_merged_runs_add_counts_and_recompute_ratios_from_them():
    runs = [chunk_run(10, 8, 4, 10, 5), chunk_run(30, 28, 7, 20, 18, batch_size=1, cache_hit_rate=0.9)]
    merged = merge_runs(runs, wall_s=4.0)
    assert merged["generated_tokens"] == 40 and merged["num_requests"] == 4 and merged["transfer_bytes"] == 2000
    assert merged["tokens_per_step"] == pytest.approx(36 / 11)  # not the mean of 2.0 and 4.0
    assert merged["acceptance_rate"] == pytest.approx(23 / 30)
    assert merged["decode_tokens_per_s"] == pytest.approx(36 / 2.0)
    assert merged["tokens_per_s"] == pytest.approx(40 / 4.0) and merged["wall_s"] == 4.0
    assert merged["transfer_bytes_per_token"] == pytest.approx(2000 / 40)
    assert merged["cache_hit_rate"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)  # weighted by tokens
    assert merged["batch_size"] == 2 and merged["policy"] == "specmoe"


def test_a_replica_that_changed_process_counts_a_restart():
    runs = [chunk_run(10, 8, 4, 0, 0, worker="h:2"), chunk_run(10, 8, 4, 0, 0, worker="h:2")]
    assert replica_stats(0, "h:1", runs)["restarts"] == 1
    assert replica_stats(0, "h:2", runs)["restarts"] == 0


@pytest.mark.parametrize("outputs", [[], [[]], [[5, 6], [], [7]], [[i] * i for i in range(30)]])
def test_the_streamed_token_hash_is_the_engines_token_ids_sha256(outputs):
    digest = TokenHash()
    for ids in outputs:
        digest.add(ids)
    assert digest.hexdigest() == token_ids_sha256(outputs)


# --- resources -----------------------------------------------------------------------------------


def test_gpu_clusters_get_one_gpu_per_replica():
    assert replica_resources(ReplicaOptions(4), "auto", {"CPU": 64, "GPU": 8}) == {"num_gpus": 1, "num_cpus": 1}
    with pytest.raises(SpecMoEError, match="3 replicas need one GPU each and the Ray cluster has 2"):
        replica_resources(ReplicaOptions(3), "auto", {"CPU": 64, "GPU": 2})
    with pytest.raises(SpecMoEError, match="has 0"):
        replica_resources(ReplicaOptions(1), "cuda", {"CPU": 8})


def test_cpu_replicas_share_the_cpus_and_use_that_many_threads():
    resources = replica_resources(ReplicaOptions(2), "auto", {"CPU": 16})
    assert resources == {"num_cpus": 8} and cpu_threads(resources, None) == 4  # as one engine: half its CPUs
    assert cpu_threads(replica_resources(ReplicaOptions(2, 0.5), "cpu", {"CPU": 2, "GPU": 1}), None) == 1
    assert cpu_threads(resources, 3) == 3
    with pytest.raises(SpecMoEError, match="2 replicas x 1.5 CPUs exceed the Ray cluster's 2 CPUs"):
        replica_resources(ReplicaOptions(2, 1.5), "cpu", {"CPU": 2})


@pytest.mark.parametrize("kwargs, message", [
    (dict(replicas=0), "--replicas must be a positive integer"),
    (dict(replicas=2, replica_cpus=0), "--replica-cpus must be a number above 0"),
    (dict(replicas=2, max_restarts=-1), "max_restarts must be an integer >= 0"),
])
def test_bad_replica_options_name_the_flag(kwargs, message):
    with pytest.raises(SpecMoEError, match=message):
        ReplicaOptions(**kwargs)


# --- prompt files, read as they are needed -----------------------------------------------------


def test_a_jsonl_prompt_file_is_read_as_prompts_are_needed(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt_token_ids": [5, 6]}\nnot json\n')
    prompts = iter_prompts_file(str(path))
    assert [next(prompts), next(prompts)] == ["a", [5, 6]]  # the bad line is not read yet
    with pytest.raises(SpecMoEError, match=r"p.jsonl:4: not a JSON object"):
        next(prompts)


def test_a_parquet_prompt_file_gives_its_prompt_column(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"prompt_token_ids": [[5, 6], [7]], "other": [1, 2]}), tmp_path / "p.parquet")
    assert list(iter_prompts_file(str(tmp_path / "p.parquet"))) == [[5, 6], [7]]
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "q.parquet")
    with pytest.raises(SpecMoEError, match=r"needs a \"prompt\" or \"prompt_token_ids\" column; it has text"):
        list(iter_prompts_file(str(tmp_path / "q.parquet")))


# --- /metrics over replicas -----------------------------------------------------------------------


def server_stats(requests: int, running: int, steps: int, finished: dict) -> ServerStats:
    stats = ServerStats()
    stats.requests, stats.generated_tokens = requests, 10 * requests
    stats.finished.update(finished)
    stats.snapshot = Snapshot(running=running, steps=steps, tokens_by_second=((100, 5), (101, requests)))
    return stats


def test_combined_metrics_count_every_replica_and_show_the_state_of_the_live_ones():
    alive, replaced = server_stats(3, 2, 7, {"stop": 3}), server_stats(5, 4, 11, {"length": 4, "abort": 1})
    total = combine([alive, replaced], [True, False])
    assert (total.requests, total.generated_tokens, total.snapshot.steps) == (8, 80, 18)
    assert total.finished == {"stop": 3, "length": 4, "abort": 1, "error": 0}
    assert total.snapshot.running == 2  # the replaced replica runs nothing any more
    assert total.snapshot.tokens_by_second == ((100, 5), (101, 3))
    text = render(total, {404: 1}, "m", replicas={"a": 3, "b": 5})
    assert 'specmoe_requests_total{model="m"} 8' in text
    assert 'specmoe_replica_requests_total{model="m",replica="b"} 5' in text


# --- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--ray-address", "auto"], "--ray-address and --replica-cpus place engine replicas: add --replicas N"),
    (["--replicas", "0"], "--replicas must be a positive integer"),
    (["--replicas", "2", "--trace", "t.jsonl"], "--trace records one engine's steps"),
])
def test_replica_flags_that_cannot_work_are_one_line_errors(capsys, flags, message):
    code, _, err = run_cli(capsys, "generate", "x", *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_serve_replica_flags_need_replicas(capsys):
    code, _, err = run_cli(capsys, "serve", "--replica-cpus", "1")
    assert code == 2 and "add --replicas N" in err


def test_generate_output_writes_one_line_per_prompt_in_order(tiny_ckpt, tmp_path, capsys):
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    file = tmp_path / "p.jsonl"
    file.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in prompts))
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli(capsys, "generate", "--model", tiny_ckpt("olmoe"), "--prompts-file", file,
                                "--max-tokens", 5, "--ignore-eos", "--device", "cpu", "--output", out)
    assert code == 0, err
    want = LLM(model=str(tiny_ckpt("olmoe")), device="cpu").generate(prompts, SamplingParams(max_tokens=5,
                                                                                              ignore_eos=True))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["prompt"], r["token_ids"]) for r in lines] == \
        [(i, p, w.token_ids) for i, (p, w) in enumerate(zip(prompts, want))]
    assert stdout == ""  # the outputs went to the file


def test_an_output_file_that_cannot_be_written_fails_before_the_run(tiny_ckpt, tmp_path, capsys):
    code, _, err = run_cli(capsys, "generate", "5", "--model", tiny_ckpt("olmoe"), "--output",
                           tmp_path / "missing" / "out.jsonl")
    assert code == 2 and "--output" in err and "cannot write there" in err
