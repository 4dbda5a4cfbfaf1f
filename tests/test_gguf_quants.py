"""specmoe's torch dequantization of every GGUF block type it reads, checked tensor by
tensor against the gguf package's own (llama.cpp's numpy reference), on random blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from specmoe.base.errors import SpecMoEError  # noqa: E402
from specmoe.base.gguf_quants import BLOCKS, dequantize, native, row_bytes  # noqa: E402

# where each block type keeps its float16 fields (random bytes there could be inf or NaN)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BLOCK_TYPES = (*F16_FIELDS, "MXFP4")


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of `type_name`, its scales finite and modest."""
    rng = np.random.default_rng(seed)
    values, nbytes = BLOCKS[type_name]
    blocks = rng.integers(0, 256, size=(rows * cols // values, nbytes), dtype=np.uint8)
    for at in F16_FIELDS.get(type_name, ()):
        blocks[:, at:at + 2] = rng.uniform(-0.1, 0.1, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":
        blocks[:, 0] = rng.integers(100, 150, size=len(blocks))
    return blocks.reshape(rows, row_bytes(type_name, cols))


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_each_block_type_dequantizes_as_the_gguf_package_does(type_name):
    rows, cols = 6, 512
    raw = random_blocks(type_name, rows, cols)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    got = dequantize(torch.from_numpy(raw.copy()), type_name, rows, cols)
    assert native(type_name)
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", ("F32", "F16", "BF16"))
def test_plain_types_read_as_their_values(type_name):
    w = torch.randn(4, 64)
    np_type = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
    raw = w.to(np_type).contiguous().view(torch.uint8).reshape(-1)
    torch.testing.assert_close(dequantize(raw, type_name, 4, 64), w.to(np_type).float())


def test_a_type_specmoe_does_not_implement_goes_through_the_gguf_package():
    rows, cols = 3, 256
    raw = np.random.default_rng(1).integers(0, 256, size=(rows, row_bytes("IQ4_XS", cols)), dtype=np.uint8)
    raw[:, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)  # IQ4_XS: f16 d first
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_XS)
    assert not native("IQ4_XS")
    got = dequantize(torch.from_numpy(raw.copy()), "IQ4_XS", rows, cols)
    torch.testing.assert_close(got, torch.from_numpy(want))


def test_the_dequantized_matrix_comes_in_the_compute_dtype():
    raw = torch.from_numpy(random_blocks("Q8_0", 2, 64).copy())
    assert dequantize(raw, "Q8_0", 2, 64, torch.bfloat16).dtype == torch.bfloat16


def test_a_row_that_is_not_whole_blocks_is_a_clear_error():
    with pytest.raises(SpecMoEError, match="Q4_K row of 100 values is not whole blocks of 256"):
        row_bytes("Q4_K", 100)


@pytest.mark.parametrize(("type_name", "rel"), [("Q4_K", 0.09), ("Q6_K", 0.025)])
def test_the_converters_own_k_quant_encoders_write_blocks_llama_cpp_reads_back(type_name, rel):
    """specmoe.tools.gguf_convert encodes Q4_K and Q6_K itself (the gguf package cannot): the
    gguf package's dequantization of its blocks is the input, to the format's precision."""
    from specmoe.tools.gguf_convert import encode

    w = torch.randn(8, 512) * torch.linspace(0.1, 2.0, 512)
    data, written = encode(w, type_name)
    assert written == type_name and data.shape == (8, row_bytes(type_name, 512))
    back = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]))
    assert ((back - w).norm() / w.norm()) < rel
