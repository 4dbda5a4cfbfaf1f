"""The multi-token KV cache: several tokens per step, truncation, isolation of sequences."""

import pytest
import torch

from specmoe import LLM
from specmoe.model.kv_cache import KVCache, LayerCacheSpec

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(model=str(tiny_ckpt("mixtral")), device="cpu", dtype="float32", max_batch_size=4)


def feed(llm, slot, tokens):
    with llm.engine.pass_scope("prefill") as experts:
        return llm.engine.forward_logits(experts, [slot], [tokens], rows="all")


def test_one_step_of_five_tokens_equals_five_steps_of_one(llm):
    prompt, extra = [5, 9, 13, 21], [30, 31, 32, 33, 34]
    cache = llm.engine.cache
    a, b = cache.allocate(), cache.allocate()
    try:
        feed(llm, a, prompt)
        feed(llm, b, prompt)
        together = feed(llm, a, extra)
        one_by_one = torch.cat([feed(llm, b, [t]) for t in extra])
        assert torch.allclose(together, one_by_one, atol=1e-5)
        assert cache.lengths[a] == cache.lengths[b] == len(prompt) + len(extra)
    finally:
        cache.free(a)
        cache.free(b)


def test_truncating_and_refeeding_gives_the_same_logits(llm):
    cache = llm.engine.cache
    slot = cache.allocate()
    try:
        feed(llm, slot, [7, 8, 9])
        first = feed(llm, slot, [40, 41, 42])
        feed(llm, slot, [50, 51])  # rejected drafts, say
        cache.truncate(slot, 3)
        again = feed(llm, slot, [40, 41, 42])
        assert torch.allclose(first, again, atol=1e-6)
    finally:
        cache.free(slot)


def test_sequences_in_one_batch_do_not_see_each_other(llm):
    short, long = [3, 4, 5], [60, 61, 62, 63, 64, 65, 66, 67]
    alone = llm.score([short])[0]
    together = llm.score([long, short, [9] * 5])[1]
    assert torch.allclose(alone, together, atol=1e-5)


def test_cache_refuses_more_positions_than_the_context(llm):
    with pytest.raises(Exception, match="context"):
        llm.engine.cache.reserve(10_000)


def test_freed_slots_are_reused_lowest_first():
    """A new batch gets the lowest free slots, so after a batch ends the next one is again
    a contiguous run of slots (attention then reads the cache in place)."""
    cache = KVCache([LayerCacheSpec(heads=1, k_dim=2, v_dim=2)], 4, 16, torch.float32, torch.device("cpu"))
    slots = [cache.allocate() for _ in range(4)]
    assert slots == [0, 1, 2, 3]
    for s in (0, 2, 1, 3):
        cache.free(s)
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
