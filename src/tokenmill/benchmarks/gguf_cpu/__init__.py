"""``python -m tokenmill.benchmarks.gguf_cpu``: packed GGUF weights on the CPU against float32, and the
peer, llama.cpp, on the same GGUF file.

In one run, with one thread count: (1) every projection of the model (q/k/v and gate/up fused as the
engine holds them, the attention output, down, the LM head) over all layers, as packed GGUF codes
(``quantization/gguf_packed.py``) and as the float32 oneDNN-prepacked weight tokenmill runs today, at 1 and
8 rows, with float32, int16 and int8 inputs; (2) decoding 128 tokens after 32-token prompts, one sequence
and eight, EOS ignored: tokenmill float32 (the file's weights dequantized), tokenmill
``quantization="gguf"`` (projections and LM head kept packed; the default, with float32 inputs, and with
int16 and int8 inputs), greedy tokens compared with float32, and llama.cpp (llama-cpp-python, an optional
benchmark dependency: ``pip install llama-cpp-python``, or ``--no-peer``), with the default engine's
weight bytes per second as a share of the machine's copy bandwidth. ``--report-dir`` writes
``gguf-cpu.md`` / ``.json``.
"""
