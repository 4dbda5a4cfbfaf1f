"""The bench on a machine where its runners do not fit side by side: each is built, run and
closed before the next (at real size every policy and anchor together exceeded 24 GiB and
the kernel killed the bench), with a note, and the same records and tokens as together."""

from __future__ import annotations

import json
import random

import pytest

from specmoe.bench import grid, suite
from specmoe.bench.grid import Builder, fit_together, measure, runner_needs
from specmoe.bench.runners import Runner
from specmoe.cli import main


class Counted(Runner):
    """A runner that counts how many of its kind are alive (built and not closed)."""

    alive = 0
    most_alive = 0

    def __init__(self, label, fail=False):
        if fail:
            raise RuntimeError(f"{label} does not fit")
        self.label, self.runs = label, 0
        Counted.alive += 1
        Counted.most_alive = max(Counted.most_alive, Counted.alive)

    def run(self):
        self.runs += 1
        return {"decode_tokens_per_s": float(self.runs)}, [[self.runs]]

    def close(self):
        Counted.alive -= 1


def _builders(labels, failing=()):
    return [Builder(label, "policy", lambda label=label: Counted(label, label in failing)) for label in labels]


@pytest.mark.parametrize("together,most", [(True, 3), (False, 1)])
def test_one_at_a_time_never_holds_two_runners(together, most):
    Counted.alive = Counted.most_alive = 0
    order = []
    ms = measure(_builders(["a", "b", "skip", "c"], failing={"skip"}), repeats=2, together=together,
                 on_run=lambda m, rnd, stats: order.append((m.label, rnd)))
    assert Counted.most_alive == most and Counted.alive == 0
    assert [len(m.rounds) for m in ms] == [3, 3, 0, 3] and ms[2].error == "skip does not fit"
    if together:  # rounds interleave: a b c, a b c, ...
        assert order[:3] == [("a", 0), ("b", 0), ("c", 0)]
    else:  # each runner's warm-up and repeats before the next is built
        assert order[:3] == [("a", 0), ("a", 1), ("a", 2)]


def test_fit_together_compares_the_sum_with_a_share_of_what_is_available():
    assert fit_together({"resident": 6 << 30, "ondemand": 2 << 30}, 10 << 30)
    assert not fit_together({"resident": 6 << 30, "ondemand": 2 << 30, "transformers": 6 << 30}, 10 << 30)
    assert not fit_together({"a": 9 << 30}, 10 << 30)  # 90 % of it: no room for the rest of the process


def test_every_runner_that_holds_the_whole_model_counts_all_of_it():
    needs = runner_needs(["resident", "ondemand", "specmoe", "transformers", "llama.cpp"], whole=6 << 30, budget=2 << 30)
    assert needs == {"resident": 6 << 30, "ondemand": 2 << 30, "specmoe": 2 << 30, "transformers": 6 << 30,
                     "llama.cpp": 6 << 30}
    # the real-size group at B = 1 on a machine with 22 GiB available: one at a time (together it was killed)
    assert not fit_together(needs, 22 << 30)


def test_a_bench_that_does_not_fit_runs_one_at_a_time_with_the_same_tokens(tiny_ckpt, tmp_path, monkeypatch):
    rng = random.Random(1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [rng.randrange(3, 128) for _ in range(5)]}) + "\n"
                               for _ in range(4)))
    built = []
    real = grid.measure
    monkeypatch.setattr(suite, "measure", lambda *a, **k: built.append(k["together"]) or real(*a, **k))
    docs = {}
    for name, available in (("together", None), ("apart", 1 << 10)):
        monkeypatch.setattr(suite, "available_bytes", lambda available=available: available)
        out = tmp_path / f"{name}.json"
        code = main(["bench", "--model", str(tiny_ckpt("mixtral")), "--batch-sizes", "2", "--repeats", "1",
                     "--max-tokens", "3", "--policies", "resident,ondemand,specmoe", "--anchors", "none",
                     "--prompts-file", str(prompts), "--threads", "1", "--json", str(out)])
        assert code == 0
        docs[name] = json.loads(out.read_text())
    assert built == [True, False]
    notes = " ".join(docs["apart"]["notes"])
    assert "one at a time" in notes and "1.0 KiB available" in notes, notes
    assert not any("one at a time" in n for n in docs["together"]["notes"])
    sha = {name: {r["policy"]: r["token_ids_sha256"] for r in doc["records"]} for name, doc in docs.items()}
    assert sha["apart"] == sha["together"] and len(set(sha["apart"].values())) == 1


def test_an_ablation_that_does_not_fit_runs_one_at_a_time_judged_by_each_variants_budget(tiny_ckpt, tmp_path,
                                                                                        monkeypatch):
    """Each draft-memory variant holds its draft beside a full pool: its need is its own budget
    (the base budget and its draft), not the base budget every runner of the grid shares."""
    rng = random.Random(2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [rng.randrange(3, 128) for _ in range(5)]}) + "\n"
                               for _ in range(2)))
    judged = []
    monkeypatch.setattr(suite, "fit_together", lambda needs, available: judged.append(dict(needs)) or False)
    monkeypatch.setattr(suite, "available_bytes", lambda: 1 << 30)
    out = tmp_path / "apart.json"
    code = main(["bench", "--model", str(tiny_ckpt("mixtral")), "--no-grid", "--ablation", "draft-memory",
                 "--ablation-draft-memory", "10%,40%", "--ablation-draft-ways", "allocated,paper",
                 "--ablation-batch-size", "2", "--repeats", "1", "--max-tokens", "3", "--anchors", "none",
                 "--prompts-file", str(prompts), "--threads", "1", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert any("ablation draft-memory, B=2" in n and "one at a time" in n for n in doc["notes"]), doc["notes"]
    (needs,) = judged
    records = doc["ablations"][0]["records"]
    assert set(needs) == {r["label"] for r in records}
    for r in records[1:]:  # each variant needs the pool ondemand has and the draft it was given
        if r.get("skipped"):
            continue
        assert needs[r["label"]] - needs["ondemand"] == r["draft_memory"], (r["label"], needs)
    assert len({r["token_ids_sha256"] for r in records if not r.get("skipped")}) == 1
