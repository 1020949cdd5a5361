"""specdraft: lossless speculative decoding for Hugging Face causal LMs."""

from .engine import GenerationResult, SpeculativeEngine
from .models import Target, load_target
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["SpeculativeEngine", "GenerationResult", "SamplingParams", "Target", "load_target"]
