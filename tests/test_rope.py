"""RoPE frequencies of every scaling kind against transformers' own functions, and the
rotation layouts: partial rotation leaves the rest of the head alone; the interleaved
layout keeps q.k what the complex-number form gives."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from factories import build_config  # noqa: E402

from specmoe.base.model_config import ModelConfig  # noqa: E402
from specmoe.base.specs import RopeSpec  # noqa: E402
from specmoe.model.rope import RotaryTable, apply_rotary, frequencies  # noqa: E402

ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM", "llama4": "Llama4ForCausalLM",
        "phimoe": "PhimoeForCausalLM", "mixtral": "MixtralForCausalLM"}
CASES = [  # (family, config overrides, LongRoPE's long frequencies)
    ("deepseek_v3", {}, False),  # yarn with mscale / mscale_all_dim
    ("gpt_oss", {}, False),  # yarn, truncate false
    ("llama4", {}, False),  # llama3
    ("phimoe", {}, False),  # longrope, short factors
    ("phimoe", {}, True),  # longrope, long factors
    ("mixtral", {"rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 3.0}}, False),
]


@pytest.mark.parametrize(("family", "overrides", "long"), CASES, ids=[c[0] + ("-long" if c[2] else "") for c in CASES])
def test_frequencies_match_transformers(family, overrides, long):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = build_config(family, **overrides)
    spec = ModelConfig.from_dict({**config.to_dict(), "architectures": [ARCH[family]]}).rope
    seq_len = spec.original_max_positions + 1 if long else None
    want, want_scale = ROPE_INIT_FUNCTIONS[spec.kind](config, torch.device("cpu"), seq_len=seq_len)
    got, scale = frequencies(spec, torch.device("cpu"), long=long)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    if spec.kind == "longrope":  # Phi-3.5-MoE scales cos/sin by its own mscale per regime
        want_scale = config.rope_parameters["long_mscale" if long else "short_mscale"]
    assert scale == pytest.approx(want_scale)


def test_longrope_table_switches_to_the_long_factors_per_position():
    spec = RopeSpec("longrope", theta=100.0, dim=4, original_max_positions=8, short_factor=(1.0, 1.0),
                    long_factor=(2.0, 4.0), short_mscale=1.0, long_mscale=2.0)
    cos, sin = RotaryTable(spec, torch.device("cpu")).lookup(torch.arange(12), torch.float32)
    short, _ = frequencies(spec, "cpu")
    long, _ = frequencies(spec, "cpu", long=True)
    torch.testing.assert_close(cos[7], torch.cos(7 * short))
    torch.testing.assert_close(cos[8], 2.0 * torch.cos(8 * long))
    torch.testing.assert_close(sin[11], 2.0 * torch.sin(11 * long))


def test_partial_rotation_leaves_the_rest_of_the_head_alone():
    x = torch.randn(3, 2, 8)
    cos, sin = torch.rand(3, 2), torch.rand(3, 2)  # 4 of 8 dims rotate
    out = apply_rotary(x, cos, sin, "half")
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[..., :4], x[..., :4])


def test_interleaved_layout_keeps_the_dot_products_of_the_complex_form():
    q, k = torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    angles = torch.rand(5, 4) * 6
    rotate = torch.polar(torch.ones_like(angles), angles)[:, None, :]

    def complex_form(x):
        return torch.view_as_real(torch.view_as_complex(x.reshape(5, 1, 4, 2)) * rotate).flatten(2)

    ours_q, ours_k = (apply_rotary(t, angles.cos(), angles.sin(), "interleaved")[:, 0] for t in (q, k))
    want_q, want_k = complex_form(q)[:, 0], complex_form(k)[:, 0]
    torch.testing.assert_close(ours_q @ ours_k.T, want_q @ want_k.T)  # every query against every key


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rotated", [8, 4])
def test_rotation_is_the_textbook_rotation(style, rotated):
    """x1 cos - x2 sin, x2 cos + x1 sin over the rotated dims (pairs (i, i + F) or (2i, 2i + 1)),
    written first members then second members, the rest passed through: the same values."""
    gen = torch.Generator().manual_seed(rotated)
    x = torch.randn(3, 2, 8, generator=gen)
    cos, sin = torch.randn(3, rotated // 2, generator=gen), torch.randn(3, rotated // 2, generator=gen)
    rot = x[..., :rotated]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if style == "interleaved" else rot.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rotated:]], dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin, style), want)
