"""``Sampler``: a step's ``[B, V]`` logits to token ids (and logprobs), its draw bound at construction."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.runner.sampler.batch import SamplingBatch
from tokenmill.runner.sampler.draw import ArgmaxFn, DrawFn, MaskFn, torch_argmax, torch_draw
from tokenmill.runner.sampler.logprobs import LogprobsTensors, gather_logprobs
from tokenmill.runner.sampler.penalties import apply_penalties
from tokenmill.structured.bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # Present when some row asked for logprobs; ``top_*`` are as wide as the largest request in the batch.
    logprobs: LogprobsTensors | None = None


class Sampler:
    """Turns a step's ``[B, V]`` logits into token ids, all rows at once, with no host-device sync.

    Order: the grammar's token mask (structured outputs: tokens it forbids get -inf), logit bias and banned
    tokens, repetition penalty (HF: over prompt and output tokens, positive
    logits divided by it, negative ones multiplied), presence / frequency penalties (OpenAI: over output
    tokens), argmax for greedy rows; for the others temperature, top-k, top-p, min-p, then a sample drawn
    by one uniform number per row through the running sum of its probabilities (:mod:`.inverse_cdf`),
    which is exact and needs no ``torch.multinomial`` sync. A batch of greedy rows only is one ``argmax``
    (plus the edits its rows ask for).

    ``fused`` (``EngineConfig.fused_sampling``) draws with ``tokenmill.kernels.sampling`` instead:
    temperature, the top-k / min-p floor and the Gumbel-max draw in one pass over the logits, the same
    distribution with in-kernel noise (top-p still sorts in PyTorch first). Seeded rows stay independent
    of the batch on either path, but the two paths draw different samples from the same seed.

    The draw is chosen once, here: a fused sampler imports the kernel module (and triton) when built, so
    build one only where ``tokenmill.kernels.triton_available`` says yes. ``fused`` is read-only; for the
    other path, build another sampler.

    Logprobs are those of the model's raw logits (``log_softmax`` before bias, penalties, temperature and
    filtering), as vLLM v1 returns by default; for a row with a grammar, of its masked logits (the
    constrained distribution: forbidden tokens have probability 0 and never appear among the top ones).
    """

    def __init__(self, *, fused: bool = False) -> None:
        self._fused = fused
        self._draw: DrawFn
        self._argmax: ArgmaxFn
        self._mask: MaskFn
        self._compile: Callable[[int, int, torch.device], None] | None = None
        if fused:
            from tokenmill.runner.sampler import fused as kernels  # imports triton

            self._draw, self._argmax = kernels.fused_draw, kernels.argmax
            self._mask, self._compile = kernels.apply_token_bitmask, kernels.compile_variants
        else:
            self._draw, self._argmax, self._mask = torch_draw, torch_argmax, apply_token_bitmask

    @property
    def fused(self) -> bool:
        """Whether this sampler draws with the Triton kernel (fixed at construction)."""
        return self._fused

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """``argmax``: ``logits.argmax(dim=-1)`` when already computed (decode graphs compute it with the
        logits); a batch of greedy rows without logit edits or grammars takes its tokens from it as they
        are."""
        logits = logits.float()
        if batch.token_bitmask is not None:
            logits = self._mask(logits, batch.token_bitmask)
        processed = apply_penalties(logits, batch)
        unedited = not batch.needs_logit_edits and batch.token_bitmask is None
        if batch.draw is None and argmax is not None and unedited:
            token_ids = argmax
        elif batch.draw is None:
            token_ids = self._argmax(processed)
        else:
            token_ids = self._draw(processed, batch, batch.draw)
        num_top = batch.max_num_logprobs
        if num_top is None:
            return SamplerOutput(token_ids)
        return SamplerOutput(
            token_ids, gather_logprobs(torch.log_softmax(logits, dim=-1), token_ids, num_top)
        )

    def compile_kernels(self, vocab: int, max_rows: int, device: torch.device) -> None:
        """Compile the fused draw for every batch of up to ``max_rows`` rows now (nothing to do unfused)."""
        if self._compile is not None:
            self._compile(vocab, max_rows, device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of float32 ``[B, V]`` logits (ties to the lowest id)."""
        return self._argmax(logits)
