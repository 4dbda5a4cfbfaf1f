"""Where specmoe keeps things: the bundled demo model and the cache directory.

The cache dir is `$SPECMOE_CACHE_DIR`, else `~/.cache/specmoe`. It holds the disk tier's
expert files (offload/), affinity tables and quantized draft copies (keyed by
checkpoint), calibrated hardware profiles (profiles/), and what runs measured for
`--policy auto` (acceptance.json, speeds.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .errors import SpecMoEError, warn
from .files import publish

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "data" / "demo"
TRANSLATE_MODEL_DIR = Path(__file__).resolve().parents[1] / "data" / "translate"
# the bundled models by the names `--model` and the server know them
BUNDLED = {"specmoe-demo": DEMO_MODEL_DIR, "specmoe-demo-translate": TRANSLATE_MODEL_DIR}


def default_model_dir() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise SpecMoEError("the bundled demo model is not installed in this build; pass --model DIR (a Hugging Face MoE checkpoint)")
    return DEMO_MODEL_DIR


def resolve_model_dir(model: str | Path | None) -> Path:
    """--model: a directory, or a bundled model's name (a directory of that name wins);
    None: the demo model."""
    if model is None:
        return default_model_dir()
    if str(model) in BUNDLED and not Path(model).exists():
        path = BUNDLED[str(model)]
        if not (path / "config.json").is_file():
            raise SpecMoEError(f"the bundled model {model} is not installed in this build; pass --model DIR")
        return path
    return Path(model)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMOE_CACHE_DIR") or Path.home() / ".cache" / "specmoe")


def offload_dir() -> Path:
    """Default directory of the disk tier's expert files."""
    return cache_dir() / "offload"


def read_json(name: str, well_formed: Callable[[dict], bool] = lambda data: True) -> dict:
    """A JSON object kept in the cache dir; {} when missing. The file is untrusted input:
    one that cannot be read, is not JSON or not `well_formed` is ignored with a warning
    (once per process), and the next `write_json` replaces it."""
    path = cache_dir() / name
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON and UTF-8 errors
        return _ignored(path, f"cannot be read ({exc})")
    if not isinstance(data, dict) or not well_formed(data):
        return _ignored(path, "does not have the expected shape")
    return data


_warned: set[Path] = set()  # each damaged file is reported once, however often it is read


def _ignored(path: Path, why: str) -> dict:
    if path not in _warned:
        _warned.add(path)
        warn(f"ignoring {path}: it {why}; it will be rebuilt")
    return {}


def write_json(name: str, data: dict) -> None:
    """Replace a JSON object in the cache dir atomically. Best effort: a read-only cache
    dir only means what was measured is not remembered."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        publish(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n"))
    except OSError:
        pass
