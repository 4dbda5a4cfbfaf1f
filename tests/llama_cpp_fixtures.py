"""llama.cpp's log-probabilities on small GGUF files, committed so that CI checks specmoe
against llama.cpp without building it (tests/test_llama_cpp_fixtures.py).

Each case is a tiny random checkpoint of a family written as GGUF by
specmoe.tools.gguf_convert (tests/llama_cpp_files.py's `gguf_file`: the same seeds,
shapes and tokenizer), and llama.cpp's log-probabilities at every position of six prompts,
run as that module runs it (one llama_decode over each prompt, float32 KV cache, flash
attention off, one thread). The fixture keeps the file's SHA-256, so a test that rebuilds
a different file says so instead of comparing two models.

    python tests/llama_cpp_fixtures.py          # rewrite tests/data/llama_cpp/*.npz (needs make anchors)
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "data" / "llama_cpp"
CASES = [("mixtral", "Q8_0"), ("mixtral", "Q4_0"), ("mixtral", "Q4_K"), ("qwen3_moe", "Q4_K"), ("qwen3_moe", "Q8_0"),
         ("gpt_oss", "MXFP4"), ("deepseek_v3", "Q4_0")]


def fixture_path(family: str, type_name: str) -> Path:
    return FIXTURES / f"{family}-{type_name}.npz"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_file(tmp: Path, family: str, type_name: str) -> Path:
    """The case's GGUF file, rebuilt as the fixture's was."""
    sys.path.insert(0, str(HERE))
    from llama_cpp_files import gguf_file

    return gguf_file(tmp, family, type_name)[1]


def prompts() -> list[list[int]]:
    sys.path.insert(0, str(HERE))
    from llama_cpp_files import prompts as file_prompts

    return file_prompts()


def main() -> int:
    sys.path.insert(0, str(HERE))
    from test_gguf_llama_cpp import llama_cpp_logprobs

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for family, type_name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            path = build_file(Path(tmp), family, type_name)
            logprobs = llama_cpp_logprobs(path, prompts(), Path(tmp))
            arrays = {f"p{i}": lp.float().numpy() for i, lp in enumerate(logprobs)}
            np.savez_compressed(fixture_path(family, type_name), sha256=np.array(sha256(path)), **arrays)
            print(f"{family} {type_name}: {fixture_path(family, type_name).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
