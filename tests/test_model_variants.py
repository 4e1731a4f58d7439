"""Config options that real checkpoints use, one tiny random model each, against transformers (float32, CPU).

transformers loads each saved folder itself (``from_pretrained``, so a config in transformers 4's dialect is
read as transformers reads it) and gives the logits of the whole sequence in one forward pass; tokenmill
runs the prompt as one prefill and the rest as decode steps over its KV cache. Sequences run past the
original context of the rope scalings (16 positions) and the sliding windows (8).
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine_helpers import llm_for
from tiny_models import save_random_model
from tokenmill.errors import ModelLoadError
from tokenmill.loading import load_model
from tokenmill.reference import SingleSequenceRunner
from tokenmill.sampling_params import SamplingParams

TOLERANCE = 1e-4
PROMPT, DECODE = 20, 12
ORIGINAL_CONTEXT = 16  # the rope scalings' pretraining context: positions from 16 on are extended
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,  # the original context x 4
}
GEMMA: dict[str, Any] = {**COMMON, "head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24}
GPT2: dict[str, Any] = {
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 3,
    "n_head": 4,
    "n_positions": 64,
    "eos_token_id": 2,
}
Rewrite = Callable[[dict[str, Any]], None]


def rope(rope_type: str, theta: float = 10000.0, **params: Any) -> dict[str, Any]:
    return {"rope_type": rope_type, "rope_theta": theta, **params}


def yarn(**params: Any) -> dict[str, Any]:
    return rope("yarn", **{"factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT, **params})


def old_dialect(scaling: dict[str, Any] | None, theta: float | None) -> Rewrite:
    """transformers 4's config: ``rope_scaling`` (None: no scaling) and ``rope_theta`` beside it."""

    def rewrite(config: dict[str, Any]) -> None:
        config.pop("rope_parameters")
        config["rope_scaling"] = scaling
        if theta is not None:
            config["rope_theta"] = theta

    return rewrite


def edit(**fields: Any) -> Rewrite:
    """Set (or, with None, remove) top-level fields of config.json."""

    def rewrite(config: dict[str, Any]) -> None:
        for key, value in fields.items():
            config.pop(key) if value is None else config.__setitem__(key, value)

    return rewrite


def rope_edit(**fields: Any) -> Rewrite:
    def rewrite(config: dict[str, Any]) -> None:
        for key, value in fields.items():
            config["rope_parameters"].pop(key) if value is None else config["rope_parameters"].__setitem__(
                key, value
            )

    return rewrite


def no_change(config: dict[str, Any]) -> None:
    pass


OLD_GEMMA = edit(rope_parameters=None, layer_types=None, sliding_window_pattern=2)
CASES: dict[str, tuple[PretrainedConfig, Rewrite]] = {
    # the MLP's activation
    "llama-gelu-tanh": (LlamaConfig(**COMMON, hidden_act="gelu_pytorch_tanh"), no_change),
    "qwen2-gelu-new": (Qwen2Config(**COMMON, hidden_act="gelu_new"), no_change),
    "gemma3-silu": (Gemma3TextConfig(**GEMMA, hidden_activation="silu"), no_change),
    # rope scalings, in both config dialects
    "llama-yarn": (LlamaConfig(**COMMON, rope_parameters=yarn()), no_change),
    "qwen2-yarn-transformers4": (
        Qwen2Config(**COMMON),
        old_dialect({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 1e6),
    ),
    "qwen3-yarn-band-and-mscale": (
        Qwen3Config(
            **COMMON,
            head_dim=32,
            rope_parameters=yarn(beta_fast=16, beta_slow=2, mscale=0.8, mscale_all_dim=0.6),
        ),
        no_change,
    ),
    "llama-yarn-attention-factor-untruncated": (
        LlamaConfig(**COMMON, rope_parameters=yarn(attention_factor=1.5, truncate=False)),
        no_change,
    ),
    "llama-yarn-top-level-original-context": (
        LlamaConfig(**COMMON, rope_parameters=yarn(original_max_position_embeddings=32)),
        edit(original_max_position_embeddings=ORIGINAL_CONTEXT),
    ),
    "gemma3-yarn-global-layers": (
        Gemma3TextConfig(
            **GEMMA, rope_parameters={"full_attention": yarn(), "sliding_attention": rope("default")}
        ),
        no_change,
    ),
    "llama-dynamic": (LlamaConfig(**COMMON, rope_parameters=rope("dynamic", factor=4.0)), no_change),
    "llama3-original-context-defaults-to-max-positions": (
        LlamaConfig(**{**COMMON, "max_position_embeddings": 40}),
        old_dialect(
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 5e5
        ),
    ),
    "llama-linear-theta-beside-rope-parameters": (
        LlamaConfig(**COMMON, rope_parameters=rope("linear", theta=1234.0, factor=3.0)),
        lambda config: config.update(rope_theta=config["rope_parameters"].pop("rope_theta")),
    ),
    "gemma3-transformers4-default-thetas": (Gemma3TextConfig(**GEMMA), OLD_GEMMA),
    # attention: biases, sliding windows, heads
    "qwen2-biases-whatever-attention-bias-says": (
        Qwen2Config(**COMMON),
        edit(attention_bias=False, mlp_bias=True),
    ),
    "qwen2-sliding-from-28th-layer-by-default": (
        Qwen2Config(**{**COMMON, "num_hidden_layers": 29, "hidden_size": 32, "intermediate_size": 32}),
        edit(use_sliding_window=True, sliding_window=8, layer_types=None, max_window_layers=None),
    ),
    "qwen3-sliding-above-max-window-layers": (
        Qwen3Config(**COMMON, head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        no_change,
    ),
    "llama-ignores-sliding-layer-types": (
        LlamaConfig(**COMMON),
        edit(sliding_window=8, layer_types=["sliding_attention"] * 2),
    ),
    "mistral-layer-types-as-ministral": (
        MistralConfig(**COMMON, sliding_window=8),
        edit(layer_types=["sliding_attention", "full_attention"]),
    ),
    "llama-multi-query": (LlamaConfig(**{**COMMON, "num_key_value_heads": 1}), no_change),
    # heads and weights
    "gemma3-untied-head": (Gemma3TextConfig(**GEMMA, tie_word_embeddings=False), no_change),
    "gemma3-final-logit-softcapping": (Gemma3TextConfig(**GEMMA, final_logit_softcapping=2.0), no_change),
    "qwen2-tied-head-and-norm-eps": (
        Qwen2Config(**COMMON, tie_word_embeddings=True, rms_norm_eps=1e-2),
        no_change,
    ),
    "gpt2-untied-head-and-inner-size": (GPT2Config(**GPT2, tie_word_embeddings=False, n_inner=96), no_change),
    "gpt2-scale-by-inverse-layer-index": (
        GPT2Config(**GPT2, scale_attn_by_inverse_layer_idx=True),
        no_change,
    ),
}


def save_variant(
    config: PretrainedConfig, rewrite: Rewrite, folder: Path, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """Save a random model of ``config`` in ``dtype``, rewrite its config.json, and return transformers' own
    float32 load of the folder."""
    save_random_model(config, folder, dtype=dtype)
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text())
    rewrite(raw)
    config_file.write_text(json.dumps(raw))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def sequence(vocab_size: int) -> list[int]:
    return torch.randint(
        0, vocab_size, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(1)
    ).tolist()


def assert_logits_match(reference: torch.nn.Module, folder: Path) -> None:
    """Every position's logits: the prompt's from one prefill, the rest's from decode steps."""
    ids = sequence(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    runner = SingleSequenceRunner(load_model(folder, dtype="float32").model, len(ids))
    steps = [runner.forward_all(ids[:PROMPT])] + [runner.forward_all([token]) for token in ids[PROMPT:]]
    torch.testing.assert_close(torch.cat(steps), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_matches_transformers(case: str, tmp_path: Path) -> None:
    config, rewrite = CASES[case]
    assert_logits_match(save_variant(config, rewrite, tmp_path), tmp_path)


def test_bfloat16_checkpoint_loads_as_float32(tmp_path: Path) -> None:
    reference = save_variant(Qwen3Config(**COMMON, head_dim=32), no_change, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert_logits_match(reference, tmp_path)


@pytest.mark.parametrize("case", ["qwen3-yarn-band-and-mscale", "llama-gelu-tanh"])
def test_engine_greedy_logprobs_match_transformers(case: str, tmp_path: Path) -> None:
    """Through the engine (its CPU attention and decode paths): greedy tokens and their logprobs."""
    config, rewrite = CASES[case]
    reference = save_variant(config, rewrite, tmp_path)
    prompt = sequence(config.vocab_size)[:PROMPT]
    params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True, logprobs=0)
    output = llm_for(load_model(tmp_path, dtype="float32")).generate([{"prompt_token_ids": prompt}], params)[
        0
    ]
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(DECODE):
            step = reference(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            tokens.append(int(step.argmax()))
            logprobs.append(float(step.max()))
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens[PROMPT:]
    assert completion.sampled_logprobs is not None
    assert [entry.logprob for entry in completion.sampled_logprobs] == pytest.approx(logprobs, abs=TOLERANCE)


def test_yarn_serves_its_scaled_context(tmp_path: Path) -> None:
    """Qwen's yarn configs keep max_position_embeddings at the original context: the scaled one is served
    (original x factor, as vLLM derives it)."""
    original, factor = 64, 4.0
    config = Qwen2Config(
        **{**COMMON, "max_position_embeddings": original},
        rope_parameters=yarn(factor=factor, original_max_position_embeddings=original),
    )
    save_variant(config, no_change, tmp_path)
    assert load_model(tmp_path, dtype="float32").config.max_position_embeddings == int(original * factor)


REFUSED: dict[str, tuple[PretrainedConfig, Rewrite, str]] = {
    "partial rotary": (
        LlamaConfig(**COMMON),
        rope_edit(partial_rotary_factor=0.5),
        "partial_rotary_factor 0.5",
    ),
    "longrope": (LlamaConfig(**COMMON), rope_edit(rope_type="longrope"), "rope type 'longrope'"),
    "llama relu": (LlamaConfig(**COMMON), edit(hidden_act="relu"), "hidden_act 'relu'"),
    "gemma exact gelu": (
        Gemma3TextConfig(**GEMMA),
        edit(hidden_activation="gelu"),
        "hidden_activation 'gelu'",
    ),
    "gemma bidirectional": (
        Gemma3TextConfig(**GEMMA),
        edit(use_bidirectional_attention=True),
        "use_bidirectional_attention",
    ),
    "gemma attention softcap": (
        Gemma3TextConfig(**GEMMA),
        edit(attn_logit_softcapping=50.0),
        "attn_logit_softcapping 50.0",
    ),
    "negative rope factor": (LlamaConfig(**COMMON), rope_edit(rope_type="linear", factor=-2), "'factor'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_option_is_refused_by_name(case: str, tmp_path: Path) -> None:
    config, rewrite, named = REFUSED[case]
    save_random_model(config, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    rewrite(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json") as error:
        load_model(tmp_path, dtype="float32")
    assert named in str(error.value)
