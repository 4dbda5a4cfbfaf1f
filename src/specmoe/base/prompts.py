"""Prompt files: one prompt per line of text; JSON lines with "prompt" (text) or
"prompt_token_ids" (a list of token ids); or Parquet with a column of either name.
Text files are UTF-8 (a leading byte-order mark is allowed); lines end with \\n or
\\r\\n; blank lines are skipped. Prompts are read as they are asked for, so a large file
is never held whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .errors import SpecMoEError, os_failure

PARQUET_BATCH_ROWS = 1024  # rows read at a time: a large file streams through


def read_prompts_file(path: str) -> list:
    prompts = list(iter_prompts_file(path))
    if not prompts:
        raise SpecMoEError(f"--prompts-file {path} holds no prompts")
    return prompts


def iter_prompts_file(path: str) -> Iterator:
    """The file's prompts, in order."""
    p = Path(path)
    if not p.is_file():
        raise SpecMoEError(f"--prompts-file {path}: no such file")
    if p.suffix == ".parquet":
        return _parquet_prompts(p)
    return _line_prompts(p, path)


def _line_prompts(p: Path, path: str) -> Iterator:
    try:
        with open(p, "rb") as f:  # bytes, decoded line by line: an error names its line
            for n, raw in enumerate(f, 1):  # binary lines end at \n only
                line = _decode(raw.removeprefix(b"\xef\xbb\xbf") if n == 1 else raw, f"{path}:{n}")
                line = line.removesuffix("\n").removesuffix("\r")
                if line.strip():
                    yield _json_prompt(line, f"{path}:{n}") if p.suffix == ".jsonl" else line
    except OSError as exc:
        raise os_failure(exc, f"cannot read --prompts-file {path}", "check the file's permissions") from None


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecMoEError(f"--prompts-file {where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                           f"{exc.start + 1}); save the file as UTF-8") from None


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
