"""specmoe reproduces transformers on real Hugging Face checkpoint formats.

Every case is a tiny random checkpoint written by transformers itself (factories.py):
four families, both tensor layouts (per-expert Hub names and transformers 5's fused
expert tensors), sharded files, and a few config variants. specmoe must give the same
log-probabilities (max |diff| <= 1e-4 in float32) for a batch of prompts of different lengths in
one forward pass, and the same 32 greedy tokens for each prompt, generated as one batch.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from factories import FAMILIES, LAYOUTS, VOCAB, hf_greedy, hf_greedy_reference, hf_logits, random_prompts  # noqa: E402

ATOL = 1e-4
MAX_TOKENS = 32

CASES = [
    *(pytest.param(f, lay, 1, {}, id=f"{f}-{lay}") for f in FAMILIES for lay in LAYOUTS),
    *(
        pytest.param(f, lay, 2, {}, id=f"{f}-{lay}-2shards")
        for f in ("mixtral", "qwen2_moe")
        for lay in LAYOUTS
    ),
    # Layer 0 and 2 dense, layer 1 MoE: the `decoder_sparse_step` rule, not a list.
    pytest.param("qwen2_moe", "per_expert", 1, {"decoder_sparse_step": 2, "mlp_only_layers": []},
                 id="qwen2_moe-sparse_step2"),
    # OLMoE's clip_qkv clamps q, k, v after the q/k norms.
    pytest.param("olmoe", "fused", 1, {"clip_qkv": 1.0}, id="olmoe-clip_qkv"),
    # No lm_head.weight in the file: the head is the embedding matrix.
    pytest.param("qwen3_moe", "per_expert", 1, {"tie_word_embeddings": True}, id="qwen3_moe-tied"),
]


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(4, VOCAB, min_len=3, max_len=40, seed=seed)


@functools.lru_cache(maxsize=None)
def _llm(path: str):
    from specmoe import LLM

    return LLM(model=path, device="cpu", dtype="float32")


@pytest.mark.parametrize(("family", "layout", "shards", "overrides"), CASES)
def test_score_matches_transformers_log_softmax(tiny_ckpt, family, layout, shards, overrides):
    path = tiny_ckpt(family, layout, shards=shards, **overrides)
    prompts = _prompts(seed=11)
    want = [torch.log_softmax(w, dim=-1) for w in hf_logits(path, prompts)]

    got = _llm(str(path)).score(prompts)

    assert len(got) == len(prompts)
    for i, (g, w) in enumerate(zip(got, want)):
        g = torch.as_tensor(g)
        assert g.dtype == torch.float32
        assert tuple(g.shape) == (len(prompts[i]), VOCAB), f"prompt {i}"
        diff = (g - w).abs().max(dim=-1).values  # per position
        worst = int(diff.argmax())
        assert diff.max() <= ATOL, (
            f"prompt {i} (length {len(prompts[i])}): max |log-prob diff| {diff.max():.2e} "
            f"at position {worst} > {ATOL:.0e}"
        )


@pytest.mark.parametrize(("family", "layout", "shards", "overrides"), CASES)
def test_greedy_generate_matches_transformers(tiny_ckpt, family, layout, shards, overrides):
    from specmoe import SamplingParams

    path = tiny_ckpt(family, layout, shards=shards, **overrides)
    prompts = _prompts(seed=12)

    outs = _llm(str(path)).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )

    assert len(outs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        _assert_same_greedy(path, prompt, list(out.token_ids), hf_greedy(path, prompt, MAX_TOKENS), f"prompt {i}")


def test_ignore_eos_generates_through_eos(tiny_ckpt):
    """A checkpoint whose eos is the first greedy token: ignore_eos must not stop or mask it."""
    from specmoe import SamplingParams

    prompt = _prompts(seed=13)[0]
    first = hf_greedy_reference(tiny_ckpt("mixtral"), prompt, 1)[0]
    path = tiny_ckpt("mixtral", eos_token_id=first)

    out = _llm(str(path)).generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]

    assert list(out.token_ids)[0] == first
    _assert_same_greedy(path, prompt, list(out.token_ids), hf_greedy(path, prompt, MAX_TOKENS), "prompt")


def _assert_same_greedy(path, prompt, got: list[int], want: list[int], what: str) -> None:
    """got == want, except that the two may part at a float near-tie of the reference.

    Two correct float32 implementations can pick different argmaxes only where the
    reference's top logits are within rounding of each other; past such a point the
    continuations are unrelated, so the comparison stops there. Anywhere else a
    difference is a bug.
    """
    assert len(got) == len(want) == MAX_TOKENS, f"{what}: {len(got)} tokens, expected {MAX_TOKENS}"
    j = next((k for k in range(MAX_TOKENS) if got[k] != want[k]), None)
    if j is None:
        return
    logits = hf_logits(path, [prompt + want[:j]])[0][-1]
    gap = float(logits[want[j]] - logits[got[j]])
    assert gap <= ATOL, (
        f"{what}: token {j} is {got[j]}, transformers gives {want[j]} "
        f"(logit gap {gap:.2e}, not a tie); got {got}, want {want}"
    )
