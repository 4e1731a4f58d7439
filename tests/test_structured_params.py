"""StructuredOutputsParams: exactly one constraint, checked types, and the spec the backends compile; the
token bitmask applied to logits, in PyTorch and in the Triton kernel (on the GPU, or in the interpreter
on the CPU), against a plain loop."""

import json
import math

import pytest
import torch

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.config import EngineConfig
from tokenmill.structured.bitmask import apply_by_shifts, apply_token_bitmask
from tokenmill.structured.params import ANY_JSON_OBJECT, GrammarSpec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_each_constraint_becomes_its_spec() -> None:
    spec = StructuredOutputsParams(json=SCHEMA).spec()
    assert spec == GrammarSpec("json", json.dumps(SCHEMA))
    assert list(json.loads(spec.source)["properties"]) == ["b", "a"]  # property order kept
    assert spec.field == "structured_outputs.json"
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).spec() == spec
    assert StructuredOutputsParams(json=True).spec().source == ANY_JSON_OBJECT
    any_object = StructuredOutputsParams(json_object=True).spec()
    assert any_object.source == ANY_JSON_OBJECT and any_object.field == "structured_outputs.json_object"
    assert StructuredOutputsParams(regex="[0-9]+").spec() == GrammarSpec("regex", "[0-9]+")
    choice = StructuredOutputsParams(choice=["yes", "no"]).spec("guided_choice")
    assert choice.choices == ["yes", "no"] and choice.field == "guided_choice"
    assert StructuredOutputsParams(grammar="start: /a+/").spec().kind == "grammar"
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).spec()
    assert not compact.any_whitespace and compact != spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"json": SCHEMA, "regex": "a"}, "got json, regex"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": "yes"}, "structured_outputs.choice must be a list of strings"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema object"),
        ({"json": "3"}, "structured_outputs.json must be a JSON schema object"),
        ({"json_object": True, "disable_any_whitespace": "no"}, "disable_any_whitespace must be a bool"),
    ],
)
def test_bad_constraints_name_their_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**fields)  # type: ignore[arg-type]


def test_sampling_params_take_structured_outputs() -> None:
    constraint = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=constraint).structured_outputs is constraint
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"choice": ["a"]})  # type: ignore[arg-type]


def test_the_backend_is_an_engine_option() -> None:
    assert EngineConfig().structured_output_backend == "llguidance"
    assert (
        EngineConfig().with_options(structured_output_backend="xgrammar").structured_output_backend
        == "xgrammar"
    )
    with pytest.raises(ValueError, match=r"EngineConfig.structured_output_backend must be one of"):
        EngineConfig().with_options(structured_output_backend="outlines")


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (rows, -(-vocab // 32)), generator=generator, dtype=torch.int64)
    words[0] = -1  # a row that allows everything
    return words.to(torch.int32)


def _masked_by_loop(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    expected = logits.clone()
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = -math.inf
    return expected


@pytest.mark.parametrize("vocab", [32, 100, 257])
def test_bitmask_masks_exactly_the_clear_bits(vocab: int) -> None:
    logits = torch.randn(3, vocab)
    bitmask = _random_bitmask(3, vocab, seed=vocab)
    expected = _masked_by_loop(logits, bitmask)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked, expected)
    assert torch.equal(apply_by_shifts(logits, bitmask), expected)  # the path of non-CPU devices
    assert torch.equal(masked[0], logits[0])  # the all-ones row is untouched
    assert masked.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize("vocab", [100, 5000])
def test_the_triton_bitmask_kernel_matches_pytorch(vocab: int) -> None:
    pytest.importorskip("triton")
    from tokenmill.kernels import interpreter_enabled, triton_available

    if not triton_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from tokenmill.kernels.token_bitmask import apply_token_bitmask as triton_apply

    device = "cpu" if interpreter_enabled() else "cuda"  # compiled kernels read GPU memory only
    logits = torch.randn(4, vocab, device=device)
    bitmask = _random_bitmask(6, vocab, seed=vocab).to(device)  # more rows than logits: the first 4 are used
    assert torch.equal(triton_apply(logits, bitmask), apply_token_bitmask(logits, bitmask))
    with pytest.raises(ValueError, match="cannot mask"):
        triton_apply(logits, bitmask[:, :2])
