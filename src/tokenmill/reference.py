"""The reference generation loop, and the oracle the tests hold the engine to: one sequence, greedy, with a
contiguous KV cache, none of the engine's scheduling, batching or fast paths.

It exercises the same model interface the batched engine uses (packed tokens, positions, slot mapping,
block tables) with a single block that spans the whole sequence.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    KVCacheLayer,
    TorchAttentionBackend,
    forward_context,
)
from tokenmill.models import CausalLM


class SingleSequenceRunner:
    """Runs one sequence through ``model``, caching its K/V in one ``[1, max_len, heads, dim]`` block."""

    def __init__(self, model: CausalLM, max_len: int, backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.max_len = max_len
        self.backend = backend or TorchAttentionBackend()
        param = next(model.parameters())
        self.device = param.device
        cfg = model.config
        shape = (1, max_len, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: masked-out slots are still multiplied by zero weights in reference attention.
        self.kv_caches = [
            KVCacheLayer(
                torch.zeros(shape, dtype=param.dtype, device=self.device),
                torch.zeros(shape, dtype=param.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.block_tables = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        self.num_tokens = 0

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` to the sequence; return the float32 logits of the last one."""
        return self.model.compute_logits(self.hidden_states(token_ids)[-1:])[0]

    @torch.inference_mode()
    def forward_all(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids``; return the float32 logits of every one of them (teacher forcing)."""
        return self.model.compute_logits(self.hidden_states(token_ids))

    @torch.inference_mode()
    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids``; return their final hidden states (no logits: what calibration needs)."""
        start, count = self.num_tokens, len(token_ids)
        if start + count > self.max_len:
            raise ValueError(f"sequence of {start + count} tokens exceeds the cache of {self.max_len}")
        positions = torch.arange(start, start + count, device=self.device)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([start + count], dtype=torch.int32, device=self.device),
            max_query_len=count,
            max_seq_len=start + count,
            slot_mapping=positions,
            block_tables=self.block_tables,
        )
        input_ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_caches)):
            hidden: torch.Tensor = self.model(input_ids, positions)
        self.num_tokens += count
        return hidden


@dataclass
class GreedyOutput:
    token_ids: list[int]
    prompt_logits: torch.Tensor  # float32 logits at the last prompt position


def greedy_stream(
    model: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(token, logits it was chosen from)`` until ``max_new_tokens`` or a stop token."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    runner = SingleSequenceRunner(model, len(prompt_ids) + max_new_tokens)
    logits = runner.forward(prompt_ids)
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        yield token, logits
        if token in stop_token_ids or step == max_new_tokens - 1:
            return
        logits = runner.forward([token])


def greedy_generate(
    model: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> GreedyOutput:
    tokens: list[int] = []
    prompt_logits = torch.empty(0)
    for token, logits in greedy_stream(model, prompt_ids, max_new_tokens, stop_token_ids):
        if not tokens:
            prompt_logits = logits
        tokens.append(token)
    return GreedyOutput(tokens, prompt_logits)
