"""The command line's own behaviour: help reaches each benchmark's options; bad input is one line, exit 2."""

import argparse
from dataclasses import fields
from typing import Any

import pytest

from tokenmill.cli import BENCHMARKS, EXIT_BAD_INPUT, main
from tokenmill.config import FLAT_OPTIONS, GROUPS, EngineConfig
from tokenmill.config_flags import add_engine_config_arguments, engine_options_from


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help_lists_the_benchmarks_own_options(name: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: tokenmill bench {name}")
    assert usage.count("--") > 2, usage  # the benchmark's flags, not only -h


def test_an_unknown_flag_value_is_one_line_and_exit_2(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--kv-cache", "bogus"])
    assert exit_info.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--kv-cache" in err and "Traceback" not in err


def test_every_engine_config_field_is_a_flag_and_round_trips() -> None:
    parser = argparse.ArgumentParser()
    add_engine_config_arguments(parser)
    flags = {action.dest for action in parser._actions}
    settings = [f.name for f in fields(EngineConfig) if f.name not in GROUPS]
    settings += [f"{group}.{f.name}" for group, cls in GROUPS.items() for f in fields(cls)]
    assert len(FLAT_OPTIONS) == len(settings), "every setting of every group has one flat name"
    assert set(FLAT_OPTIONS) <= flags
    args = parser.parse_args(
        ["--prefix-caching", "--max-num-seqs", "3", "--scheduling-policy", "priority", "--no-debug-checks"]
    )
    options = engine_options_from(args)
    assert options == {
        "prefix_caching": True,
        "max_num_seqs": 3,
        "scheduling_policy": "priority",
        "debug_checks": False,
    }
    config = EngineConfig().with_options(**options)
    assert (config.kv.prefix_caching, config.scheduler.max_num_seqs, config.scheduler.policy) == (
        True,
        3,
        "priority",
    )
    assert config.options()["scheduling_policy"] == "priority"


def test_a_bad_engine_flag_value_is_refused_by_the_parser(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--scheduling-policy", "lifo"])
    assert exit_info.value.code == EXIT_BAD_INPUT
    assert "--scheduling-policy" in capsys.readouterr().err
