"""Where the top-p kernel starts to beat sorting: GPU time of the fused top-p draw at a few batch sizes,
the kernel forced on and off (``fused.TOP_P_KERNEL_MIN_ROWS``), the batch prebuilt, the draw replayed
from a CUDA graph (``triton.testing.do_bench_cudagraph``). Llama 3's vocabulary, temperature 0.8, top-p
0.9, random logits of a peaked shape; both paths' tokens compared.

    python scripts/experiments/top_p_kernel_rows.py [ROWS,...]
"""

import functools
import sys

import torch
from triton.testing import do_bench_cudagraph

from tokenmill.benchmarks.report import detect_hardware, provenance_header
from tokenmill.runner.sampler import SamplingBatch, SamplingRow, fused
from tokenmill.sampling_params import SamplingParams

VOCAB = 128256


def main(batch_sizes: list[int]) -> None:
    device = torch.device("cuda")
    print(provenance_header(detect_hardware(device)))
    print("| rows | sorting µs | kernel µs | same tokens |\n| --- | --- | --- | --- |")
    params = SamplingParams(temperature=0.8, top_p=0.9)
    for rows in batch_sizes:
        generator = torch.Generator(device=device).manual_seed(rows)
        logits = torch.randn(rows, VOCAB, device=device, generator=generator) * 3
        batch = SamplingBatch.build([SamplingRow(params)] * rows, VOCAB, device)
        draw = batch.require_draw()
        times, tokens = {}, {}
        for name, min_rows in (("sorting", 10**9), ("kernel", 1)):
            fused.TOP_P_KERNEL_MIN_ROWS = min_rows
            tokens[name] = fused.fused_draw(logits, batch, draw).tolist()
            times[name] = 1000 * do_bench_cudagraph(functools.partial(fused.fused_draw, logits, batch, draw))
        same = tokens["sorting"] == tokens["kernel"]
        print(f"| {rows} | {times['sorting']:.1f} | {times['kernel']:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    sizes = sys.argv[1] if len(sys.argv) > 1 else "1,4,8,12,16,24,32,64"
    main([int(size) for size in sizes.split(",")])
