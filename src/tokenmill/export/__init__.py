"""Writing checkpoints (``tokenmill quantize``): a float model's projections rounded with calibration
(GPTQ) into a pre-quantized checkpoint in compressed-tensors' layout, which the loader reads as published."""

from tokenmill.export.quantized_checkpoint import QuantizeOptions, QuantizeSummary, write_quantized_checkpoint

__all__ = ["QuantizeOptions", "QuantizeSummary", "write_quantized_checkpoint"]
