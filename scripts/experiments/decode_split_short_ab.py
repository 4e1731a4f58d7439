"""Exploration for issue 18: batch-1 decode attention at short contexts, split or not.

Llama-3.1-8B's batch-1 decode spends ~9.6 µs a layer in attention at ~200 keys (0.31 ms of a 2.8 ms int8
token). A context of at most ``DECODE_MAX_UNSPLIT`` (256) keys is one partition: one program per KV head
(8 on 132 SMs) walks every key tile in turn. This times the decode kernel alone (CUDA graph of one call per
layer, 32 layers with their own pools) under the default plan of a long ``max_model_len`` and under
plans that cut short contexts into 64-key partitions, with each variant checked against the default's
output.

    PYTHONPATH=src python scripts/experiments/decode_split_short_ab.py
"""

import torch

from tokenmill.kernels.attention import DecodeSplit, paged_decode_attention
from tokenmill.kernels.attention.plan import plan_decode_split

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 32, 8, 128, 16, 32
MAX_MODEL_LEN = 8192


def graph_micros(calls, repeats: int = 50) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * len(calls))


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    pools = [
        (
            torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
            torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    query = torch.randn(1, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=device, dtype=torch.int32)[None, :]
    default = plan_decode_split(1, KV_HEADS, MAX_MODEL_LEN, device, 64)
    variants = {
        f"default {tuple(default)}": default,
        "64-key partitions, 64 splits": DecodeSplit(64, 64, 0),
        "64-key partitions, 16 splits": DecodeSplit(16, 64, 0),
        "64-key partitions, 8 splits": DecodeSplit(8, 64, 0),
        "128-key partitions, no unsplit": DecodeSplit(64, 128, 0),
        "unsplit up to 64": DecodeSplit(64, 64, 64),
    }
    print(f"{torch.cuda.get_device_name()}, batch 1, {HEADS}/{KV_HEADS} heads, d {HEAD_DIM}", flush=True)
    for context in (130, 208, 288, 512, 1024):
        seq_lens = torch.tensor([context], device=device, dtype=torch.int32)
        results = {}
        for label, split in variants.items():

            def call(
                layer: int, split: DecodeSplit = split, seq_lens: torch.Tensor = seq_lens
            ) -> torch.Tensor:
                key_pool, value_pool = pools[layer]
                return paged_decode_attention(
                    query, key_pool, value_pool, table, seq_lens, MAX_MODEL_LEN, HEAD_DIM**-0.5, split=split
                )

            results[label] = call(0).float()
            micros = graph_micros([lambda layer=layer: call(layer) for layer in range(LAYERS)])
            diff = float((results[label] - next(iter(results.values()))).abs().max())
            print(
                f"  context {context:5d} {label:32s} {micros:6.2f} us a layer, max diff {diff:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
