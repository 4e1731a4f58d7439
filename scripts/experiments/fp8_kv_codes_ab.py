"""Issue 18 on an H100/H200: decode attention over a float8 KV pool read as pairs of e4m3 codes
converted to float16, the products in float16 (``tiles.load_code_tile``, ``fp8_codes=True``, the
default), against the same pool converted to bfloat16 tile by tile (``fp8_codes=False``) and a bfloat16
pool. Llama-3.1-8B's heads (32 query / 8 KV of 128), CUDA-graph replays over tile configs (and with
``--partitions``, split-K partition sizes); each output's error against float64 attention over the
pool's own values.

    PYTHONPATH=src python scripts/experiments/fp8_kv_codes_ab.py [--partitions]

``--profile bf16|fp8``: three launches of the default config over that pool at 178 sequences, for
``ncu -k regex:_decode_kernel --launch-skip 2 --launch-count 1`` (stall reasons of the landed kernel).
"""

import argparse
import functools
import random

import torch
import triton
import triton.testing

from tokenmill.kernels.attention import DecodeConfig, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CONFIGS = (None, *(DecodeConfig(*c) for c in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (64, 8, 2),
                                             (128, 8, 2), (32, 4, 3))))  # fmt: skip
PARTITIONS = (None, 256, 384, 512, 768, 1024)
BOUND = 2048  # max_seq_len of every launch, as the engine's graphs are captured with max_model_len


def workloads() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {
        "178 x 300-1500": [rng.randint(300, 1500) for _ in range(178)],
        "64 x 1024": [1024] * 64,
        "1 x 208": [208],
        "1 x 4096": [4096],
    }


def pools(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen, device="cuda").int()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    shape = (sum(blocks), BLOCK, KV_HEADS, HEAD_DIM)
    key = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    return key, value, tables


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: torch.Tensor, seq_lens: list[int]
) -> torch.Tensor:
    out = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    flat_k, flat_v = key.flatten(0, 1), value.flatten(0, 1)
    for i, n in enumerate(seq_lens):
        rows = tables[i, : -(-n // BLOCK)].long()[:, None] * BLOCK
        slots = (rows + torch.arange(BLOCK, device="cuda")).flatten()[:n]
        k = flat_k[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [n, H, D]
        v = flat_v[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[i].double(), k) * HEAD_DIM**-0.5, -1)
        out[i] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def measure(label: str, call: functools.partial, expected: torch.Tensor, kv_bytes: int) -> None:
    try:
        error = float((call().double() - expected).abs().max() / expected.abs().max())
        us = triton.testing.do_bench_cudagraph(call, rep=100) * 1e3
    except Exception as failure:
        print(f"{label} FAILED {str(failure)[:300]}", flush=True)
        return
    print(f"{label} {us:8.1f} us {kv_bytes / us / 1e6:6.2f} TB/s err {error:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", action="store_true", help="sweep split-K partition sizes instead")
    parser.add_argument("--profile", choices=("bf16", "fp8"), help="launch one pool's kernel for ncu")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if args.profile:
        profile(args.profile)
        return
    for name, seq_lens in workloads().items():
        key16, value16, tables = pools(seq_lens)
        query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        key8, value8 = key16.to(torch.float8_e4m3fn), value16.to(torch.float8_e4m3fn)
        elements = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2  # keys and values
        expected = {16: reference(query, key16, value16, tables, seq_lens),
                    8: reference(query, key8, value8, tables, seq_lens)}  # fmt: skip
        variants = {"bf16 pool": (key16, value16, True), "fp8 pool, converted": (key8, value8, False),
                    "fp8 pool, codes": (key8, value8, True)}  # fmt: skip
        for variant, (k, v, codes) in variants.items():
            configs = CONFIGS if variant == "fp8 pool, codes" or args.partitions else CONFIGS[:1]
            for config in configs[:3] if args.partitions else configs:
                for partition in PARTITIONS if args.partitions else (None,):
                    call = functools.partial(
                        paged_decode_attention, query, k, v, tables, lens, BOUND, HEAD_DIM**-0.5,
                        partition_size=partition, config=config, fp8_codes=codes,
                    )  # fmt: skip
                    label = f"{name:16} {variant:20} {tuple(config) if config else 'default'!s:14}"
                    if args.partitions:
                        label += f" partition {partition!s:5}"
                    measure(label, call, expected[k.element_size() * 8], elements * k.element_size())
        del key16, value16, key8, value8
        torch.cuda.empty_cache()


def profile(pool: str) -> None:
    seq_lens = workloads()["178 x 300-1500"]
    key, value, tables = pools(seq_lens)
    if pool == "fp8":
        key, value = key.to(torch.float8_e4m3fn), value.to(torch.float8_e4m3fn)
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    for _ in range(3):
        paged_decode_attention(query, key, value, tables, lens, BOUND, HEAD_DIM**-0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
