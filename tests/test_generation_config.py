"""The model's ``generation_config.json`` as default sampling parameters, as vLLM takes it: the offline API
(``LLM.get_default_sampling_params``, ``generate`` / ``chat`` without params), the options that choose the
source (``generation_config``: auto / vllm / a folder; ``override_generation_config``), their checks, and
the command line. The file's values are the ones written here; outputs are held to the same engine's run
with those values passed explicitly, and to a run without them (which must differ, or the check would
prove nothing). The server's side: tests/test_server_generation_config.py."""

import logging
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from engine_helpers import llm_for, run_to_completion
from generation_config_files import FROM_FILE, PLAIN_GREEDY, write_generation_config
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import ModelLoadError
from tokenmill.loading import LoadedModel, load_model

PROMPT = "once upon a time"
CHAT = [{"role": "user", "content": "tell me a story"}]
OPTIONS: dict[str, Any] = {"max_model_len": 128}


@pytest.fixture(scope="module")
def llm(genconfig_model: LoadedModel) -> LLM:
    return llm_for(genconfig_model, **OPTIONS)


def token_ids(llm: LLM, params: SamplingParams | None = None, prompt: str = PROMPT) -> list[int]:
    return list(llm.generate(prompt, params)[0].outputs[0].token_ids)


def test_the_defaults_are_the_files_sampling_fields(llm: LLM) -> None:
    assert llm.get_default_sampling_params() == FROM_FILE


def test_generate_and_chat_without_params_use_the_defaults(llm: LLM) -> None:
    defaults = token_ids(llm)
    assert len(defaults) == 8  # max_new_tokens
    assert defaults == token_ids(llm, FROM_FILE)
    assert defaults != token_ids(llm, PLAIN_GREEDY), "the penalty should change these greedy tokens"
    chatted = llm.chat(CHAT)[0].outputs[0].token_ids
    assert chatted == llm.chat(CHAT, FROM_FILE)[0].outputs[0].token_ids
    assert len(chatted) == 8


def engine_token_ids(llm: LLM, params: SamplingParams, prompt: str | list[int] = PROMPT) -> list[int]:
    """The engine's tokens for ``params`` as they are (no ``LLM.generate`` between)."""
    outputs = run_to_completion(llm.engine, {"r": (prompt, params)})  # type: ignore[dict-item]
    return list(outputs["r"].outputs[0].token_ids)


def test_explicit_params_are_used_as_they_are(llm: LLM) -> None:
    assert token_ids(llm, PLAIN_GREEDY) == engine_token_ids(llm, PLAIN_GREEDY)
    assert token_ids(llm, PLAIN_GREEDY) != token_ids(llm, FROM_FILE), "the defaults would change them"
    outputs = llm.generate([PROMPT, "hello there"], [PLAIN_GREEDY, PLAIN_GREEDY])
    assert [output.outputs[0].token_ids for output in outputs] == [
        engine_token_ids(llm, PLAIN_GREEDY),
        engine_token_ids(llm, PLAIN_GREEDY, "hello there"),
    ]
    chatted = llm.chat(CHAT, PLAIN_GREEDY)[0].outputs[0].token_ids
    template = llm.get_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert chatted == engine_token_ids(llm, PLAIN_GREEDY, template)


def test_vllm_turns_the_defaults_off(genconfig_model: LoadedModel) -> None:
    llm = llm_for(genconfig_model, generation_config="vllm", **OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert len(token_ids(llm)) == SamplingParams().max_tokens


def test_the_override_wins_over_the_file(genconfig_model: LoadedModel) -> None:
    override = {"max_new_tokens": 3, "repetition_penalty": None, "top_k": 2}
    llm = llm_for(genconfig_model, override_generation_config=override, **OPTIONS)
    expected = SamplingParams(temperature=0.0, top_p=0.9, top_k=2, min_p=0.05, max_tokens=3)
    assert llm.get_default_sampling_params() == expected
    assert token_ids(llm) == token_ids(llm, PLAIN_GREEDY)[:3]
    alone = llm_for(
        genconfig_model, generation_config="vllm", override_generation_config={"temperature": 0}, **OPTIONS
    )
    assert alone.get_default_sampling_params() == SamplingParams(temperature=0)


def test_a_folder_names_another_generation_config(genconfig_model: LoadedModel, tmp_path: Path) -> None:
    other = write_generation_config(tmp_path / "other", {"temperature": 0.5, "top_k": 3, "max_length": 9})
    llm = llm_for(genconfig_model, generation_config=str(other), **OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.5, top_k=3)


def test_the_defaults_are_logged_at_start(
    genconfig_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.generation_config"):
        llm_for(genconfig_model, **OPTIONS)
    assert "default sampling parameters" in caplog.text and "'repetition_penalty': 1.5" in caplog.text


def test_dummy_weights_and_gguf_files_have_no_generation_config(genconfig_folder: Path) -> None:
    from tokenmill.loading.default_model import default_model_path
    from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint

    assert load_model(genconfig_folder, load_format="dummy").generation_config == {}  # beside its config.json
    assert GGUFCheckpoint(default_model_path()).generation_config() == {}


# -- checks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"generation_config": "hf"},
            r"generation_config must be 'auto', 'vllm' or a folder .*no such folder",
        ),
        ({"generation_config": 1}, "generation_config must be a string, got 1"),
        ({"override_generation_config": [1]}, "override_generation_config must be a dict or None"),
        (
            {"override_generation_config": {"max_tokens": 4}},
            "keyed by max_new_tokens, min_p, .*got 'max_tokens'",
        ),
        ({"override_generation_config": {"top_k": 1.5}}, r"\['top_k'\] must be an integer.*got 1.5"),
        ({"override_generation_config": {"top_p": 0}}, r"\['top_p'\] must be a number in \(0, 1\]"),
        (
            {"override_generation_config": {"temperature": -1}},
            r"\['temperature'\] must be a finite number >= 0",
        ),
        ({"override_generation_config": {"temperature": True}}, r"\['temperature'\] must be"),
        ({"override_generation_config": {"min_p": 2.0}}, r"\['min_p'\] must be a number in \[0, 1\]"),
        ({"override_generation_config": {"repetition_penalty": 0}}, r"\['repetition_penalty'\] must be"),
        (
            {"override_generation_config": {"max_new_tokens": 0}},
            r"\['max_new_tokens'\] must be an integer >= 1",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig().with_options(**options)


def test_a_folder_without_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"generation_config must be .* has no generation_config\.json"):
        EngineConfig(generation_config=str(tmp_path))


def test_a_bad_value_in_the_file_is_refused_at_start(genconfig_model: LoadedModel, tmp_path: Path) -> None:
    bad = write_generation_config(tmp_path / "bad", {"top_p": 1.5})
    with pytest.raises(
        ModelLoadError, match=r"bad/generation_config.json: top_p must be a number in \(0, 1\]"
    ):
        llm_for(genconfig_model, generation_config=str(bad), **OPTIONS)
    fixed = llm_for(
        genconfig_model, generation_config=str(bad), override_generation_config={"top_p": 0.5}, **OPTIONS
    )
    assert fixed.get_default_sampling_params() == SamplingParams(top_p=0.5)


# -- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--override-generation-config", '{"top_q": 1}'], "keyed by max_new_tokens"),
        (["--override-generation-config", "{nope"], "--override-generation-config: not valid JSON"),
        (["--generation-config", "/no/such/folder"], "no such folder"),
    ],
)
def test_bad_flags_are_refused_before_loading(flags: list[str], message: str) -> None:
    result = run_cli("generate", "hi", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "imported: nothing heavy" in result.stderr


def test_generate_takes_the_defaults_for_the_flags_left_out(llm: LLM, genconfig_folder: Path) -> None:
    result = run_cli(
        "generate", PROMPT, "--model", str(genconfig_folder), "--device", "cpu", "--max-model-len", "128"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == llm.generate(PROMPT, FROM_FILE)[0].outputs[0].text + "\n"
    given = run_cli(
        "generate",
        PROMPT,
        "--model",
        str(genconfig_folder),
        "--device",
        "cpu",
        "--max-tokens",
        "3",
        "--repetition-penalty",
        "1",
    )
    assert given.returncode == 0, given.stderr
    three_greedy = SamplingParams(temperature=0.0, max_tokens=3)
    assert given.stdout == llm.generate(PROMPT, three_greedy)[0].outputs[0].text + "\n"
