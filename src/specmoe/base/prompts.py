"""Prompt files: one prompt per line of text, or JSON lines with "prompt" (text) or
"prompt_token_ids" (a list of token ids). UTF-8 (a leading byte-order mark is allowed);
lines end with \\n or \\r\\n; blank lines are skipped."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SpecMoEError, os_failure


def read_prompts_file(path: str) -> list:
    p = Path(path)
    if not p.is_file():
        raise SpecMoEError(f"--prompts-file {path}: no such file")
    text = _read_text(p, path)
    prompts = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        prompts.append(_json_prompt(line, f"{path}:{n}") if p.suffix == ".jsonl" else line)
    if not prompts:
        raise SpecMoEError(f"--prompts-file {path} holds no prompts")
    return prompts


def _read_text(p: Path, path: str) -> str:
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise os_failure(exc, f"cannot read --prompts-file {path}", "check the file's permissions") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecMoEError(f"--prompts-file {path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                           f"{exc.start}); save the file as UTF-8") from None


def _json_prompt(line: str, where: str) -> str | list[int]:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        raise SpecMoEError(f"{where}: not a JSON object; each line must be {{\"prompt\": ...}}")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise SpecMoEError(f"{where}: \"prompt_token_ids\" must be a list of integers")
        return ids
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise SpecMoEError(f"{where}: \"prompt\" must be a string")
        return obj["prompt"]
    raise SpecMoEError(f"{where}: needs a \"prompt\" or \"prompt_token_ids\" field")
