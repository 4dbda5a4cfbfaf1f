"""specmoe's default encoding against llama.cpp's own log-probabilities on the same GGUF
files, from committed fixtures (tests/llama_cpp_fixtures.py made them with llama.cpp), so
that this runs everywhere, without llama.cpp.

In the default encoding specmoe rounds each activation row to 8 bits exactly as llama.cpp
does before the same weights (blocks of 32 with a float16 scale for Q8_0, Q4_0 and MXFP4
weights; blocks of 256 for K-quants) and multiplies the blocks as stored: what remains is
the order of float additions. Measured: a median difference per position of about 1e-6,
the same greedy token at every position; where a rounding tie goes the other way a
router's choice can flip and the prompt's later positions differ by up to about 0.1. The
reference encoding (`--dtype float32`, no activation rounding) is 0.04-0.09 away: the
default must stay much closer than it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from llama_cpp_fixtures import CASES, build_file, fixture_path, prompts, sha256  # noqa: E402

from specmoe import LLM  # noqa: E402

MEDIAN_TOL = 1e-4  # median over positions of the largest |log-prob difference| (vocabulary of 128)
MAX_TOL = 0.2  # a position behind a flipped routing choice
AGREE = 0.98  # greedy tokens equal at this share of positions


def logprobs(path: Path, dtype: str) -> list[torch.Tensor]:
    llm = LLM(model=str(path), device="cpu", dtype=dtype)
    try:
        return [torch.as_tensor(p).double() for p in llm.score(prompts())]
    finally:
        llm.close()


def compare(theirs, ours) -> tuple[np.ndarray, float]:
    diffs = np.concatenate([(t - o).abs().amax(-1).numpy() for t, o in zip(theirs, ours)])
    agree = np.mean([bool(t[j].argmax() == o[j].argmax()) for t, o in zip(theirs, ours) for j in range(len(o))])
    return diffs, float(agree)


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


@pytest.mark.parametrize(("family", "type_name"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_the_default_encoding_gives_llama_cpps_logprobs_on_the_same_file(workdir, family, type_name):
    with np.load(fixture_path(family, type_name)) as z:
        theirs = [torch.from_numpy(z[f"p{i}"]).double() for i in range(len(prompts()))]
        want_sha = str(z["sha256"])
    path = build_file(workdir / f"{family}-{type_name}", family, type_name)
    assert sha256(path) == want_sha, (f"{path.name} is not the file the fixture was made from: rebuild the fixtures "
                                      "with `python tests/llama_cpp_fixtures.py` (make anchors first)")
    diffs, agree = compare(theirs, logprobs(path, "auto"))
    reference, _ = compare(theirs, logprobs(path, "float32"))
    assert np.median(diffs) <= MEDIAN_TOL, f"median {np.median(diffs):.2e}, per position {np.round(diffs, 4)}"
    assert diffs.max() <= MAX_TOL, f"largest {diffs.max():.3f}, per position {np.round(diffs, 4)}"
    assert agree >= AGREE, f"argmax agreement {agree:.2f}"
    assert np.median(diffs) * 100 <= np.median(reference), (
        f"as stored {np.median(diffs):.2e} is not far closer to llama.cpp than the float32 reference "
        f"({np.median(reference):.2e})")
