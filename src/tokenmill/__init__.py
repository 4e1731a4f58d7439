"""tokenmill: an LLM inference engine written from scratch on PyTorch."""

__version__ = "0.1.0"
