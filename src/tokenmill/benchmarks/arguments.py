"""The flags of every benchmark, without torch: ``tokenmill bench ladder --rungs foo`` and every other bad
flag fail at once, before torch, transformers or a model is loaded. Each benchmark's ``add_arguments`` is
the function here; its module holds the run."""

import argparse
import typing
from collections.abc import Callable, Collection
from dataclasses import fields
from pathlib import Path
from typing import Any

from tokenmill.benchmarks.accuracy.arguments import add_accuracy_arguments
from tokenmill.benchmarks.argument_types import non_negative_int, positive_float, positive_int, report_dir
from tokenmill.benchmarks.ladder.rungs import RUNGS
from tokenmill.benchmarks.scenarios.sizes import PRESETS, Sizes, flag_name
from tokenmill.benchmarks.scenarios.workloads import WORKLOADS
from tokenmill.benchmarks.seeds.sizes import PRESETS as SEED_PRESETS
from tokenmill.benchmarks.seeds.sizes import TABLES, add_size_arguments, table_list
from tokenmill.benchmarks.serve.arguments import add_serve_arguments
from tokenmill.benchmarks.tensor_parallel.arguments import add_tensor_parallel_arguments
from tokenmill.benchmarks.workload import DATASETS, parse_length_range
from tokenmill.config import EngineConfig, StructuredOutputBackendName
from tokenmill.config_flags import add_engine_config_arguments, engine_options_from
from tokenmill.config_help import CHOICES

# -- shared ----------------------------------------------------------------------------------------------

PROMPT_SOURCES = ("auto", "text", "random")
# Fields every benchmark sets its own way: from --model / --device / ... and the workload's length.
SET_BY_BENCHMARK = frozenset(
    {"model", "tokenizer", "device", "dtype", "load_format", "seed", "max_model_len"}
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=None,
        help="model folder, .gguf file, short name, hub id or preset (default: smollm2)",
    )
    group.add_argument("--tokenizer", default=None, help="take the tokenizer of this model instead")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default: auto)")
    group.add_argument("--dtype", default="auto", choices=CHOICES["dtype"], help="default: auto")
    group.add_argument("--load-format", default="auto", choices=CHOICES["load_format"], help="default: auto")
    group.add_argument("--seed", type=int, default=0, help="workload and engine seed (default: 0)")
    group.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads on CPU (default: torch's)"
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """EngineConfig toggles (every field but the model's and ``exclude``); options left unset keep
    EngineConfig's defaults."""
    group = parser.add_argument_group("tokenmill engine")
    group.add_argument("--max-model-len", type=int, default=None, help="default: fit the workload")
    add_engine_config_arguments(group, exclude=SET_BY_BENCHMARK | set(exclude))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return engine_options_from(args, exclude=SET_BY_BENCHMARK)


def _report_dir_argument(group: Any, default_name: str) -> None:
    group.add_argument(
        "--report-dir",
        type=report_dir,
        default=None,
        help=f"default: {default_name} in $TOKENMILL_REPORT_DIR, else in ~/.cache/tokenmill/reports",
    )


# -- one function per benchmark ----------------------------------------------------------------------------


def add_ladder_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=32)
    group.add_argument("--input-len-range", type=parse_length_range, default=(32, 96), metavar="MIN-MAX")
    group.add_argument("--output-len-range", type=parse_length_range, default=(16, 96), metavar="MIN-MAX")
    group.add_argument("--prompt-source", choices=PROMPT_SOURCES, default="auto")
    group = parser.add_argument_group("ladder")
    group.add_argument(
        "--batch-size", type=positive_int, default=8, help="static/continuous batch and HF batch (default 8)"
    )
    group.add_argument("--block-size", type=int, default=EngineConfig().kv.block_size)
    group.add_argument("--max-model-len", type=int, default=None, help="default: fit the workload")
    names = [rung.name for rung in RUNGS]
    group.add_argument("--rungs", nargs="+", default=None, choices=names, metavar="NAME", help="a subset")
    _report_dir_argument(group, "ladder-<device>")
    group.add_argument("--skip-hf", action="store_true", help="do not run the HF generate peer")


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_engine_arguments(parser)
    group = parser.add_argument_group("latency")
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    group.add_argument("--output-len", type=int, default=64, help="output tokens, EOS ignored (default 64)")
    group.add_argument(
        "--iters", type=positive_int, default=5, help="measured runs, after one warm-up (default 5)"
    )
    group.add_argument("--skip-hf", action="store_true", help="do not run the HF generate peer")
    group.add_argument(
        "--report-dir", type=report_dir, default=None, help="also write what is printed to latency.md there"
    )


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_engine_arguments(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=sorted(DATASETS), default=None, help="a preset workload")
    group.add_argument("--num-requests", type=int, default=32)
    group.add_argument("--input-len", type=int, default=64, help="fixed prompt length (default 64)")
    group.add_argument("--output-len", type=int, default=64, help="fixed output length (default 64)")
    group.add_argument(
        "--random-range",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="input and output lengths uniform in [LO, HI] instead of fixed",
    )
    group.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    group.add_argument("--prompt-source", choices=PROMPT_SOURCES, default="auto")
    group = parser.add_argument_group("comparison")
    group.add_argument(
        "--hf-batch-size", type=positive_int, default=8, help="HF generate static batch (default 8)"
    )
    group.add_argument("--hf-continuous", action="store_true", help="also run HF continuous batching")
    group.add_argument("--skip-hf", action="store_true", help="do not run the HF peer")
    group.add_argument(
        "--verify-requests", type=non_negative_int, default=4, help="requests re-run alone to check (0: none)"
    )
    group.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="serve the workload this many times, each on a fresh engine in this process: the report "
        "compares the first run with the later ones (default 1)",
    )
    group.add_argument(
        "--report-dir", type=report_dir, default=None, help="also write throughput.md/.json here"
    )


def add_load_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="folder, .gguf, short name, hub id, or a preset with --load-format dummy",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=CHOICES["dtype"])
    parser.add_argument("--load-format", default="auto", choices=CHOICES["load_format"])
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "fp8"))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


KERNEL_DTYPES = ("bfloat16", "float16", "float32")


def add_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda", help="cuda, cuda:1 ... (cpu only with TRITON_INTERPRET=1)"
    )
    parser.add_argument("--dtype", choices=KERNEL_DTYPES, default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself")
    parser.add_argument("--sweep", action="store_true", help="also time attention tile configurations")
    parser.add_argument("--only", default=None, help="run only kernels whose name contains this")
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up budget (default 25)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring budget (default 100)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel-by-kernel table")
    parser.add_argument("--no-sampler", action="store_true", help="skip the sampler step")
    parser.add_argument("--no-model", action="store_true", help="skip the fused-model check")
    parser.add_argument("--no-gemv", action="store_true", help="skip the small-batch projections")
    parser.add_argument(
        "--gemv-sweep", action="store_true", help="the GEMV over tile configurations (llama-3.2-1b, M=1)"
    )
    parser.add_argument(
        "--decode-sweep", action="store_true", help="decode attention under CUDA graphs over split counts"
    )
    parser.add_argument(
        "--profile-host", action="store_true", help="cProfile of eager decode calls (host time)"
    )


ALL_WORKLOADS = "all"
SCENARIO_DRIVERS = ("offline", "serve")


def add_scenarios_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    group = parser.add_argument_group("scenarios")
    group.add_argument(
        "--workload",
        type=_workload_name,
        default=ALL_WORKLOADS,
        help=f"one of {', '.join(WORKLOADS)}, or all (default)",
    )
    group.add_argument("--driver", choices=SCENARIO_DRIVERS, default="offline", help="default: offline")
    group.add_argument(
        "--url",
        action="append",
        default=None,
        help="drive this server instead of starting one (implies --driver serve); give it twice, feature "
        "off then on, to compare two servers; --model is then the model name sent (default: the server's)",
    )
    group.add_argument("--api-key", default=None, help="with --url: sent as 'Authorization: Bearer KEY'")
    group.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds per HTTP request (serve driver)"
    )
    group.add_argument(
        "--preset", choices=("auto", *PRESETS), default="auto", help="sizes: auto = gpu on CUDA, else cpu"
    )
    group.add_argument("--prompt-source", choices=PROMPT_SOURCES, default="auto")
    _report_dir_argument(group, "scenarios-<device>-<driver>")
    add_engine_arguments(parser, exclude={f.name for f in fields(Sizes)})  # sizes set those
    _add_size_arguments(parser)


def _workload_name(text: str) -> str:
    name = text.replace("-", "_")
    if name not in (*WORKLOADS, ALL_WORKLOADS):
        raise argparse.ArgumentTypeError(
            f"unknown workload '{text}'; choose from {', '.join(WORKLOADS)}, all"
        )
    return name


def _add_size_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sizes (override the preset)")
    for size in fields(Sizes):
        default = getattr(PRESETS["cpu"], size.name)
        kind: Callable[[str], Any] = parse_length_range if isinstance(default, tuple) else type(default)
        metavar = "MIN-MAX" if isinstance(default, tuple) else None
        cpu, gpu = (_size_text(getattr(PRESETS[p], size.name)) for p in ("cpu", "gpu"))
        help_text = f"{size.metadata['help']} (cpu {cpu}, gpu {gpu})"
        group.add_argument(
            f"--{flag_name(size.name)}", type=kind, default=None, metavar=metavar, help=help_text
        )


def _size_text(value: Any) -> str:
    return f"{value[0]}-{value[1]}" if isinstance(value, tuple) else f"{value:g}"


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)  # its --tokenizer serves a tokenizer-less (dummy) model
    add_engine_arguments(parser, exclude={"structured_output_backend"})
    backends = typing.get_args(StructuredOutputBackendName)
    group = parser.add_argument_group("structured outputs")
    group.add_argument("--backends", default=",".join(backends), help="comma-separated (default: all)")
    group.add_argument("--mask-batch-sizes", default="1,64", help="batch sizes of the mask timing")
    group.add_argument("--skip-masks", action="store_true", help="no mask timing")
    group.add_argument("--skip-e2e", action="store_true", help="no end-to-end runs")
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=64)
    group.add_argument("--input-len", type=int, default=128)
    group.add_argument("--output-len", type=int, default=256)
    group.add_argument("--check-prompts", type=int, default=4, help="prompts of the correctness checks")
    group.add_argument(
        "--check-tokens", type=int, default=512, help="max tokens of the structured check's outputs"
    )
    group.add_argument(
        "--report-dir", type=report_dir, default=None, help="also write structured.md/.json here"
    )


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_engine_arguments(parser)
    group = parser.add_argument_group("n-gram: batch 1 copying prompts, then a batch of open-ended ones")
    group.add_argument("--skip-ngram", action="store_true", help="no n-gram runs")
    group.add_argument("--max-tokens", type=int, default=320, help="most tokens per batch-1 answer")
    group.add_argument("--batch-size", type=positive_int, default=64, help="open-ended prompts run at once")
    group.add_argument("--batch-output-len", type=int, default=128, help="tokens per open-ended answer")
    group.add_argument(
        "--batch-rounds", type=positive_int, default=2, help="off-on-on-off rounds of the open-ended batch"
    )
    group = parser.add_argument_group("draft model: the cost of a round, the speed-up it implies")
    group.add_argument("--draft-model", default=None, help="a draft model with the model's vocabulary")
    group.add_argument("--draft-load-format", default="auto", choices=CHOICES["load_format"])
    group.add_argument("--draft-num-prompts", type=int, default=3)
    group.add_argument("--draft-input-len", type=int, default=128)
    group.add_argument("--draft-output-len", type=int, default=128)
    group.add_argument("--draft-max-model-len", type=int, default=512)
    group.add_argument(
        "--report-dir", type=report_dir, default=None, help="also write speculative.md/.json here"
    )


def add_seeds_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.set_defaults(dtype="float32")  # the seed's GPT-2 ran in float32
    for action in parser._actions:
        if action.dest == "model":
            action.help = "a preset (dummy weights, default gpt2) or a model folder (its real weights)"
        elif action.dest == "load_format":
            action.help = "default: auto (dummy for a preset name)"
        elif action.dest == "dtype":
            action.help = "default: float32, as the seed"
    group = parser.add_argument_group("seeds")
    group.add_argument(
        "--tables",
        type=table_list,
        default=TABLES,
        help=f"comma-separated, of {', '.join(TABLES)} (default: all)",
    )
    group.add_argument(
        "--preset",
        choices=("auto", *SEED_PRESETS),
        default="auto",
        help="sizes: auto = gpu on CUDA, else cpu",
    )
    group.add_argument("--quick", action="store_true", help="the cpu preset's small sizes, on any device")
    _report_dir_argument(group, "seeds-<model>-<device>")
    add_size_arguments(parser)


BENCHMARK_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "ladder": add_ladder_arguments,
    "latency": add_latency_arguments,
    "throughput": add_throughput_arguments,
    "load-memory": add_load_memory_arguments,
    "serve": add_serve_arguments,
    "kernels": add_kernels_arguments,
    "scenarios": add_scenarios_arguments,
    "structured": add_structured_arguments,
    "speculative": add_speculative_arguments,
    "seeds": add_seeds_arguments,
    "accuracy": add_accuracy_arguments,
    "tensor-parallel": add_tensor_parallel_arguments,
}
