"""tokenmill: an LLM inference engine written from scratch on PyTorch.

``LLM``, ``SamplingParams`` and the output classes are imported on first use, so importing ``tokenmill``
(as the ``tokenmill`` command does before it has parsed its flags) does not import torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineConfig

if TYPE_CHECKING:
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
_LAZY = {
    "LLM": "tokenmill.llm",
    "CompletionOutput": "tokenmill.outputs",
    "Logprob": "tokenmill.outputs",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.structured.params",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tokenmill' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
