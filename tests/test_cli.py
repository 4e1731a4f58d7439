"""The command line's own behaviour: help reaches each benchmark's options; bad input is one line, exit 2,
answered before torch is imported; every flag describes itself; dummy weights take token ids or a
tokenizer."""

import argparse
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import SRC, run_cli
from engine_helpers import llm_for
from test_tokenizer import build_llama_style_hf_tokenizer
from tokenmill import LLM
from tokenmill.cli import BENCHMARKS, CLI_TEMPERATURE, EXIT_BAD_INPUT, main
from tokenmill.cli_checks import nvidia_driver_present
from tokenmill.config import FLAT_OPTIONS, GROUPS, EngineConfig
from tokenmill.config_flags import add_engine_config_arguments, engine_options_from
from tokenmill.config_help import OPTION_HELP
from tokenmill.loading import DTYPES, load_model
from tokenmill.loading.source import LOAD_FORMATS
from tokenmill.reference import greedy_generate
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

ON_CPU = ["--device", "cpu"]  # commands whose output is compared with a CPU run's


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


# -- flags are checked before torch is imported ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--help"], None),
        (["generate", "--help"], None),
        (["bench", "ladder", "--help"], None),
        (["generate", "hi", "--attention-backend", "triton", "--device", "cpu"], "needs a CUDA device"),
        (["bench", "ladder", "--rungs", "foo"], "invalid choice: 'foo'"),
        (["bench", "scenarios", "--workload", "nope"], "unknown workload 'nope'"),
        (["generate", "hi", "--dtype", "float64"], "--dtype"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--max-model-len", "0"], "max_model_len"),
        (["generate", "hi", "--cpu-kv-cache-gib", "-1"], "cpu_kv_cache_gib"),
        (["generate"], "give a prompt, or --prompt-token-ids"),
        (["generate", "hi", "--prompt-token-ids", "1,x"], "expected token ids"),
        (["generate", "hi", "--model", "llama-3.2-1b", "--load-format", "dummy"], "--tokenizer"),
        (["chat", "--model", "gpt2", "--load-format", "dummy"], "--tokenizer"),
        (["serve", "--request-timeout", "nan"], "--request-timeout must be a number of seconds > 0"),
        (["bench", "latency", "--iters", "0"], "--iters: must be at least 1, got 0"),
        (["bench", "throughput", "--verify-requests", "-1"], "--verify-requests: must be at least 0"),
        (["bench", "throughput", "--repeat", "0"], "--repeat: must be at least 1"),
        (["bench", "throughput", "--report-dir", __file__], "exists and is not a directory"),
        (["bench", "accuracy", "--modes", "int8,bogus"], "unknown mode(s) ['bogus']"),
        (["bench", "accuracy", "--window", "0"], "--window: must be at least 1"),
        (["bench", "ladder", "--batch-size", "0"], "--batch-size: must be at least 1"),
        (["bench", "scenarios", "--timeout", "-1"], "--timeout: must be > 0"),
        (["bench", "serve", "--url", "http://127.0.0.1:9", "--timeout", "nan"], "--timeout: must be > 0"),
        (["generate", "hi", "--num-speculative-tokens", "4"], "left unset without a speculative method"),
    ],
)
def test_help_and_bad_flags_answer_without_importing_torch(argv: list[str], message: str | None) -> None:
    result = run_cli(*argv)
    assert "imported: nothing heavy" in result.stderr, result.stderr
    if message is None:
        assert result.returncode == 0 and result.stdout.startswith("usage: tokenmill")
    else:
        assert result.returncode == EXIT_BAD_INPUT and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "kernels", "--device", "nosuch"],
        ["bench", "load-memory", "--model", "gpt2", "--load-format", "dummy", "--device", "x"],
    ],
)
def test_a_benchmarks_device_is_checked_like_the_engines(argv: list[str]) -> None:
    result = run_cli(*argv)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "is not a valid torch device" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_an_empty_prompt_is_refused_by_name() -> None:
    """ "" is a prompt, an empty one (it was taken for no prompt at all, and crashed)."""
    result = run_cli("generate", "", "--max-tokens", "1")
    assert result.returncode == EXIT_BAD_INPUT and "the prompt is empty" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_triton_without_cuda_is_refused_on_the_auto_device_too() -> None:
    if nvidia_driver_present():
        pytest.skip("this machine has an NVIDIA driver: the device is decided by torch")
    result = run_cli("generate", "hi", "--attention-backend", "triton")
    assert result.returncode == EXIT_BAD_INPUT and "no CUDA device" in result.stderr


# -- help texts ------------------------------------------------------------------------------------------


def test_every_engine_setting_has_a_description_choices_and_its_default() -> None:
    assert set(OPTION_HELP) == set(FLAT_OPTIONS), "each EngineConfig setting needs its help text"
    parser = argparse.ArgumentParser()
    add_engine_config_arguments(parser)
    actions = {action.dest: action for action in parser._actions if action.dest in FLAT_OPTIONS}
    defaults = EngineConfig()
    for name, action in actions.items():
        assert action.help and not action.help.startswith("EngineConfig."), name
        default = defaults.option(name)
        if isinstance(default, bool):
            assert f"default: {'on' if default else 'off'}" in action.help, name
        elif default is not None:
            assert f"default: {default}" in action.help, name
    assert actions["attention_backend"].choices == ("auto", "torch", "triton", "cpu")
    assert "choices: auto, torch, triton, cpu; default: auto" in str(actions["attention_backend"].help)
    assert actions["dtype"].choices == ("auto", *DTYPES)
    assert actions["load_format"].choices == LOAD_FORMATS


def test_sampling_flags_describe_themselves_and_their_defaults(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    usage = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag, default in [
        ("--max-tokens", "256"),
        ("--temperature", "0.7"),
        ("--top-p", "1.0"),
        ("--top-k", "0"),
        ("--min-p", "0"),
        ("--repetition-penalty", "1.0"),
        ("--presence-penalty", "0"),
        ("--frequency-penalty", "0"),
        ("--seed", "none"),
        ("--stop", "none"),
    ]:
        described = usage.split(f"{flag} {flag.lstrip('-').replace('-', '_').upper()}")[-1][:300]
        assert f"(default: {default}" in described or f"default: {default}" in described, flag
    assert "default to 1.0" in usage  # why the command line's temperature differs from SamplingParams'
    assert SamplingParams().temperature == 1.0 and CLI_TEMPERATURE == 0.7


# -- prompt token ids and --tokenizer on dummy weights ----------------------------------------------------


def test_prompt_token_ids_on_dummy_weights_print_the_reference_greedy_ids(
    tiny_llama_folder: Path, capsys: Any
) -> None:
    config_json = str(tiny_llama_folder / "config.json")
    # On the CPU, where the command runs in float32 as the reference greedy loop below does (a GPU's
    # bfloat16 would flip the near-ties of random weights): these are the command's ids, not a device's.
    argv = ["generate", "--model", config_json, "--load-format", "dummy", "--temperature", "0", *ON_CPU]
    assert main([*argv, "--prompt-token-ids", "5,17,42", "--max-tokens", "6", "--ignore-eos"]) == 0
    printed = [int(token) for token in capsys.readouterr().out.split()]
    loaded = load_model(config_json, load_format="dummy")
    assert printed == greedy_generate(loaded.model, [5, 17, 42], 6).token_ids


@pytest.fixture(scope="module")
def tiny_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder (no weights) whose vocabulary fits the tiny models' 384 ids."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_llama_style_hf_tokenizer().save_pretrained(folder)
    return folder


def test_a_dummy_model_takes_the_named_tokenizer(
    tiny_llama_folder: Path, tiny_tokenizer_folder: Path, capsys: Any
) -> None:
    """--tokenizer gives dummy weights text in and out: the prompt is encoded by that tokenizer, the tokens
    are the reference greedy ones for those ids, and the command prints their text as LLM.generate has it."""
    config_json = str(tiny_llama_folder / "config.json")
    common = ["--model", config_json, "--load-format", "dummy", "--temperature", "0", "--max-tokens", "5"]
    common += ["--ignore-eos", "--tokenizer", str(tiny_tokenizer_folder), *ON_CPU]  # as the test above
    assert main(["generate", "Hello world", *common]) == 0
    printed = capsys.readouterr().out.removesuffix("\n")
    llm = LLM(config_json, load_format="dummy", tokenizer=str(tiny_tokenizer_folder), device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    output = llm.generate("Hello world", greedy)[0]
    prompt_ids = Tokenizer.from_pretrained(tiny_tokenizer_folder).encode("Hello world")
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == greedy_generate(llm.engine.loaded.model, prompt_ids, 5).token_ids
    assert printed == output.outputs[0].text


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny_llama_folder: Path, capsys: Any) -> None:
    config_json = str(tiny_llama_folder / "config.json")
    argv = ["generate", "Hi", "--model", config_json, "--load-format", "dummy", "--tokenizer", "smollm2"]
    code = main(argv)
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "49152 tokens" in err and "vocabulary of 384" in err


# -- chat with piped input ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_with_piped_input_prints_the_replies_alone(smollm2: Any) -> None:
    """No ``you>`` / ``assistant>`` prompts and no banner when stdin is not a terminal: stdout is exactly
    the two greedy replies, each as the offline API gives it for the conversation so far."""
    questions = ["What is the capital of France?", "And of Italy?"]
    result = _piped_chat(questions, "--temperature", "0", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "tokenmill chat:" not in result.stderr
    llm = llm_for(smollm2, max_num_seqs=1)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    history: list[dict[str, str]] = []
    expected = ""
    for question in questions:
        history.append({"role": "user", "content": question})
        reply = llm.chat(history, greedy)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        expected += reply + "\n"
    assert result.stdout == expected


@pytest.mark.slow
def test_a_chat_turn_that_fails_is_reported_and_the_session_goes_on(smollm2: Any) -> None:
    """A conversation that outgrows the context fails that turn, with a hint to /reset, and the next
    lines are still read: after /reset the conversation starts again and is answered."""
    lines = ["Tell me about Paris.", "And about London?", "And Rome?", "/reset", "Hi!"]
    result = _piped_chat(lines, "--temperature", "0", "--max-tokens", "30", "--max-model-len", "128")
    assert result.returncode == 0, result.stderr
    failures = [line for line in result.stderr.splitlines() if "beyond the context limit" in line]
    assert failures and all("/reset" in line for line in failures), result.stderr
    replies = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(replies) == 5 - len(failures) - 1, result.stdout  # every turn but the failed ones and /reset
    llm = llm_for(smollm2, max_num_seqs=1, max_model_len=128)
    fresh = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0, max_tokens=30))
    assert replies[-1] == fresh[0].outputs[0].text.strip()


def _piped_chat(lines: list[str], *flags: str) -> subprocess.CompletedProcess[str]:
    """``tokenmill chat FLAGS`` with ``lines`` piped into it (stdin not a terminal), on the CPU, as the
    offline API over conftest's CPU load that the replies are compared with."""
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "chat", *ON_CPU, *flags],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=600,
    )
