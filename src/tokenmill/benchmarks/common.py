"""Setup shared by the benchmarks: the model, the engine, the workload (their shared flags are in
``benchmarks.arguments``, re-exported here)."""

import argparse
from collections.abc import Callable

import torch

from tokenmill.benchmarks.arguments import add_engine_arguments, add_model_arguments, engine_options
from tokenmill.benchmarks.workload import Workload, WorkloadSpec, build_workload
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import resolve_device
from tokenmill.loading import LoadedModel, load_model

MAX_MODEL_LEN_MULTIPLE = 64
__all__ = ["add_engine_arguments", "add_model_arguments", "engine_options"]


def load_for_args(args: argparse.Namespace) -> LoadedModel:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    return load_model(
        args.model,
        device=device,
        dtype=args.dtype,
        load_format=args.load_format,
        seed=args.seed,
        tokenizer=getattr(args, "tokenizer", None),
        quantization=getattr(args, "quantization", None) or "auto",  # --quantization, where it is a flag
    )


def fit_max_model_len(workload: Workload, loaded: LoadedModel, requested: int | None = None) -> int:
    """The context limit for the run: the longest request rounded up to a multiple of 64, so contiguous
    KV reserves what this workload needs rather than the model's whole context."""
    return fit_max_model_len_to(workload.max_total_len, loaded, requested)


def fit_max_model_len_to(max_total_len: int, loaded: LoadedModel, requested: int | None = None) -> int:
    """``fit_max_model_len`` for a request of ``max_total_len`` tokens (prompt and output) at most."""
    if requested is not None:
        return requested
    rounded = -(-max_total_len // MAX_MODEL_LEN_MULTIPLE) * MAX_MODEL_LEN_MULTIPLE
    limit = loaded.config.max_position_embeddings
    if max_total_len > limit:
        raise ValueError(f"the workload needs {max_total_len} positions; the model has {limit}")
    return min(rounded, limit)


def base_engine_config(args: argparse.Namespace, loaded: LoadedModel, max_model_len: int) -> EngineConfig:
    return EngineConfig().with_options(
        model=args.model,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=max_model_len,
    )


def workload_for(spec: WorkloadSpec, loaded: LoadedModel) -> Workload:
    return build_workload(spec, loaded.tokenizer, loaded.config.vocab_size)


def run_as_script(
    name: str,
    doc: str | None,
    add_arguments: "Callable[[argparse.ArgumentParser], None]",
    run: "Callable[[argparse.Namespace], int]",
    argv: list[str] | None = None,
) -> int:
    """A benchmark's standalone entry point: its own parser (with its docstring as help), then ``run``."""
    parser = argparse.ArgumentParser(
        prog=f"tokenmill bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
