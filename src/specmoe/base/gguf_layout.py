"""One routed expert of a GGUF file as the offload tiers keep it: its slices of the
block's stacked ffn_gate_exps / ffn_up_exps / ffn_down_exps tensors, in the file's own
encoding, as one blob (data only, no torch; experts/gguf_format.py computes with it).

    [header | gate rows | up rows | down rows | b_in | b_out]      each section 16-byte aligned

The header (16 bytes) names the three ggml types (their ids, one byte each), so that a
blob says how to read itself: a file may quantize blocks differently (llama.cpp's Q4_K_M
keeps some blocks' down projections in Q6_K). gate and up are [I, D] (rows of D values),
down [D, I]; biases (GPT-OSS) in float32, gate's then up's. Every blob of a model has the
size of its largest one (`nbytes`): what a pool slot holds and a fetch moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gguf_quants import TYPE_IDS, bits_per_weight, row_bytes

HEADER = 16
ALIGN = 16


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Bits:
    """What the draft's copies compare with (experts/quant.draft_modes): bits per weight as
    stored, scales included (Q4_K: 4.5, so int4 copies, 4 bits and their scales, may draft)."""

    bits: float


@dataclass(frozen=True)
class GGUFExpertQuant:
    hidden: int  # D
    inter: int  # I
    bias: bool
    layer_types: tuple[tuple[int, tuple[str, str, str]], ...]  # (MoE layer, (gate, up, down) types)
    source = "gguf"

    @property
    def combos(self) -> tuple[tuple[str, str, str], ...]:
        """The distinct (gate, up, down) encodings, in order of first use."""
        return tuple(dict.fromkeys(t for _, t in self.layer_types))

    @property
    def uniform(self) -> tuple[str, str, str] | None:
        """The one encoding of every block, or None where blocks differ."""
        combos = self.combos
        return combos[0] if len(combos) == 1 else None

    def types_of(self, layer: int) -> tuple[str, str, str]:
        return dict(self.layer_types)[layer]

    def sections(self, types: tuple[str, str, str]) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) in a blob of these encodings."""
        D, I = self.hidden, self.inter
        sizes = [("header", HEADER), ("gate", I * row_bytes(types[0], D)), ("up", I * row_bytes(types[1], D)),
                 ("down", D * row_bytes(types[2], I))]
        if self.bias:
            sizes += [("b_in", 4 * 2 * I), ("b_out", 4 * D)]
        out, offset = {}, 0
        for name, n in sizes:
            out[name] = (offset, n)
            offset = _align(offset + n)
        return out

    def stored_bytes(self, types: tuple[str, str, str]) -> int:
        """The expert's bytes in the file: its slices of the three stacked tensors (and biases)."""
        return sum(n for name, (_, n) in self.sections(types).items() if name != "header")

    def blob_bytes(self, types: tuple[str, str, str]) -> int:
        return _align(max(o + n for o, n in self.sections(types).values()))

    @property
    def nbytes(self) -> int:
        return max(self.blob_bytes(t) for t in self.combos)

    def header(self, types: tuple[str, str, str]) -> list[int]:
        return [TYPE_IDS[t] for t in types] + [0] * (HEADER - 3)

    @property
    def weights(self) -> int:
        return 3 * self.hidden * self.inter

    @property
    def scheme(self) -> str:
        """The expert encodings by name: Q4_K, or Q4_K/Q6_K where projections or blocks differ."""
        names = dict.fromkeys(t for combo in self.combos for t in combo)
        return "/".join(names)

    @property
    def w_in(self) -> Bits:
        return Bits(min(bits_per_weight(t) for combo in self.combos for t in combo))

    def describe(self) -> str:
        bits = sorted({8 * self.blob_bytes(t) / self.weights for t in self.combos})
        per = f"{bits[0]:.2f}" if len(bits) == 1 else f"{bits[0]:.2f}-{bits[-1]:.2f}"
        mixed = "" if self.uniform else f", {len(self.combos)} layouts over the blocks"
        return f"{self.scheme} (gguf, kept as stored{mixed}; {per} bits/weight)"

    def identity(self) -> dict:
        """What the disk tier's file header records."""
        return {"scheme": self.scheme, "source": self.source, "bias": self.bias, "hidden": self.hidden,
                "inter": self.inter, "layers": [[layer, *types] for layer, types in self.layer_types]}
