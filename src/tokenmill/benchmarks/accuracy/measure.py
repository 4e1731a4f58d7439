"""Teacher-forced scoring and greedy continuations of one model, to compare quantized modes.

Teacher forcing: the text runs in windows of ``window`` tokens, each a fresh sequence fed in chunks
through the KV cache (the reference single-sequence runner), and every position's logits are scored
against the next token of the text. Perplexity is ``exp(mean negative log-likelihood)``; the argmax at
each position is kept, so two runs' top-1 predictions can be compared position by position.
"""

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.models import CausalLM
from tokenmill.reference import SingleSequenceRunner, greedy_generate

CHUNK_TOKENS = 128  # positions scored per forward pass (bounds the [chunk, vocab] logits)
# Packed GGUF modes score in chunks below the packed kernels' BLAS threshold (DEQUANTIZED_MIN_ROWS), so
# every position goes through the kernels a decode step runs, with their rounding of the inputs.
DECODE_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class Scored:
    """One model's teacher-forced pass over the text."""

    nll_sum: float
    predictions: torch.Tensor  # [positions] argmax at each position
    targets: torch.Tensor  # [positions] the text's next tokens
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / len(self.targets))

    def agreement(self, other: "Scored") -> float:
        """Share of positions whose top-1 prediction equals ``other``'s."""
        return float((self.predictions == other.predictions).float().mean())

    @property
    def accuracy(self) -> float:
        """Share of positions whose top-1 prediction is the text's next token."""
        return float((self.predictions == self.targets).float().mean())


def score_text(model: CausalLM, token_ids: Sequence[int], window: int, chunk: int = CHUNK_TOKENS) -> Scored:
    start = time.perf_counter()
    nll, predictions, targets = 0.0, [], []
    for first in range(0, len(token_ids) - 1, window):
        piece = list(token_ids[first : first + window + 1])
        runner = SingleSequenceRunner(model, len(piece) - 1)
        for offset in range(0, len(piece) - 1, chunk):
            inputs = piece[offset : offset + chunk]
            expected = torch.tensor(piece[offset + 1 : offset + 1 + len(inputs)])
            logits = runner.forward_all(inputs[: len(expected)]).float().cpu()
            log_probs = torch.log_softmax(logits, dim=-1)
            nll -= float(log_probs.gather(1, expected[:, None]).sum())
            predictions.append(logits.argmax(dim=-1))
            targets.append(expected)
    return Scored(nll, torch.cat(predictions), torch.cat(targets), time.perf_counter() - start)


def greedy_continuations(model: CausalLM, prompts: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """Each prompt's first ``tokens`` greedy tokens (EOS not stopping them)."""
    return [greedy_generate(model, prompt, tokens).token_ids for prompt in prompts]


@dataclass(frozen=True)
class GreedyComparison:
    identical: int  # prompts whose continuation equals the reference's
    matching_tokens: int  # tokens equal to the reference's, position by position
    total_tokens: int
    first_divergence: list[int | None]  # per prompt: the first differing position (None: identical)


def compare_greedy(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> GreedyComparison:
    divergence: list[int | None] = []
    matching = total = 0
    for mine, theirs in zip(ours, reference, strict=True):
        pairs = list(zip(mine, theirs, strict=False))
        matching += sum(a == b for a, b in pairs)
        total += len(theirs)
        differ = [i for i, (a, b) in enumerate(pairs) if a != b]
        divergence.append(differ[0] if differ else (None if len(mine) == len(theirs) else len(pairs)))
    identical = sum(d is None for d in divergence)
    return GreedyComparison(identical, matching, total, divergence)


def linear_weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights (and scales) of the layers a quantization method serves: the projections and
    the LM head (a tied head counts the embedding it shares)."""
    total = 0
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            total += tensor.numel() * tensor.element_size()
    return total
