"""The sizes of the four tables: a quick CPU preset and the seed-sized GPU preset, each field a flag that
overrides it. Torch-free, so ``tokenmill bench seeds`` checks its flags before anything is loaded."""

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.benchmarks.argument_types import non_negative_float, positive_int

TABLES = ("kv-cache", "batch", "memory", "serving")


def _sizes(help_text: str) -> Any:
    return field(metadata={"help": help_text})


@dataclass(frozen=True)
class SeedSizes:
    # 1. KV cache vs recompute (one request at a time)
    gen_lens: tuple[int, ...] = _sizes("generation lengths of the KV-cache table")
    gen_prompt_len: int = _sizes("prompt tokens of the generation-length rows")
    prompt_lens: tuple[int, ...] = _sizes("prompt lengths of the KV-cache table")
    prompt_gen_len: int = _sizes("output tokens of the prompt-length rows")
    # 2. batch scaling
    batch_sizes: tuple[int, ...] = _sizes("batch sizes of the scaling table")
    batch_input_len: int = _sizes("prompt tokens per request, batch table")
    batch_output_len: int = _sizes("output tokens per request, batch table")
    # 3. contiguous vs paged KV memory
    memory_batch_sizes: tuple[int, ...] = _sizes("batch sizes of the KV memory table")
    memory_input_len: int = _sizes("prompt tokens per request, memory table")
    memory_output_len: int = _sizes("output tokens per request, memory table")
    context_len: int = _sizes("max_model_len: the slab contiguous KV reserves per sequence")
    paged_pool_gib: float = _sizes("the paged KV pool, fixed for every batch size (GiB)")
    kv_limit_gib: float = _sizes("KV memory the contiguous slabs may take (GiB; 0: all the GPU has)")
    # 4. serving by concurrent users
    users: tuple[int, ...] = _sizes("concurrent users of the serving table")
    min_requests: int = _sizes("requests per user level at least (each user sends one at a time)")
    serve_input_len: int = _sizes("prompt tokens per request, serving table")
    serve_output_len: int = _sizes("output tokens per request, serving table")
    # noise on shared machines
    repeats: int = _sizes("runs of each KV-cache and batch row; the fastest is kept")


PRESETS = {
    # Small enough for 2 CPU cores: the whole command in a few minutes.
    "cpu": SeedSizes(
        gen_lens=(32, 64, 128),
        gen_prompt_len=16,
        prompt_lens=(16, 64, 256),
        prompt_gen_len=16,
        batch_sizes=(1, 4, 16, 64),
        batch_input_len=32,
        batch_output_len=16,
        memory_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
        memory_input_len=32,
        memory_output_len=16,
        context_len=1024,
        paged_pool_gib=0.25,
        kv_limit_gib=1.0,
        users=(1, 4, 16, 32),
        min_requests=8,
        serve_input_len=32,
        serve_output_len=16,
        repeats=2,
    ),
    # The seed's sizes: generation lengths 200/500/1000, batch 1 to 512, users 1 to 128.
    "gpu": SeedSizes(
        gen_lens=(200, 500, 1000),
        gen_prompt_len=16,
        prompt_lens=(128, 512, 896),
        prompt_gen_len=100,
        batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        batch_input_len=128,
        batch_output_len=128,
        memory_batch_sizes=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048),
        memory_input_len=64,
        memory_output_len=64,
        context_len=1024,
        paged_pool_gib=16.0,
        kv_limit_gib=0.0,
        users=(1, 8, 32, 64, 128),
        min_requests=16,
        serve_input_len=64,
        serve_output_len=64,
        repeats=1,
    ),
}


def flag_name(size_name: str) -> str:
    return size_name.replace("_", "-")


def int_list(text: str) -> tuple[int, ...]:
    """``1,8,32`` -> (1, 8, 32): positive, ascending."""
    values = tuple(positive_int(part.strip()) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'")
    if list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected ascending sizes without repeats, got '{text}'")
    return values


def table_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in TABLES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown table '{text}'; choose from {', '.join(TABLES)}")
    return tuple(dict.fromkeys(names))


def _parser_for(default: object) -> Any:
    if isinstance(default, tuple):
        return int_list
    return non_negative_float if isinstance(default, float) else positive_int


def _text(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}"


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sizes (override the preset)")
    for size in fields(SeedSizes):
        cpu, gpu = (getattr(PRESETS[name], size.name) for name in ("cpu", "gpu"))
        group.add_argument(
            f"--{flag_name(size.name)}",
            type=_parser_for(cpu),
            default=None,
            help=f"{size.metadata['help']} (cpu {_text(cpu)}; gpu {_text(gpu)})",
        )


def sizes_from(args: argparse.Namespace, preset: str) -> SeedSizes:
    """The preset with every size flag given on the command line put in."""
    given = {f.name: getattr(args, f.name) for f in fields(SeedSizes) if getattr(args, f.name) is not None}
    sizes = dataclasses.replace(PRESETS[preset], **given)
    check_sizes(sizes)
    return sizes


def check_sizes(sizes: SeedSizes) -> None:
    longest = max(
        sizes.gen_prompt_len + max(sizes.gen_lens),
        max(sizes.prompt_lens) + sizes.prompt_gen_len,
        sizes.batch_input_len + sizes.batch_output_len,
        sizes.memory_input_len + sizes.memory_output_len,
        sizes.serve_input_len + sizes.serve_output_len,
    )
    if longest > sizes.context_len:
        raise ValueError(
            f"a request of {longest} tokens does not fit --context-len {sizes.context_len}: "
            "shorten it or raise --context-len"
        )
    if sizes.paged_pool_gib <= 0:
        raise ValueError("--paged-pool-gib must be positive")
