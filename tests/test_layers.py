"""The dense building blocks against transformers' own modules, bit for bit where the
reference's arithmetic is the same."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

from specmoe.model.layers import rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 4, 64)])
def test_rms_norm_equals_the_reference_module(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    reference = MixtralRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, generator=gen))
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, reference.weight, 1e-5), reference(x))
