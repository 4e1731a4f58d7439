"""``python -m tokenmill.benchmarks.gguf_cpu``: packed GGUF weights on the CPU against float32, and the
peer, llama.cpp, on the same GGUF file.

Three measurements in one run, with the same thread count: (1) every projection of the model's decoder
layer and its LM head, timed as packed GGUF codes (``quantization/gguf_packed.py``) and as the float32
oneDNN-prepacked weight tokenmill runs today, at 1 and 8 rows; (2) tokenmill's float32 engine and
llama.cpp (llama-cpp-python, an optional benchmark dependency) decoding 128 tokens after 32-token
prompts, one sequence and eight; (3) from those, the decode speed tokenmill would reach with the packed
projections in place of the float32 ones (the rest of its step unchanged).
"""
