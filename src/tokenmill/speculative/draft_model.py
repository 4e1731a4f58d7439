"""A draft model as proposer: a smaller model with the target's vocabulary guesses ``k`` tokens per round.

The draft runs through its own :class:`~tokenmill.runner.model_runner.ModelRunner` (with CUDA graphs where
the target has them) and paged KV pool. It keeps a shadow of each decoding sequence: the tokens it has
computed. A round first brings the shadow up to the sequence (the tokens the target accepted since the
last round; the whole prompt the first time), dropping the KV of its own rejected guesses, then samples a
guess, feeds it back and samples the next, ``k`` times, all sequences of the round batched together. Each
guess is drawn from the distribution a plain step of the draft would draw from (the request's temperature,
filters and penalties); those distributions go to the rejection sampler as ``q`` (None for greedy
requests, whose guesses are one-hot).

Under tensor parallelism the draft runs whole on rank 0 alone (as vLLM's draft tensor-parallel size 1): it
is built :func:`~tokenmill.distributed.unsharded`, so its layers call no collective, and its runner has
no mirror, so its steps are not sent to the workers; only the target's verification steps are.
"""

import math
from collections.abc import Sequence

import torch

from tokenmill.attention.selector import create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.distributed import unsharded
from tokenmill.kernels.options import KernelOptions
from tokenmill.loading import LoadedModel, load_model
from tokenmill.runner.cuda_graphs import cuda_graph_sizes
from tokenmill.runner.kv_cache import create_kv_cache
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.prefill_graphs import prefill_graph_sizes
from tokenmill.runner.sampler import Sampler, SamplingBatch, SamplingRow
from tokenmill.scheduler.output import ScheduledChunk
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.proposer import Proposal, Proposer
from tokenmill.speculative.rejection import RowNoise, distributions, sample_rows

# Seeded requests: the draft's noise must not be the verifier's (same (seed, step) keys), or the draft
# token and the residual draw after its rejection would be correlated.
_DRAFT_KEY_SALT = 0x2545F4914F6CDD1D
_GPU_DRAFT_POOL_TOKENS = 1 << 18


class DraftModelProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, runner: ModelRunner, vocab_size: int) -> None:
        super().__init__(num_speculative_tokens)
        self.runner = runner
        self.vocab_size = vocab_size
        self.shadows: dict[Seq, Seq] = {}  # sequence -> the tokens the draft has (its KV: num_computed)

    @classmethod
    def load(
        cls,
        config: EngineConfig,
        target: LoadedModel,
        max_model_len: int,
        options: KernelOptions,
        draft: LoadedModel | None = None,
    ) -> "DraftModelProposer":
        """Load ``config.speculative.model`` (or take ``draft``), check its vocabulary against the
        target's, and give it a KV pool of its own (no prefix cache) and, where the target has them, CUDA
        graphs: decode graphs for its one-token steps, one-sequence prefill graphs for a catch-up."""
        spec = config.speculative
        if draft is None:
            with unsharded():  # whole, even in a tensor-parallel engine: only this rank runs it
                draft = load_model(
                    spec.model,
                    device=target.device,
                    dtype=target.dtype,
                    load_format=spec.load_format,
                    max_model_len=max_model_len,
                    seed=config.seed,
                )
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"speculative_model {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens and "
                f"the model {target.config.vocab_size}: a draft model must share the model's vocabulary"
            )
        if draft.config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_model {spec.model!r} holds {draft.config.max_position_embeddings} positions, "
                f"fewer than max_model_len ({max_model_len})"
            )
        return cls(
            spec.num_tokens,
            _draft_runner(config, draft, max_model_len, options),
            draft.config.vocab_size,
        )

    def propose(self, seqs: Sequence[Seq], max_drafts: Sequence[int]) -> list[Proposal]:
        self._forget_others(seqs)
        active = [
            self._catch_up(seq, limit) if limit > 0 else None
            for seq, limit in zip(seqs, max_drafts, strict=True)
        ]
        rounds = [
            (shadow, limit) for shadow, limit in zip(active, max_drafts, strict=True) if shadow is not None
        ]
        guesses: dict[Seq, list[int]] = {shadow: [] for shadow, _ in rounds}
        dists: dict[Seq, list[torch.Tensor]] = {shadow: [] for shadow, _ in rounds}
        for step in range(max((limit for _, limit in rounds), default=0)):
            shadows = [shadow for shadow, limit in rounds if limit > step]
            for shadow, token, probs in self._draft_step(shadows):
                guesses[shadow].append(token)
                if probs is not None:
                    dists[shadow].append(probs)
        return [self._proposal(shadow, guesses, dists) for shadow in active]

    def _proposal(
        self, shadow: Seq | None, guesses: dict[Seq, list[int]], dists: dict[Seq, list[torch.Tensor]]
    ) -> Proposal:
        tokens = guesses.get(shadow, []) if shadow is not None else []
        probs = dists.get(shadow, []) if shadow is not None else []
        return Proposal(tokens, torch.stack(probs) if probs and len(probs) == len(tokens) else None)

    def _catch_up(self, seq: Seq, num_guesses: int) -> Seq | None:
        """The shadow of ``seq`` with KV for the tokens it shares with ``seq`` (its rejected guesses'
        slots given back) and ``seq``'s tokens; None (no guesses this round, and the shadow dropped) when
        the pool cannot hold the round's tokens."""
        manager = self.runner.kv.manager
        shadow = self.shadows.get(seq)
        if shadow is None:
            shadow = Seq(
                seq.seq_id,
                seq.prompt_token_ids,
                seq.params,
                seq.max_tokens,
                seq.eos_token_ids,
                bad_words=seq.bad_words,
            )
            self.shadows[seq] = shadow
        # Never all of seq's tokens: the last one's logits give the first guess. The draft may have computed
        # it already, when the step verified fewer guesses than proposed and its bonus token was the next.
        kept = min(
            shadow.num_computed_tokens, _common_prefix(shadow.token_ids, seq.token_ids), seq.num_tokens - 1
        )
        manager.rollback(shadow, shadow.num_computed_tokens - kept)  # its slots: exactly its computed ones
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = kept
        if not manager.allocate(shadow, shadow.num_tokens + num_guesses - 1):  # the round's slots
            manager.free(self.shadows.pop(seq))
            return None
        return shadow

    def _draft_step(self, shadows: list[Seq]) -> list[tuple[Seq, int, torch.Tensor | None]]:
        """One forward pass of the draft over each shadow's uncomputed tokens, and a guess sampled for
        each, appended to it."""
        chunks = [ScheduledChunk(shadow, shadow.num_computed_tokens, shadow.num_tokens) for shadow in shadows]
        logits = self.runner.logits(chunks)
        rows = [
            SamplingRow(s.params, s.prompt_id_array, s.output_token_ids, s.banned_token_ids())
            for s in shadows
        ]
        batch = SamplingBatch.build(rows, self.vocab_size, logits.device)
        dist = distributions(logits, batch)
        seeded = batch.draw.seeded_rows if batch.draw is not None else []
        tokens = sample_rows(dist, RowNoise([(row, key ^ _DRAFT_KEY_SALT) for row, key in seeded])).tolist()
        out: list[tuple[Seq, int, torch.Tensor | None]] = []
        for row, (shadow, token) in enumerate(zip(shadows, tokens, strict=True)):
            shadow.num_computed_tokens = shadow.num_tokens
            shadow.token_ids.append(token)
            probs = None if dist.probs is None or shadow.params.is_greedy else dist.probs[row]
            out.append((shadow, token, probs))
        return out

    def _forget_others(self, seqs: Sequence[Seq]) -> None:
        """Free the shadows of sequences not asking this round (ended, preempted, or about to end)."""
        asking = set(seqs)
        for seq in [seq for seq in self.shadows if seq not in asking]:
            self.runner.kv.manager.free(self.shadows.pop(seq))


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = min(len(a), len(b))
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


def _draft_runner(
    config: EngineConfig, draft: LoadedModel, max_model_len: int, options: KernelOptions
) -> ModelRunner:
    model = draft.model.with_kernels(options)
    backend = create_attention_backend(config.kernels, draft.device, options.pdl)
    pool: dict[str, object] = {"kv_cache": "paged", "prefix_caching": False}
    if draft.device.type == "cuda" and config.kv.num_blocks is None:
        tokens = min(config.scheduler.max_running * max_model_len, _GPU_DRAFT_POOL_TOKENS)
        pool["num_kv_blocks"] = math.ceil(tokens / config.kv.block_size)
    draft_config = config.with_options(**pool)
    kv = create_kv_cache(draft_config, draft.config, max_model_len, draft.device, draft.dtype)
    return ModelRunner(  # no mirror: the draft's steps stay on this rank
        model,
        backend,
        Sampler(),
        kv,
        max_model_len,
        graph_sizes=_draft_graph_sizes(config, draft.device),
        logits_in_graph=config.graphs.logits,
        prefill_graph_sizes=prefill_graph_sizes(config, draft.device, max_model_len),
    )


def _draft_graph_sizes(config: EngineConfig, device: torch.device) -> tuple[int, ...]:
    """The target's decode graph sizes that a round can use: rounds run only while fewer sequences than
    ``disable_by_batch_size`` do."""
    sizes = cuda_graph_sizes(config, device)
    cutoff = config.speculative.disable_by_batch_size
    if cutoff is None or not sizes:
        return sizes
    wanted = [size for size in sizes if size < cutoff]
    return (*wanted, *[size for size in sizes if size >= cutoff][:1])  # a padded size for cutoff - 1
