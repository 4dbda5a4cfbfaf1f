"""llama.cpp's own logits on the GGUF files specmoe.tools.gguf_convert writes, where
llama-cpp-python is installed (make anchors): llama.cpp is the ground truth for the format
(tensor names, metadata keys, the `llama` q/k permutation, DeepSeek's k_b / v_b split and
MQA head count, expert orientation), and a file it reads differently from specmoe's reader
computes a different model.

llama.cpp is run through its low-level API (as bench/anchors.py does): one llama_decode
over the whole prompt with logits at every position, a float32 KV cache and flash
attention off (its CPU flash attention rounds q to F16), so that an F32 file compares at
float rounding. Each file runs in a child process, since a file llama.cpp's graph rejects
aborts the process (a GGML_ASSERT), which would end the test session.

Tolerances (log-probabilities over the 128-token vocabulary, measured on these models):
- F32: 1e-4 at every position (measured at most 4.3e-6, every family);
- quantized weights: llama.cpp quantizes the activations too (to Q8_0, blocks of 32, for
  Q8_0 / Q4_0 / MXFP4 weights; to Q8_K, blocks of 256, for K-quants) before its integer dot
  products, which specmoe does not. The largest difference at a position is then typically
  0.04-0.10 (median over positions, per file: 0.040-0.059 for Q8_0, Q4_0 and MXFP4,
  0.066-0.10 for Q4_K), with some positions at 1-2 where that rounding flips a router's
  top-k choice, and greedy tokens agree at 85-100% of positions (the others near ties,
  specmoe's two best within 0.16, or positions whose routing flipped). So the median is
  held to 0.15 and the agreement to 80%. A wrong layout is far outside
  these: a file without the q/k permutation, or GPT-OSS's SwiGLU limit not the one
  llama.cpp uses, differs by more than 1 at most positions.
Phi-3.5-MoE is not compared: llama.cpp's phimoe graph computes another model (docs/MODELS.md).
The 256-wide models (K-quants' blocks) are drawn with std scaled by sqrt(64 / width), so
that their activations are the 64-wide ones' size (at the factories' std, Q8_0 itself
differs by a median of 0.3 there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if __name__ != "__main__":
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    pytest.importorskip("llama_cpp")

from llama_cpp_files import gguf_file, prompts as _prompts  # noqa: E402

F32_ATOL = 1e-4
MEDIAN_TOL = 0.15
AGREE = 0.8
def llama_cpp_logprobs(path: Path, prompts: list[list[int]], tmp: Path) -> list[torch.Tensor]:
    out = tmp / f"{path.stem}-llama-cpp.npz"
    run = subprocess.run([sys.executable, __file__, str(path), json.dumps(prompts), str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"llama.cpp could not run {path.name} (exit {run.returncode}):\n{run.stderr[-3000:]}"
    with np.load(out) as z:
        return [torch.log_softmax(torch.from_numpy(z[f"p{i}"]).double(), -1) for i in range(len(prompts))]


def _llama_cpp_logits(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """In the child process: llama.cpp's logits [len, V] at every position of each prompt."""
    import llama_cpp as lib

    errors = []
    log = lib.llama_log_callback(lambda level, text, data: errors.append(text.decode(errors="replace")))
    lib.llama_log_set(log, None)
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp refused {path}:\n{''.join(errors[-20:])}")
    n = max(map(len, prompts))
    cp = lib.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(64, n)
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lib.llama_init_from_model(model, cp)
    batch = lib.llama_batch_init(cp.n_batch, 0, 1)
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    out = []
    for prompt in prompts:
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        batch.n_tokens = len(prompt)
        for i, token in enumerate(prompt):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        if lib.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama_decode failed on {path}")
        out.append(np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                             for i in range(len(prompt))]))
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    return out


def _specmoe_logprobs(path: Path, prompts) -> list[torch.Tensor]:
    from specmoe import LLM

    llm = LLM(model=str(path), device="cpu", dtype="float32")
    try:
        return [torch.as_tensor(p).double() for p in llm.score(prompts)]
    finally:
        llm.close()


def _compare(theirs, ours) -> tuple[np.ndarray, float, list[float]]:
    """Per position the largest |log-prob difference|; the share of equal argmaxes; and
    where they differ, the gap between specmoe's two best log-probabilities."""
    diffs = np.concatenate([(t - o).abs().amax(-1).numpy() for t, o in zip(theirs, ours)])
    ties = [float(o[j].topk(2).values.diff().abs()) for t, o in zip(theirs, ours) for j in range(len(o))
            if t[j].argmax() != o[j].argmax()]
    return diffs, 1 - len(ties) / len(diffs), ties


F32_CASES = [
    *(pytest.param(f, {}, id=f) for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2",
                                          "deepseek_v3", "gpt_oss", "glm4_moe", "llama4")),
    pytest.param("deepseek_v3", {"split_kv_b": False}, id="deepseek_v3-kv_b"),
]


@pytest.mark.parametrize(("family", "convert_kw"), F32_CASES)
def test_llama_cpp_computes_an_f32_file_as_specmoe_does(tmp_path, family, convert_kw):
    """With float32 weights nothing is rounded on either side: llama.cpp's logits are
    specmoe's at every position, so every tensor and metadata key means to llama.cpp what
    the reader takes it to mean."""
    _, path = gguf_file(tmp_path, family, "F32", **convert_kw)
    prompts = _prompts()
    diffs, agree, _ = _compare(llama_cpp_logprobs(path, prompts, tmp_path), _specmoe_logprobs(path, prompts))
    assert diffs.max() <= F32_ATOL, f"max |log-prob diff| {diffs.max():.2e}, per position {np.round(diffs, 3)}"
    assert agree == 1.0


QUANT_CASES = [
    *(pytest.param(f, t, id=f"{f}-{t}") for f in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
      for t in ("Q8_0", "Q4_0")),
    pytest.param("gpt_oss", "MXFP4", id="gpt_oss-MXFP4"),
    *(pytest.param(f, "Q8_0", id=f"{f}-Q8_0") for f in ("glm4_moe", "llama4")),
    *(pytest.param(f, "Q4_K", id=f"{f}-Q4_K") for f in ("mixtral", "qwen3_moe", "deepseek_v3")),
]


@pytest.mark.parametrize(("family", "type_name"), QUANT_CASES)
def test_llama_cpp_reads_a_quantized_file_as_specmoe_does(tmp_path, family, type_name):
    """llama.cpp's logits on the quantized file are specmoe's up to its rounding of the
    activations (module docstring): median per-position difference and greedy agreement."""
    _, path = gguf_file(tmp_path, family, type_name)
    prompts = _prompts()
    diffs, agree, ties = _compare(llama_cpp_logprobs(path, prompts, tmp_path), _specmoe_logprobs(path, prompts))
    detail = f"per position {np.round(diffs, 3)}, argmax agreement {agree:.2f}, gaps where not {np.round(ties, 3)}"
    assert np.median(diffs) <= MEDIAN_TOL, f"median {np.median(diffs):.3f}; {detail}"
    assert agree >= AGREE, detail


if __name__ == "__main__":  # the child process of llama_cpp_logprobs: FILE PROMPTS_JSON OUT.npz
    logits = _llama_cpp_logits(sys.argv[1], json.loads(sys.argv[2]))
    np.savez(sys.argv[3], **{f"p{i}": a for i, a in enumerate(logits)})
