"""Exploration for issue 18 (and batch-1 decode generally): decode attention at short contexts, split or not.

A context of at most ``DECODE_MAX_UNSPLIT`` (256) keys is one partition: one program per KV head walks
every key tile in turn (Llama-3.1-8B: 8 programs on 132 SMs). This times the decode kernel alone (a CUDA
graph of one call per layer, each layer its own pools) at batch 1 for three models' head shapes, under the
default plan of a long ``max_model_len`` and under plans that cut contexts into 64-key partitions, with
the first tile (loaded before the kernel waits for the one ahead) as long as the plan makes it or set to
128 keys. Each variant's output is checked against the default's.

    PYTHONPATH=src:scripts/experiments python scripts/experiments/decode_split_short_ab.py [--models ...]
"""

import argparse

import torch
from graph_timing import graph_micros

from tokenmill.kernels.attention import DecodeSplit, decode, paged_decode_attention
from tokenmill.kernels.attention.plan import plan_decode_split

# (query heads, KV heads, head_dim, layers)
MODELS = {
    "llama-3.1-8b": (32, 8, 128, 32),
    "llama-3.2-1b": (32, 8, 64, 16),
    "smollm2-135m": (9, 3, 64, 30),
}
BLOCK_SIZE, MAX_MODEL_LEN = 16, 8192
CONTEXTS = (64, 130, 208, 288, 400, 512, 768, 1024, 2048)


def variants(kv_heads: int, device: torch.device) -> dict[str, tuple[DecodeSplit, int | None]]:
    default = plan_decode_split(1, kv_heads, MAX_MODEL_LEN, device, 64)
    fitting = plan_decode_split(1, kv_heads, MAX_MODEL_LEN, device, 64, None)
    return {
        "default": (default, None),
        "64-key, 8 splits": (DecodeSplit(8, 64, 0), None),
        "64-key, 8 splits, first 128": (DecodeSplit(8, 64, 0), 128),
        "64-key, 16 splits, first 128": (DecodeSplit(16, 64, 0), 128),
        "64-key, plan's splits, first 128": (DecodeSplit(fitting.num_splits, 64, 0), 128),
        "128-key, plan's splits, unsplit 0": (DecodeSplit(fitting.num_splits, 128, 0), None),
    }


def run_model(name: str) -> None:
    heads, kv_heads, head_dim, layers = MODELS[name]
    device = torch.device("cuda")
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
    bf16 = torch.bfloat16
    pools = [
        (torch.randn(shape, device=device, dtype=bf16), torch.randn(shape, device=device, dtype=bf16))
        for _ in range(layers)
    ]
    query = torch.randn(1, heads, head_dim, device=device, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=device, dtype=torch.int32)[None, :]
    plain_prefetch = decode.prefetch_keys
    print(f"{name}: batch 1, {heads}/{kv_heads} heads of {head_dim}, {layers} layers", flush=True)
    for context in CONTEXTS:
        seq_lens = torch.tensor([context], device=device, dtype=torch.int32)
        reference = None
        line = []
        for label, (split, first) in variants(kv_heads, device).items():
            decode.prefetch_keys = plain_prefetch if first is None else (lambda *_, keys=first: keys)

            def call(layer: int, split: DecodeSplit = split, lens: torch.Tensor = seq_lens) -> torch.Tensor:
                key_pool, value_pool = pools[layer]
                return paged_decode_attention(
                    query, key_pool, value_pool, table, lens, MAX_MODEL_LEN, head_dim**-0.5, split=split
                )

            out = call(0).float()
            reference = out if reference is None else reference
            diff = float((out - reference).abs().max())
            micros = graph_micros([lambda layer=layer: call(layer) for layer in range(layers)])
            line.append(f"{label} {micros:.2f}" + (f" (diff {diff:.0e})" if diff > 1e-2 else ""))
        decode.prefetch_keys = plain_prefetch
        print(f"  {context:5d} keys: " + " | ".join(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for name in args.models.split(","):
        run_model(name)


if __name__ == "__main__":
    main()
