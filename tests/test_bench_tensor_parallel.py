"""`tokenmill bench tensor-parallel` without GPUs: its flags, its comparison of greedy tokens, and the
fresh process each engine runs in (a result comes back; a failure is an error at once, not a wait)."""

import argparse
import time
from collections.abc import Callable

import pytest

from tokenmill.benchmarks.tensor_parallel.arguments import add_tensor_parallel_arguments
from tokenmill.benchmarks.tensor_parallel.command import _first_divergence
from tokenmill.benchmarks.tensor_parallel.engines import in_fresh_process


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_tensor_parallel_arguments(parser)
    return parser.parse_args(list(argv))


def test_sizes_always_include_one_and_sections_are_checked() -> None:
    assert _parse("--sizes", "4,2").sizes == [1, 2, 4]
    assert _parse("--sections", "latency,all-reduce").sections == ["latency", "all-reduce"]
    with pytest.raises(argparse.ArgumentError, match="unknown section"):
        _parse("--sections", "latency,speed")
    with pytest.raises(argparse.ArgumentError, match="at least 1"):
        _parse("--sizes", "0,2")


def test_the_first_divergence_names_the_prompt_and_the_token() -> None:
    reference = [[1, 2, 3], [4, 5, 6]]
    assert _first_divergence([[1, 2, 3], [4, 5, 6]], reference) == "none"
    assert _first_divergence([[1, 2, 3], [4, 9, 6]], reference) == "prompt 1, token 1: 9 vs 5"


def _double(value: int, send: Callable[[int], None]) -> None:
    send(2 * value)


def _fail(value: int, send: Callable[[int], None]) -> None:
    raise ValueError(f"no engine for {value}")


def test_a_fresh_process_sends_its_result_or_fails_at_once() -> None:
    assert in_fresh_process(_double, 21) == 42
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"_fail failed after \d+ s \(exit code 1"):
        in_fresh_process(_fail, 1, timeout_s=120)
    assert time.perf_counter() - started < 60  # not the whole timeout
