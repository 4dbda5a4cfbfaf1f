"""specmoe: fast offloaded Mixture-of-Experts inference with self-assisted speculative decoding."""

from .engine.sampling import SamplingParams
from .errors import SpecMoEError
from .llm import LLM, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecMoEError", "__version__"]
