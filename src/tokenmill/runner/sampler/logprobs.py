"""Logprobs of chosen tokens and their top alternatives, for sampled tokens and for prompt tokens."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.outputs import RowLogprobs

_PROMPT_LOGPROBS_CHUNK = 1024


@dataclass
class LogprobsTensors:
    """Logprobs of chosen tokens ([N]) and the top-K alternatives ([N, K]) for N rows / positions."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def cat(cls, parts: Sequence["LogprobsTensors"]) -> "LogprobsTensors":
        return cls(
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.ranks for p in parts]),
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
        )

    def to_rows(self, num_top: Sequence[int | None] | int) -> list[RowLogprobs]:
        """Python values per row (one device-to-host copy per tensor); row i keeps its first ``num_top[i]``
        alternatives, less those of probability 0 (tokens a grammar forbids)."""
        counts = [num_top] * len(self.token_ids) if isinstance(num_top, int) else list(num_top)
        token_ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            RowLogprobs(
                token_ids[i],
                logprobs[i],
                ranks[i],
                [
                    (t, lp)
                    for t, lp in zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)
                    if lp > -math.inf
                ],
            )
            for i, k in enumerate(count or 0 for count in counts)
        ]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprob and rank of ``token_ids[i]`` in row i of ``logprobs`` ``[N, V]``, and the top ``num_top``."""
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=1)
    return LogprobsTensors(token_ids.long(), chosen, ranks, top_ids, top_logprobs)


def compute_prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: torch.Tensor | Sequence[int], num_top: int
) -> LogprobsTensors:
    """Logprobs of each prompt token after the first, given the raw logits at the prompt positions.

    ``logits[i]`` (float, ``[L, V]`` or ``[L - 1, V]``) predicts ``prompt_token_ids[i + 1]``; the result has
    L - 1 rows (the first prompt token has no logprob). Computed in chunks of rows to bound memory.
    """
    targets = torch.as_tensor(prompt_token_ids, dtype=torch.long, device=logits.device)[1:]
    logits = logits[: targets.shape[0]]
    chunks = [
        gather_logprobs(
            torch.log_softmax(logits[start : start + _PROMPT_LOGPROBS_CHUNK].float(), dim=-1),
            targets[start : start + _PROMPT_LOGPROBS_CHUNK],
            num_top,
        )
        for start in range(0, targets.shape[0], _PROMPT_LOGPROBS_CHUNK)
    ]
    if not chunks:
        return gather_logprobs(torch.empty(0, logits.shape[-1], device=logits.device), targets, num_top)
    return LogprobsTensors.cat(chunks)
