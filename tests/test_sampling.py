"""`sample_tokens`: a step's greedy rows in one argmax, the others drawn each from its own
generator, exactly as one `sample_token` per row."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specmoe.engine.sampling import SamplingParams, sample_token, sample_tokens


def _seqs(seed: int):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=5)]
    return [SimpleNamespace(params=p, generator=torch.Generator().manual_seed(seed + i)) for i, p in enumerate(params)]


def test_a_batch_of_rows_gets_the_tokens_one_row_at_a_time_would():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    one_by_one = [sample_token(row, s.params, s.generator) for row, s in zip(logits, _seqs(7))]
    assert sample_tokens(logits, _seqs(7)) == one_by_one
    assert one_by_one[0] == int(logits[0].argmax()) and one_by_one[2] == int(logits[2].argmax())
