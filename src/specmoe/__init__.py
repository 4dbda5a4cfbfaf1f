"""specmoe: fast offloaded Mixture-of-Experts inference with self-assisted speculative decoding."""

import importlib

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecMoEError", "__version__"]

# The public names are imported when first used, so that a module that needs no torch (the
# bench's capped llama.cpp process, bench/llama_batch.py) can be imported without it.
_PUBLIC = {"LLM": ".api", "RequestOutput": ".api", "SpecMoEError": ".base.errors", "SamplingParams": ".engine.sampling"}


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specmoe' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
