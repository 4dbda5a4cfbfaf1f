"""specmoe: fast offloaded Mixture-of-Experts inference with self-assisted speculative decoding."""

from .api import LLM, RequestOutput
from .base.errors import SpecMoEError
from .engine.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecMoEError", "__version__"]
