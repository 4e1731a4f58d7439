"""The README's examples run as printed: the offline API, whose chat answer is complete (it stops on its
own, not at the token budget), and the dummy-weight lines of the command line."""

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import EXIT_BAD_INPUT, main
from tokenmill.cli_checks import nvidia_driver_present

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.slow
def test_the_offline_example_runs_and_its_chat_answer_is_complete(capsys: Any) -> None:
    example = next(block for block in readme_python_blocks() if "LLM()" in block)
    namespace: dict[str, Any] = {}
    exec(compile(example, str(README), "exec"), namespace)
    answer = namespace["answer"]
    assert answer.finish_reason == "stop" and answer.text.strip()
    completion = namespace["outputs"][0].outputs[0]
    assert len(completion.token_ids) == 64 or completion.finish_reason == "stop"
    assert namespace["outputs"][1].prompt_token_ids == [1, 2, 3]
    printed = capsys.readouterr().out
    assert completion.text in printed and answer.text in printed


def readme_command(prefix: str) -> list[str]:
    """The README's shell line that starts with ``prefix``, as argv (its trailing comment dropped)."""
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            if line.startswith(prefix):
                return shlex.split(line, comments=True)
    raise AssertionError(f"the README has no line starting with {prefix!r}")


@pytest.mark.slow
def test_the_dummy_weights_example_generates_text(capsys: Any) -> None:
    argv = readme_command('tokenmill generate "Hello" --model smollm2-135m --load-format dummy')
    assert "--tokenizer" in argv
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.strip()  # text: the dummy model's random tokens, decoded


def test_the_dummy_weights_example_on_cuda_needs_no_tokenizer(capsys: Any) -> None:
    """The README's token-id line is refused here only for want of a GPU, before anything is loaded."""
    argv = readme_command("tokenmill generate --prompt-token-ids")
    if nvidia_driver_present():
        pytest.skip("runs the 1B model on the GPU: the latency benchmark's business, not a test's")
    assert main(argv[1:]) == EXIT_BAD_INPUT
    assert "no NVIDIA driver" in capsys.readouterr().err
