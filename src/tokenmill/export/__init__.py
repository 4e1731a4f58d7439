"""Writing checkpoints: a float model's projections rounded with calibration (GPTQ) into a pre-quantized
checkpoint the loader (and vLLM) reads as published (``tokenmill quantize``)."""

from tokenmill.export.quantized_checkpoint import QuantizeOptions, QuantizeSummary, write_quantized_checkpoint

__all__ = ["QuantizeOptions", "QuantizeSummary", "write_quantized_checkpoint"]
