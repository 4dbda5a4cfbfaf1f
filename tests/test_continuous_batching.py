"""Continuous batching at the engine: requests join a running batch between steps and
others are aborted, and every request still gets exactly the tokens it gets alone.

Greedy decoding is a function of the prompt only, so the batch a request shares (who
joined, who left, which KV slots were reused) must not change a token; under specmoe
also the draft sets, refreshed from whatever batch the last verify pass saw, must not.
"""

import pytest
from factories import expert_share_budget, random_prompts

from specmoe import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(tiny_ckpt):
    """Each prompt's tokens when it runs alone, and a budget for the offloading runs."""
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(6, 128, 3, 12, seed=21)
    llm = LLM(model=str(path), device="cpu", max_batch_size=1, max_model_len=32)
    alone = [llm.generate([p], PARAMS)[0].token_ids for p in prompts]
    budget = expert_share_budget(llm, 0.5, 4, 32)
    llm.close()
    return path, prompts, alone, budget


def steps(engine, n):
    for _ in range(n):
        engine.step()


@pytest.mark.parametrize("policy", ["resident", "specmoe"])
def test_joining_and_aborted_requests_leave_every_output_as_it_is_alone(solo, tmp_path, policy):
    path, prompts, alone, budget = solo
    opts = {} if policy == "resident" else dict(policy="specmoe", offload="disk", offload_dir=str(tmp_path),
                                                device_memory=budget, gamma=3, draft_quant="none")
    llm = LLM(model=str(path), device="cpu", max_batch_size=4, max_model_len=32, **opts)
    engine = llm.engine
    a, b, c = (engine.add_request(p, PARAMS) for p in prompts[:3])
    steps(engine, 3)  # prefill of a, b, c and two decode steps
    d, e = (engine.add_request(p, PARAMS) for p in prompts[3:5])  # join at step 3: one waits for a slot
    steps(engine, 2)
    engine.abort(b.request_id)  # leaves mid-generation, freeing its slot for e
    steps(engine, 1)
    f = engine.add_request(prompts[5], PARAMS)
    engine.abort(f.request_id)  # aborted while still waiting: never runs
    engine.run_until_done()
    for seq, i in ((a, 0), (c, 2), (d, 3), (e, 4)):
        assert (seq.output_ids, seq.finish_reason) == (alone[i], "length"), i
    assert b.finish_reason == "abort" and 0 < len(b.output_ids) < len(alone[1])
    assert b.output_ids == alone[1][: len(b.output_ids)]
    assert f.output_ids == [] and f not in engine.scheduler.running
    assert engine.cache.free_slots == 4
    if policy == "specmoe":
        assert engine.counters.drafted > engine.counters.accepted > 0  # drafts were both taken and refused
    llm.close()
