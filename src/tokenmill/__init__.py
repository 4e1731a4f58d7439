"""tokenmill: an LLM inference engine written from scratch on PyTorch."""

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
