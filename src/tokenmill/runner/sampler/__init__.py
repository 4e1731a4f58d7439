"""Batched, on-device sampling: logit edits, penalties, temperature, top-k / top-p / min-p, logprobs.

A ``SamplingBatch`` is built once per step on the host from the B rows' params and token ids; every
tensor it holds is copied to the logits' device in a handful of asynchronous transfers, and only what
the rows ask for is built (greedy rows alone need nothing). ``Sampler`` then works on ``[B, V]`` tensors
only, with shapes fixed by the host-side params: nothing on the path from logits to token ids reads a
device value back to the host; the caller's read of the token ids is the step's one sync.

Modules: ``batch`` (rows to device tensors), ``penalties`` (logit bias, bans, penalties), ``filters``
(top-k / top-p / min-p), ``draw`` (the PyTorch draw), ``fused`` (the Triton draw; imports triton, and
only ``Sampler(fused=True)`` imports it), ``logprobs`` (sampled and prompt logprobs), ``sampler``.
"""

from tokenmill.runner.sampler.batch import (
    DrawParams,
    PenaltyParams,
    SamplingBatch,
    SamplingRow,
    TokenIds,
    TokenIndex,
    seed_for_step,
    takes_raw_argmax,
)
from tokenmill.runner.sampler.filters import apply_top_k_top_p_min_p, top_k_values
from tokenmill.runner.sampler.logprobs import LogprobsTensors, compute_prompt_logprobs, gather_logprobs
from tokenmill.runner.sampler.penalties import apply_penalties
from tokenmill.runner.sampler.sampler import Sampler, SamplerOutput

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
    "takes_raw_argmax",
    "top_k_values",
]
