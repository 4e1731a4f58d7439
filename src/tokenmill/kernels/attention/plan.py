"""Tile configurations and the decode split plan: host-side choices, fixed at launch (for a CUDA graph,
at capture) from the shapes and launch-time bounds alone."""

from typing import NamedTuple

import torch

from tokenmill.kernels._common import cdiv, sm_count

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on the GPU
# The decode constants below are tuned on the H200 under CUDA graph replay (decode sweeps and batch-1
# decode in the engine; the sweeps are in `git show 3ba5580:reports/gpu/decode-sweep-h200.log`).
# Split decode while the programs stay within about this many per SM (a batch that has this many per SM
# unsplit is not split)...
DECODE_PROGRAMS_PER_SM = 4
DECODE_MIN_PARTITION = 128  # ...into partitions of the bound no shorter than this (keys)...
DECODE_MAX_SPLITS = 64  # ...and no more than this many.
# A context of up to this many keys stays one partition, with no merge of partials.
DECODE_MAX_UNSPLIT = 256
# Prefill launches of at most this many query tokens may split their keys the same way (speculative
# verification steps, short chunks over a long context): their few query tiles would otherwise leave a
# handful of programs walking the whole context. Longer launches have programs enough.
PREFILL_SPLIT_MAX_TOKENS = 64
# ...into at most this many partitions: a tile's merge reads a few partitions of all its rows per round,
# so more partitions cost more rounds. Measured on the H200 (SmolLM2-135M's 16-token prefill graph after
# 512-4,000 keys, reports/gpu/speculative-ngram-smollm2/split-prefill/): at most 16 gave 886-1,087 µs a
# replay where 64 gave 888-1,195 and the unsplit kernel 1,069-3,421.
PREFILL_MAX_SPLITS = 16
# Bytes of keys (and as many of values) in a decode program's first tile, loaded before it waits, per
# warp, up to a partition: with 8 warps (small batches), a whole unsplit context of head_dim 64.
PREFETCH_BYTES_PER_WARP = 4096


class PrefillConfig(NamedTuple):
    block_m: int  # rows of a query tile: tokens_per_tile * group (query tokens x heads of a group)
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


class DecodeConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # per thread, for a compiled launch (``maxnreg``)


class DecodeSplit(NamedTuple):
    """How decode attention cuts each sequence's context (and split prefill attention each query tile's
    visible keys): into ``num_splits`` partitions of
    ``max(ceil(context / num_splits), min_partition)`` keys (rounded up to whole key tiles), the last
    ones empty when the context is short; a context of at most ``max_unsplit`` keys is one partition.
    All are launch parameters: for a CUDA graph they must come from values fixed at capture (see
    :func:`plan_decode_split`)."""

    num_splits: int
    min_partition: int  # keys, a multiple of the config's block_n
    max_unsplit: int = 0


def default_prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    if dtype == torch.float32:  # exact (non-TF32) float32 dots need small tiles to avoid register spills
        return PrefillConfig(32, 32 if head_dim <= 128 else 16, 8, 1)
    if head_dim <= 128:  # two warpgroups: half the registers per thread of one (no spills at d=128)
        return PrefillConfig(128, 64, 8, 2)
    return PrefillConfig(64, 32, 8, 2)


def default_decode_config(
    head_dim: int,
    dtype: torch.dtype,
    num_seq_heads: int = 0,
    num_sms: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> DecodeConfig:
    """``num_seq_heads``: the launch's (sequence, KV head) pairs. While they are fewer than the ``num_sms``
    SMs (small batches) each program has an SM to itself, and 8 warps get through its short chain of
    loads and math sooner; once several programs share an SM, 4 warps are faster (measured on the
    H200 in the engine's batch-1 and batch-64 decode). There a float8 pool (``kv_dtype``), read in
    float16 (``tiles.load_code_tile``), runs best with registers capped at 128 a thread (it compiles to
    142-144 uncapped): 146 µs a layer at 178 sequences of 300-1,500 keys (uncapped 157;
    128-key tiles with three stages 155), 53 at 64 of 1,024 (81; 60) (H200, Triton 3.6;
    ``reports/gpu/quantized-llama-3.1-8b/kv-fp8/``)."""
    if dtype == torch.float32:  # see default_prefill_config
        return DecodeConfig(32 if head_dim <= 128 else 16, 8, 1)
    block_n = 64 if head_dim <= 128 else 32
    if num_seq_heads < num_sms:
        return DecodeConfig(block_n, 8, 2)
    if kv_dtype is not None and kv_dtype.itemsize == 1:
        return DecodeConfig(block_n, 4, 2, max_registers=128)
    return DecodeConfig(block_n, 4, 2)


def launch_waves(num_programs: int, device: torch.device) -> int:
    """Rounds of ``DECODE_PROGRAMS_PER_SM`` programs on every SM that a launch of ``num_programs`` takes."""
    return cdiv(num_programs, DECODE_PROGRAMS_PER_SM * sm_count(device))


def plan_decode_split(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
    block_n: int,
    partition_size: int | None = None,
) -> DecodeSplit:
    """The split-K plan of a decode launch, from launch-time constants only: the batch size, the KV
    heads, a bound on the visible context (``max_seq_len``, or the window when smaller) and the SM count.

    As many splits as keep ``num_seqs * num_kv_heads * num_splits`` programs within
    ``DECODE_PROGRAMS_PER_SM`` per SM, with partitions of the bound of at least ``DECODE_MIN_PARTITION``
    keys and at most ``DECODE_MAX_SPLITS``: one split (a single pass, no merge) once the batch fills
    the GPU alone, or when the bound is at most ``DECODE_MAX_UNSPLIT``. Each sequence then cuts its own
    context into that many partitions of at least ``DECODE_MIN_PARTITION`` keys (whole key tiles), and
    a context of at most ``DECODE_MAX_UNSPLIT`` keys is one partition, which needs no merge. A fixed
    ``partition_size`` instead splits the bound into partitions of that many keys, whatever the context.
    """
    if partition_size is not None:
        partition = cdiv(partition_size, block_n) * block_n
        return DecodeSplit(max(1, cdiv(max_context, partition)), partition)
    fitting = DECODE_PROGRAMS_PER_SM * sm_count(device) // max(1, num_seqs * num_kv_heads)
    splits = max(1, min(fitting, cdiv(max_context, DECODE_MIN_PARTITION), DECODE_MAX_SPLITS))
    if max_context <= DECODE_MAX_UNSPLIT:
        splits = 1
    return DecodeSplit(splits, cdiv(DECODE_MIN_PARTITION, block_n) * block_n, DECODE_MAX_UNSPLIT)


def plan_prefill_split(
    num_tokens: int, num_programs: int, max_context: int | None, device: torch.device, block_n: int
) -> DecodeSplit:
    """The split of a prefill launch of ``num_tokens`` query tokens over ``num_programs`` (query tile, KV
    head) programs, from launch-time constants as :func:`plan_decode_split`'s: ``max_context`` bounds
    every sequence's length (None: unknown, and a windowed layer passes None too: no split). One split
    (the unsplit kernel) above ``PREFILL_SPLIT_MAX_TOKENS`` tokens or for a bound of at most
    ``DECODE_MAX_UNSPLIT`` keys."""
    unsplit = DecodeSplit(1, block_n)
    if max_context is None or num_tokens > PREFILL_SPLIT_MAX_TOKENS or max_context <= DECODE_MAX_UNSPLIT:
        return unsplit
    fitting = DECODE_PROGRAMS_PER_SM * sm_count(device) // max(1, num_programs)
    splits = min(fitting, cdiv(max_context, DECODE_MIN_PARTITION), PREFILL_MAX_SPLITS)
    if splits <= 1:
        return unsplit
    return DecodeSplit(splits, cdiv(DECODE_MIN_PARTITION, block_n) * block_n, DECODE_MAX_UNSPLIT)


def prefetch_keys(config: DecodeConfig, head_dim: int, dtype: torch.dtype, split: DecodeSplit) -> int:
    """Keys in a decode program's first tile: as many whole key tiles as fit ``PREFETCH_BYTES_PER_WARP``
    per warp of 16-bit keys, no more than a partition of a split launch, or than an unsplit context when
    the launch is not split (a short partition or context is then one tile, loaded before the wait);
    one tile in float32, whose dots need small tiles."""
    if dtype == torch.float32:
        return config.block_n
    longest = split.min_partition if split.num_splits > 1 else max(split.min_partition, split.max_unsplit)
    keys = min(longest, PREFETCH_BYTES_PER_WARP * config.num_warps // (2 * head_dim))
    return max(config.block_n, keys // config.block_n * config.block_n)
