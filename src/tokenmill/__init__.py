"""tokenmill: an LLM inference engine written from scratch on PyTorch."""

from tokenmill.config import EngineConfig
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
