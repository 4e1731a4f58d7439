"""Turning a scheduled step into one forward pass: packed inputs, attention metadata, logits, samples."""

from dataclasses import dataclass, field

import torch

from tokenmill.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import RowLogprobs, Sampler, SamplingBatch, SamplingRow, compute_prompt_logprobs
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.models import CausalLM


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the packed batch whose logits are sampled
    sampled_chunks: list[ScheduledChunk]


@dataclass
class StepResult:
    sampled: dict[Request, tuple[int, RowLogprobs | None]] = field(default_factory=dict)
    prompt_logprobs: dict[Request, list[RowLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache | None, backend: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.sampler = Sampler()
        self.vocab_size = model.config.vocab_size

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        inputs = self.prepare(chunks)
        layers = self.kv_cache.layers if self.kv_cache is not None else None
        with forward_context(ForwardContext(inputs.metadata, self.backend, layers)):
            hidden = self.model(inputs.input_ids, inputs.positions)
        result = StepResult(prompt_logprobs=self._prompt_logprobs(chunks, hidden))
        if inputs.sampled_chunks:
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            self._sample(inputs.sampled_chunks, logits, result)
        return result

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.request.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
            seq_lens.append(chunk.end)
        sampled = [i for i, chunk in enumerate(chunks) if chunk.completes_sequence]
        host = {
            "input_ids": torch.tensor(token_ids, dtype=torch.long),
            "positions": torch.tensor(positions, dtype=torch.long),
            "query_start_loc": torch.tensor(query_start_loc, dtype=torch.int32),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "sample_rows": torch.tensor([query_start_loc[i + 1] - 1 for i in sampled], dtype=torch.long),
        }
        dev = {name: tensor.to(self.device, non_blocking=True) for name, tensor in host.items()}
        slot_mapping = block_tables = None
        if self.kv_cache is not None:
            manager = self.kv_cache.manager
            ids = [chunk.request.request_id for chunk in chunks]
            ranges = [(chunk.request.request_id, chunk.start, chunk.end) for chunk in chunks]
            slot_mapping = manager.build_slot_mapping(ranges, self.device)
            block_tables = manager.build_block_tables(ids, self.device)
        metadata = AttentionMetadata(
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            max_query_len=max(chunk.num_tokens for chunk in chunks),
            max_seq_len=max(seq_lens),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
        )
        return StepInputs(
            dev["input_ids"], dev["positions"], metadata, dev["sample_rows"], [chunks[i] for i in sampled]
        )

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor, result: StepResult) -> None:
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.banned_token_ids())
            for r in (chunk.request for chunk in chunks)
        ]
        out = self.sampler(logits, SamplingBatch.build(rows, self.vocab_size, self.device))
        token_ids = out.token_ids.tolist()
        logprobs: list[RowLogprobs | None] = [None] * len(chunks)
        if out.logprobs is not None:
            logprobs = list(out.logprobs.to_rows([row.params.logprobs for row in rows]))
        for chunk, token, entry in zip(chunks, token_ids, logprobs, strict=True):
            wanted = chunk.request.params.logprobs is not None
            result.sampled[chunk.request] = (token, entry if wanted else None)

    def _prompt_logprobs(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[Request, list[RowLogprobs]]:
        """Logprobs of the prompt tokens this step's chunks predict, for requests that asked for them."""
        found: dict[Request, list[RowLogprobs]] = {}
        row = 0
        for chunk in chunks:
            request, num_top = chunk.request, chunk.request.params.prompt_logprobs
            last_predicting = min(
                chunk.end, request.num_prompt_tokens - 1
            )  # positions predicting a prompt token
            if num_top is not None and request.prompt_logprobs_done == chunk.start < last_predicting:
                count = last_predicting - chunk.start
                logits = self.model.compute_logits(hidden[row : row + count])
                targets = request.prompt_token_ids[chunk.start : last_predicting + 1]
                found[request] = compute_prompt_logprobs(logits, targets, num_top).to_rows(num_top)
            row += chunk.num_tokens
        return found
