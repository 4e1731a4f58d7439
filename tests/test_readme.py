"""The README's Python example runs as printed and its chat answer is complete (it stops on its own,
not at the token budget)."""

import re
from pathlib import Path
from typing import Any

import pytest

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
