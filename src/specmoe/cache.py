"""specmoe's cache directory: `$SPECMOE_CACHE_DIR`, else `~/.cache/specmoe`.

It holds the disk tier's expert files (offload/), affinity tables and quantized draft
copies (keyed by checkpoint), and calibrated hardware profiles (profiles/)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMOE_CACHE_DIR") or Path.home() / ".cache" / "specmoe")
