"""Token embeddings and the LM head, split over the vocabulary across tensor-parallel ranks.

The LM head is a linear projection: quantized like the linear layers when the model's quantization covers
it and it is not tied to the embedding (a tied head reads the float embedding; embeddings stay float)."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import all_gather_last_dim, all_reduce_sum, divide, tp_rank, tp_world_size
from tokenmill.kernels.options import KernelOptions
from tokenmill.models.layers.linear import LinearProjection, ShardId
from tokenmill.quantization import RowShard, lm_head_method
from tokenmill.quantization.shards import layout_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tp_size = tp_world_size()
        self.vocab_size = vocab_size
        self.local_vocab = divide(vocab_size, self.tp_size, "vocabulary size")
        self.vocab_start = tp_rank() * self.local_vocab
        self.create_weight(dim)

    def create_weight(self, dim: int) -> None:
        self.weight = nn.Parameter(torch.empty(self.local_vocab, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        self.store(param, loaded, RowShard(self.vocab_size, self.vocab_start, self.local_vocab, 0))

    def store(self, param: nn.Parameter, loaded: torch.Tensor, shard: RowShard) -> None:
        layout_of(param).store(param, loaded, shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.local_vocab)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return all_reduce_sum(out.masked_fill(outside.unsqueeze(-1), 0), self.tp_size)


class ParallelLMHead(VocabParallelEmbedding, LinearProjection):
    """Projects hidden states to float32 logits over the full vocabulary, through the linear layers' paths
    (:class:`LinearProjection`). On the GPU fast path (``KernelOptions.gemv``) the GEMV and cuBLAS write
    float32 logits directly: no separate cast of the largest activation of the step (at 256 rows of a
    152k vocabulary, a 0.1 ms copy per step on the H200)."""

    gemv_out_dtype = torch.float32

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__(vocab_size, dim)
        self.configure(KernelOptions())

    def create_weight(self, dim: int) -> None:
        self.quant_method = lm_head_method()  # chosen by the model's build (tokenmill.quantization.context)
        self.quant_method.create_weights(self, self.local_vocab, dim, self.weight_loader)

    def store(self, param: nn.Parameter, loaded: torch.Tensor, shard: RowShard) -> None:
        LinearProjection.store(self, param, loaded, shard)

    def _bind_matmul(self, options: KernelOptions) -> Callable[[torch.Tensor], torch.Tensor]:
        matmul = super()._bind_matmul(options)
        return self.project_to_float32 if options.gemv and matmul == self.project_torch else matmul

    def project_to_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` accumulated and written in float32 by cuBLAS (16-bit CUDA inputs; others as usual)."""
        if not x.is_cuda or x.dtype == torch.float32 or x.dim() != 2:
            return self.project_torch(x)
        return torch.mm(x, self.weight.t(), out_dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self.project(hidden), self.tp_size).float()
