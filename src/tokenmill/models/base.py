"""What every architecture provides: config parsing, a packed forward pass, logits, and weight loading."""

import copy
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, Self

import torch
from torch import nn

from tokenmill.kernels.options import KernelOptions
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.embedding import ParallelLMHead
from tokenmill.models.layers.fusable import FusableLayer
from tokenmill.models.layers.linear import ShardId, weight_loader_of
from tokenmill.quantization import UNQUANTIZED


class WeightLoadingError(ValueError):
    """A checkpoint tensor does not fit the model; the loader adds the file name."""


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over packed tokens.

    ``forward(input_ids, positions)`` takes the ``[T]`` new tokens of every sequence in the step, packed
    together, and returns their ``[T, hidden]`` states; attention finds the sequence boundaries and KV
    cache in the forward context. ``compute_logits`` is applied only to the rows that need logits.
    """

    # Checkpoint-name fragment → (fused parameter fragment, shard id), for projections fused here.
    stacked_params: ClassVar[tuple[tuple[str, str, ShardId], ...]] = ()
    # Checkpoint tensors that carry nothing the model needs (regexes).
    ignored_weights: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)
    lm_head: ParallelLMHead

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.kernel_options = KernelOptions()  # what with_kernels configured (all off: plain PyTorch)

    def with_kernels(self, options: KernelOptions) -> Self:
        """A copy of this model whose layers run the paths ``options`` ask for (Triton kernels, oneDNN
        prepacking), sharing this model's parameters and buffers; this model is left as it was.

        Engines over one loaded model each configure their own copy, so none changes another's kernels.
        A freshly loaded model runs plain PyTorch; configure before capturing CUDA graphs of it.
        """
        configured = copy.deepcopy(self, self._shared_tensors())
        configured._configure_layers(options)
        return configured

    def _configure_layers(self, options: KernelOptions) -> None:
        for module in self.modules():
            if isinstance(module, FusableLayer):
                module.configure(options)
        self.kernel_options = options

    def _shared_tensors(self) -> dict[int, Any]:
        """A ``deepcopy`` memo that maps every tensor the modules hold (parameters, buffers, packed weights)
        to itself, so that a copy shares them instead of duplicating them."""
        held = [value for module in self.modules() for value in vars(module).values()]
        tensors = [*self.parameters(), *self.buffers(), *(v for v in held if isinstance(v, torch.Tensor))]
        return {id(tensor): tensor for tensor in tensors}

    @classmethod
    @abstractmethod
    def config_from_hf(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        """Translate a Hugging Face ``config.json`` dict; ``source`` names it in errors."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Hook to rename or re-layout a checkpoint tensor before loading (identity by default)."""
        return name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, one at a time; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        pending = {name: self._expected_shards(name) for name in params}
        own_head = self.config.tie_word_embeddings and self.lm_head.quant_method is not UNQUANTIZED
        if own_head:  # a tied head with weights of its own format (GGUF blocks): filled from the checkpoint
            pending["lm_head.weight"] = {None}
        for raw_name, raw_tensor in weights:
            name, tensor = self.checkpoint_tensor(raw_name, raw_tensor)
            if own_head and name == "lm_head.weight":
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
                pending[name].clear()
                continue
            if self._ignored(name):
                continue
            target, shard_id = self.checkpoint_target(name)
            if target not in params:
                raise WeightLoadingError(f"tensor '{raw_name}' has no place in {type(self).__name__}")
            try:
                weight_loader_of(params[target])(params[target], tensor, shard_id)
            except ValueError as exc:
                raise WeightLoadingError(f"tensor '{raw_name}' {exc}") from None
            pending[target].discard(shard_id) if shard_id is not None else pending[target].clear()
        missing = sorted(name for name, shards in pending.items() if shards)
        if missing:
            raise WeightLoadingError(f"the checkpoint lacks tensors for: {', '.join(missing[:8])}")

    def _ignored(self, name: str) -> bool:
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return any(re.search(pattern, name) for pattern in self.ignored_weights)

    def checkpoint_target(self, name: str) -> tuple[str, ShardId]:
        """The parameter a (renamed) checkpoint tensor fills, and its shard of it (None: the whole)."""
        for checkpoint_part, param_part, shard_id in self.stacked_params:
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{param_part}."), shard_id
        return name, None

    def _expected_shards(self, param_name: str) -> set[Any]:
        shards = {shard for _, part, shard in self.stacked_params if f".{part}." in param_name}
        return shards or {None}
