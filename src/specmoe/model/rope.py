"""Rotary position embeddings: the frequencies of each RoPE kind, a cos/sin table by
position, and the rotation in either layout.

Shapes: P positions, F = dim / 2 frequencies, T tokens, h heads, d head dims (the first
`dim` of them rotate, the rest pass unchanged).

Every kind is inv_freq [F] and an attention factor that scales cos and sin (so q.k by its
square); formulas as in transformers' modeling_rope_utils. LongRoPE (Phi-3.5-MoE) has two
frequency sets: positions before the pre-training context use the short factors, later
positions the long ones, per position, so a token's rotation never depends on what else
is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..base.specs import RopeSpec


def _base_freq(spec: RopeSpec, device) -> torch.Tensor:
    """theta^(2i / dim), i < F."""
    return spec.theta ** (torch.arange(0, spec.dim, 2, dtype=torch.int64, device=device).float() / spec.dim)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn(spec: RopeSpec, device) -> tuple[torch.Tensor, float]:
    """Frequencies interpolated by `factor` below the low-rotation boundary, kept above the
    high one, ramped between (YaRN); attention factor from mscale."""
    dim, base, factor = spec.dim, spec.theta, spec.factor
    attention = spec.attention_factor
    if attention is None:
        attention = (_mscale(factor, spec.mscale) / _mscale(factor, spec.mscale_all_dim)
                     if spec.mscale and spec.mscale_all_dim else _mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(spec.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = _base_freq(spec, device)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def llama3(spec: RopeSpec, device) -> tuple[torch.Tensor, float]:
    """Long wavelengths divided by `factor`, short ones kept, smooth in between (Llama 3.1/4)."""
    inv_freq = 1.0 / _base_freq(spec, device)
    old = spec.original_max_positions
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def longrope(spec: RopeSpec, device, long: bool) -> tuple[torch.Tensor, float]:
    factors = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (factors * _base_freq(spec, device))
    own = spec.long_mscale if long else spec.short_mscale
    if own is not None:
        return inv_freq, float(own)
    if spec.attention_factor is not None:
        return inv_freq, float(spec.attention_factor)
    if spec.factor <= 1:
        return inv_freq, 1.0
    return inv_freq, math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_positions))


def frequencies(spec: RopeSpec, device, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [F], attention factor) of the spec's kind."""
    if spec.kind == "yarn":
        return yarn(spec, device)
    if spec.kind == "llama3":
        return llama3(spec, device)
    if spec.kind == "longrope":
        return longrope(spec, device, long)
    inv_freq = 1.0 / _base_freq(spec, device)
    return (inv_freq / spec.factor if spec.kind == "linear" else inv_freq), 1.0


class RotaryTable:
    """cos/sin [T, F] of the positions a pass needs, computed for that pass: no table of
    every position stays on the device outside the budget."""

    def __init__(self, spec: RopeSpec, device: torch.device):
        self.spec = spec
        self.inv_freq, self.scale = frequencies(spec, device)
        if spec.kind == "longrope":  # positions past the pre-training context: the long factors
            self.inv_long, self.scale_long = frequencies(spec, device, long=True)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        steps = positions.to(torch.float32)
        freqs = torch.outer(steps, self.inv_freq)
        scale = self.scale  # the attention factor; times 1.0 changes nothing, so it is skipped
        if self.spec.kind == "longrope":
            late = steps >= self.spec.original_max_positions
            freqs = torch.where(late[:, None], torch.outer(steps, self.inv_long), freqs)
            scale = torch.where(late, self.scale_long, torch.full_like(steps, self.scale))[:, None]
        cos, sin = freqs.cos(), freqs.sin()
        if isinstance(scale, torch.Tensor) or scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The pass's `Rotation` (built once, used by every layer)."""
        return Rotation.of(*self.lookup(positions, dtype), self.spec.style)


@dataclass(frozen=True)
class Rotation:
    """One pass's rotation, laid out once so that each layer rotates q and k with one
    multiply-add: out = x * cos + swap(x) * sin, with cos = (c, c) and sin = (-s, s) over
    the 2F rotated dims and swap exchanging their halves. That is x1 c - x2 s, x2 c + x1 s,
    the same products added in the same order as the textbook form.

    x [T, h, d]; cos/sin [T, 1, 2F]. half: dim i pairs with dim i + F (NeoX, as
    transformers' rotate_half). interleaved: dims 2i and 2i + 1 pair (DeepSeek, Llama 4:
    the complex-number form); they are first gathered pairs' first members first, then
    second members, and written so. q and k get the same permutation, so q.k (all
    attention uses) is unchanged. Dims past 2F pass unchanged.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    style: str

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor, style: str) -> Rotation:
        """From cos/sin [T, F]."""
        return cls(torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :], style)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        n = self.cos.shape[-1]
        rot = x if x.shape[-1] == n else x[..., :n]
        if self.style == "interleaved":
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        out = rot * self.cos + rot.roll(n // 2, -1) * self.sin
        return out if x.shape[-1] == n else torch.cat([out, x[..., n:]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [T, h, d] rotated by cos/sin [T, F] (see `Rotation`)."""
    return Rotation.of(cos, sin, style).apply(x)
