"""Exploration for issue 18 on an H100/H200: decode attention over a float8 KV pool with the products on
the float8 tensor cores (``paged_decode_attention(..., fp8_dot=True)``, keys-major tiles in
``kernels/attention/fp8_tiles.py``) against the landed kernel over a bfloat16 pool and over the float8 pool
(converted to bfloat16 per tile).

Llama-3.1-8B's attention (32 query / 8 KV heads of 128), 16-token blocks shuffled in the pool; µs per call
under CUDA-graph replay, K/V bytes read / time, and the relative error against float64 attention over the
pool's own values (the float8 pool dequantized). Workloads: the nano-vllm throughput run's middle (178
sequences of 300-1500 keys), batch 64 of 1024 keys, batch 1 of 208 and of 4096 keys.

    PYTHONPATH=src python scripts/experiments/fp8_decode_attention_ab.py
"""

import random

import torch
import triton.testing

from tokenmill.benchmarks.kernels.attention import paged_batch
from tokenmill.benchmarks.kernels.shapes import ModelShape
from tokenmill.kernels.attention import DecodeConfig, paged_decode_attention

SHAPE = ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
CONFIGS = (None, DecodeConfig(64, 4, 2), DecodeConfig(64, 8, 2), DecodeConfig(128, 4, 2), DecodeConfig(64, 4, 3),
           DecodeConfig(128, 8, 2), DecodeConfig(128, 4, 3))  # fmt: skip


def reference(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
              seq_lens: list[int], scale: float) -> torch.Tensor:  # fmt: skip
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    group = SHAPE.heads // SHAPE.kv_heads
    for i, n in enumerate(seq_lens):
        blocks = tables[i, : -(-n // SHAPE.block_size)].long()
        k = key_pool[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1)  # [n, H, D]
        v = value_pool[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[i].double(), k) * scale, -1)
        out[i] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def main() -> None:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rng = random.Random(0)
    workloads = {
        "nano-vllm 178 x 300-1500": [rng.randint(300, 1500) for _ in range(178)],
        "64 x 1024": [1024] * 64,
        "1 x 208": [208],
        "1 x 4096": [4096],
    }
    for name, seq_lens in workloads.items():
        inputs = paged_batch(SHAPE, seq_lens, [1] * len(seq_lens), torch.bfloat16, device)
        assert inputs.cache is not None and inputs.metadata.block_tables is not None
        pools = {"bf16": (inputs.cache.key, inputs.cache.value),
                 "fp8": (inputs.cache.key.to(torch.float8_e4m3fn), inputs.cache.value.to(torch.float8_e4m3fn))}  # fmt: skip
        tables, lens = inputs.metadata.block_tables, inputs.metadata.seq_lens
        bound = max(seq_lens)
        kv_elements = sum(seq_lens) * SHAPE.kv_heads * SHAPE.head_dim * 2
        for pool_name, fp8_dot in (("bf16", False), ("fp8", False), ("fp8", True)):
            key_pool, value_pool = pools[pool_name]
            ref = reference(inputs.query, key_pool, value_pool, tables, seq_lens, inputs.layer.scale)
            for config in CONFIGS:
                def call(config=config, key_pool=key_pool, value_pool=value_pool, fp8_dot=fp8_dot):  # noqa: ANN202
                    return paged_decode_attention(inputs.query, key_pool, value_pool, tables, lens, bound,
                                                  inputs.layer.scale, config=config, fp8_dot=fp8_dot)  # fmt: skip
                try:
                    err = float((call().double() - ref).norm() / ref.norm())
                    us = triton.testing.do_bench_cudagraph(call, rep=100) * 1e3
                except Exception as error:  # noqa: BLE001
                    print(f"{name:26} {pool_name} fp8_dot={fp8_dot!s:5} {config} FAILED {str(error)[:300]}")
                    continue
                gbs = kv_elements * key_pool.element_size() / us / 1e3
                print(f"{name:26} {pool_name} fp8_dot={fp8_dot!s:5} {config!s:48} {us:8.2f} us "
                      f"{gbs:7.0f} GB/s relerr {err:.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
