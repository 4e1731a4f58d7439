"""Batched, on-device sampling (being split into modules)."""

from tokenmill.runner.sampler.sampler import (
    DrawParams,
    LogprobsTensors,
    PenaltyParams,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingRow,
    TokenIds,
    TokenIndex,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_prompt_logprobs,
    gather_logprobs,
    seed_for_step,
    top_k_values,
)

__all__ = [
    "DrawParams",
    "LogprobsTensors",
    "PenaltyParams",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingRow",
    "TokenIds",
    "TokenIndex",
    "apply_penalties",
    "apply_top_k_top_p_min_p",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "seed_for_step",
    "top_k_values",
]
