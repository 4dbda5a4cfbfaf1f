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


# --- attention in runs of similar lengths ------------------------------------------------

def _modelled_cost(runs, lengths, counts, rows_per_token):
    from specmoe.model import kv_cache as kv

    return sum(kv.CALL_US + (end - first) * max(lengths[first:end])
               * (kv.KEY_US + kv.ROW_KEY_US * max(counts[first:end]) * rows_per_token)
               for first, end, _, _ in runs)


def _all_splits(n):
    """Every way to cut range(n) into consecutive runs."""
    for mask in range(2 ** (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        yield [(a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("seed", range(20))
def test_split_by_length_finds_the_cheapest_split(seed):
    from specmoe.model.kv_cache import split_by_length

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=gen))
    counts = torch.randint(1, 4, (n,), generator=gen).tolist() if seed % 2 else [1] * n
    lengths = [c + int(x) for c, x in zip(counts, torch.randint(0, 400, (n,), generator=gen))]
    runs = split_by_length(lengths, counts, 2)
    assert [(a, b) for a, b, _, _ in runs] in list(_all_splits(n))  # consecutive, covering, in order
    assert all(keys == max(lengths[a:b]) and tokens == max(counts[a:b]) for a, b, keys, tokens in runs)
    best = min(_modelled_cost([(a, b, 0, 0) for a, b in s], lengths, counts, 2) for s in _all_splits(n))
    assert _modelled_cost(runs, lengths, counts, 2) == pytest.approx(best)


def test_equal_lengths_are_one_run_and_a_long_outlier_its_own():
    from specmoe.model.kv_cache import split_by_length

    assert split_by_length([80] * 16, [1] * 16, 2) == [(0, 16, 80, 1)]
    assert split_by_length([60] * 8 + [900] + [60] * 7, [1] * 16, 2) == [(0, 8, 60, 1), (8, 9, 900, 1), (9, 16, 60, 1)]


@pytest.mark.parametrize("counts", [[1] * 6, [4, 1, 3, 4, 2, 1]], ids=["decode", "uneven-verify"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_attention_in_runs_equals_one_padded_call(counts, sinks):
    from specmoe.model.attention import attend
    from specmoe.model.kv_cache import StepBatch

    G, r, d = 2, 3, 8
    lengths = [300, 9, 12, 250, 7, 240]  # runs of very different lengths side by side
    starts = [n - c for n, c in zip(lengths, counts)]
    batch = StepBatch.build(range(6), starts, counts, torch.device("cpu"))
    assert len(batch.key_runs(r)) > 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(counts), G * r, d, generator=gen)
    keys, values = (torch.randn(6, G, batch.kv_len, d, generator=gen) for _ in range(2))
    sink = torch.randn(G * r, generator=gen) if sinks else None

    got = attend(q, keys, values, batch.mask, batch, 0.3, sink, by_length=True)
    want = attend(q, keys, values, batch.mask, batch, 0.3, sink, by_length=False)

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    one = StepBatch.build([1], [starts[1]], [counts[1]], torch.device("cpu"))  # a short sequence alone
    rows = slice(sum(counts[:1]), sum(counts[:2]))
    alone = attend(q[rows], keys[1:2, :, : lengths[1]], values[1:2, :, : lengths[1]], one.mask, one, 0.3, sink)
    torch.testing.assert_close(got[rows], alone, rtol=1e-5, atol=1e-6)
