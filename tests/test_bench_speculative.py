"""``tokenmill bench speculative``: the draft-model costing on tiny models (the n-gram part needs a chat
template, which the real-model run in reports/ covers), and the tokens-per-round formula."""

import random
import re
from pathlib import Path

import pytest

from tiny_models import save_tiny_model
from tokenmill.benchmarks.speculative import command
from tokenmill.benchmarks.speculative.draft_cost import tokens_per_round
from tokenmill.benchmarks.speculative.timing import TimedRun
from tokenmill.outputs import SpecDecodeCounts


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.9, 1.0])
def test_tokens_per_round_matches_a_simulation(acceptance: float) -> None:
    rng = random.Random(0)
    k, rounds = 4, 40000
    total = 0
    for _ in range(rounds):
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        total += accepted + 1  # the accepted guesses and the model's own token
    assert tokens_per_round(acceptance, k) == pytest.approx(total / rounds, rel=0.02)


def test_draft_costing_reports_round_costs_and_the_self_draft_check(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    save_tiny_model("llama3", tmp_path / "target")
    save_tiny_model("qwen2", tmp_path / "draft", seed=1)
    args = ["--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"), "--skip-ngram"]
    args += [
        "--device",
        "cpu",
        "--draft-num-prompts",
        "1",
        "--draft-input-len",
        "16",
        "--draft-output-len",
        "12",
    ]
    assert command.main([*args, "--report-dir", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "speculative.md").read_text()
    assert (
        report.startswith("- commit: ")
        and "draft /" in report
        and "peer: the target's plain decode" in report
    )
    for row in ("t_plain", "t_draft_step", "t_verify", "round, measured", "| 0.5 ", "| 0.9 "):
        assert row in report, row
    assert "self-draft check: acceptance 1.00 (5.00 tokens per round)" in report  # k = 4, all accepted
    assert "self-draft:" in capsys.readouterr().out


def test_bad_speculative_config_flag_fails_before_loading(capsys) -> None:  # type: ignore[no-untyped-def]
    from tokenmill import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "speculative", "--speculative-config", '{"method": "ngram", "k": 2}'])
    assert exit_info.value.code == 2
    assert "unknown key(s) ['k']" in capsys.readouterr().err


def test_ngram_in_bfloat16_checks_a_float32_copy_first(
    smollm2_gguf_path: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A 16-bit run may flip near-ties between a decode step and a verification step, so exactness is
    checked on a float32 copy of the model, and the 16-bit agreement is reported, not required. (One
    prompt of each workload, the code-editing one cut to its first 400 characters: bfloat16 on the CPU is
    slow.)"""
    monkeypatch.setattr(command.prompts, "CODE_EDITING", [command.prompts.CODE_EDITING[0][:400]])
    monkeypatch.setattr(command.prompts, "COPY_MIX", command.prompts.COPY_MIX[:1])
    args = ["--model", str(smollm2_gguf_path), "--dtype", "bfloat16", "--max-tokens", "4", "--no-progress"]
    args += ["--batch-size", "2", "--batch-output-len", "4", "--batch-rounds", "1"]
    args += ["--report-dir", str(tmp_path)]
    assert command.main(args) == 0
    out = capsys.readouterr().out
    total = len(command.prompts.CODE_EDITING)
    assert f"float32 check: greedy tokens off / on identical for {total}/{total} prompts" in out
    report = (tmp_path / "speculative.md").read_text()
    assert "bfloat16, 134.5 M parameters" in report or "134.5 M parameters, bfloat16" in report
    assert (
        "- correctness: float32 copy: greedy tokens off and on identical for the code-editing prompts"
        in report
    )
    assert "prompts whose tokens off and on agree: code editing " in report
    assert "run 2 times each, off-on-on-off x 1" in report
    assert re.search(r"- open-ended on / off, each off-on-on-off round apart: \d+\.\d\dx\n", report)


def test_each_round_of_the_open_ended_batch_gets_its_own_ratio() -> None:
    """Rounds run off, on, on, off; a round's ratio is its two on runs' tokens over their time, against
    its two off runs'."""

    def run(tokens: int, seconds: float) -> TimedRun:
        return TimedRun("x", [[0] * tokens], tokens, seconds, 1, seconds, SpecDecodeCounts())

    batches = {
        "off": [run(100, 1.0), run(100, 1.0), run(100, 2.0), run(100, 2.0)],
        "on": [run(100, 0.5), run(100, 1.5), run(300, 2.0), run(100, 2.0)],
    }
    assert command.round_ratios(batches) == pytest.approx([1.0, 2.0])
