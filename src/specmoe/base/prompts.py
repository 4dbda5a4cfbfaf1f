"""Prompt files: one prompt per line of text; JSON lines with "prompt" (text) or
"prompt_token_ids" (a list of token ids); or Parquet with a column of either name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .errors import SpecMoEError

PARQUET_BATCH_ROWS = 1024  # rows read at a time: a large file streams through


def read_prompts_file(path: str) -> list:
    prompts = list(iter_prompts_file(path))
    if not prompts:
        raise SpecMoEError(f"--prompts-file {path} holds no prompts")
    return prompts


def iter_prompts_file(path: str) -> Iterator:
    """The file's prompts, read as they are asked for (a large file is never held whole)."""
    p = Path(path)
    if not p.is_file():
        raise SpecMoEError(f"--prompts-file {path}: no such file")
    if p.suffix == ".parquet":
        return _parquet_prompts(p)
    return _line_prompts(p)


def _line_prompts(p: Path) -> Iterator:
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            yield _json_prompt(line, p, n) if p.suffix == ".jsonl" else line


def _json_prompt(line: str, path: Path, n: int):
    try:
        obj = json.loads(line)
    except ValueError:
        raise SpecMoEError(f"{path}:{n}: not a JSON object; each line must be {{\"prompt\": ...}}") from None
    if isinstance(obj, dict) and "prompt_token_ids" in obj:
        return obj["prompt_token_ids"]
    if isinstance(obj, dict) and "prompt" in obj:
        return obj["prompt"]
    raise SpecMoEError(f"{path}:{n}: needs a \"prompt\" or \"prompt_token_ids\" field")


def _parquet_prompts(p: Path) -> Iterator:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise SpecMoEError(f"{p}: reading Parquet needs pyarrow: pip install pyarrow") from None
    file = pq.ParquetFile(p)
    names = file.schema_arrow.names
    column = next((c for c in ("prompt_token_ids", "prompt") if c in names), None)
    if column is None:
        raise SpecMoEError(f"{p}: needs a \"prompt\" or \"prompt_token_ids\" column; it has {', '.join(names)}")
    for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
        yield from batch.column(0).to_pylist()
