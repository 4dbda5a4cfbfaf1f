"""Where specmoe keeps things: the bundled demo model and the cache directory.

The cache dir is `$SPECMOE_CACHE_DIR`, else `~/.cache/specmoe`. It holds the disk tier's
expert files (offload/), affinity tables and quantized draft copies (keyed by
checkpoint), calibrated hardware profiles (profiles/), and what runs measured for
`--policy auto` (acceptance.json, speeds.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import SpecMoEError

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "data" / "demo"


def default_model_dir() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise SpecMoEError("the bundled demo model is not installed in this build; pass --model DIR (a Hugging Face MoE checkpoint)")
    return DEMO_MODEL_DIR


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMOE_CACHE_DIR") or Path.home() / ".cache" / "specmoe")


def offload_dir() -> Path:
    """Default directory of the disk tier's expert files."""
    return cache_dir() / "offload"


def read_json(name: str) -> dict:
    """A JSON object kept in the cache dir; {} when missing or unreadable."""
    try:
        data = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(name: str, data: dict) -> None:
    """Replace a JSON object in the cache dir atomically. Best effort: a read-only cache
    dir only means what was measured is not remembered."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass
