"""Prompt files: one prompt per line of text, or JSON lines with "prompt" (text) or
"prompt_token_ids" (a list of token ids)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SpecMoEError


def read_prompts_file(path: str) -> list:
    p = Path(path)
    if not p.is_file():
        raise SpecMoEError(f"--prompts-file {path}: no such file")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except ValueError:
                raise SpecMoEError(f"{path}:{n}: not a JSON object; each line must be {{\"prompt\": ...}}") from None
            if "prompt_token_ids" in obj:
                prompts.append(obj["prompt_token_ids"])
            elif "prompt" in obj:
                prompts.append(obj["prompt"])
            else:
                raise SpecMoEError(f"{path}:{n}: needs a \"prompt\" or \"prompt_token_ids\" field")
        else:
            prompts.append(line)
    if not prompts:
        raise SpecMoEError(f"--prompts-file {path} holds no prompts")
    return prompts
