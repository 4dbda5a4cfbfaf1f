"""`specmoe quantize --method gptq`: GPTQ through llm-compressor, when it is installed.

llm-compressor loads the whole model with transformers, runs the calibration prompts
through it and solves each expert projection's rounding against them (GPTQ), then saves
a compressed-tensors checkpoint in the same scheme the round-to-nearest path writes.
Unlike that path it does not stream: it needs the model in memory.
"""

from __future__ import annotations

from pathlib import Path

from ..base.errors import SpecMoEError
from ..base.prompts import read_prompts_file

MAX_CALIBRATION_TOKENS = 512


def run(model_dir: Path, out: Path, scheme, calibration_file: str | None) -> None:
    """Quantize the experts of `model_dir` with GPTQ into `out` (config, weights, tokenizer)."""
    if not calibration_file:
        raise SpecMoEError("--method gptq calibrates on prompts: pass --calibration-file FILE (text lines or .jsonl)")
    try:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise SpecMoEError("--method gptq runs llm-compressor's GPTQ: pip install llmcompressor "
                           "(or use the default --method rtn, which needs neither it nor the model in memory)") from None
    texts = [p for p in read_prompts_file(calibration_file) if isinstance(p, str)]
    if not texts:
        raise SpecMoEError(f"{calibration_file}: no text prompts to calibrate on")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=MAX_CALIBRATION_TOKENS, add_special_tokens=False),
        remove_columns=["text"])
    recipe = GPTQModifier(config_groups={"group_0": scheme.model_dump(mode="json")}, ignore=[])
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=MAX_CALIBRATION_TOKENS,
            num_calibration_samples=len(texts))
    model.save_pretrained(str(out), save_compressed=True)
    tokenizer.save_pretrained(str(out))
