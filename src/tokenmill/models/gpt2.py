"""GPT-2: learned absolute positions, LayerNorm, a GELU MLP, and multi-head attention with a fused
``c_attn`` projection stored as a transposed ("Conv1D") weight."""

from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.attention import AttentionLayer
from tokenmill.distributed import divide, tp_world_size
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ConfigReader, ModelConfig
from tokenmill.models.layers import (
    Attention,
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gelu_tanh,
)

_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def parse_gpt2_config(raw: dict[str, Any], source: str) -> ModelConfig:
    r = ConfigReader(raw, source)
    hidden = r.require_int("n_embd", "hidden_size")
    heads = r.require_int("n_head", "num_attention_heads")
    activation = r.str_or("activation_function", "gelu_new")
    if activation not in _TANH_GELUS:
        raise r.error(f"activation '{activation}' is not supported (supported: {_TANH_GELUS})")
    layers = r.require_int("n_layer", "num_hidden_layers")
    head_dim = hidden // heads if heads else 0
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=r.require_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.int_or("n_inner", 4 * hidden),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=r.require_int("n_positions", "max_position_embeddings"),
        norm_eps=r.float_or("layer_norm_epsilon", 1e-5),
        hidden_act=activation,
        tie_word_embeddings=r.bool_or("tie_word_embeddings", True),
        rope=None,
        attention_scale=head_dim**-0.5 if r.bool_or("scale_attn_weights", True) else 1.0,
        sliding_windows=(None,) * layers,
        qkv_bias=True,
        output_bias=True,
        mlp_bias=True,
        bos_token_id=r.int_or("bos_token_id", 50256),
        eos_token_ids=r.token_ids("eos_token_id"),
        raw=raw,
    )


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        local = divide(config.num_heads, tp_world_size(), "attention heads")
        self.local_size = local * config.head_dim
        self.c_attn = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_heads, True
        )
        self.c_proj = RowParallelLinear(config.hidden_size, config.hidden_size, True)
        scale = config.attention_scale
        if config.raw.get("scale_attn_by_inverse_layer_idx"):
            scale /= layer_idx + 1  # the scores of the n-th layer (from 1) divided by n
        self.attn = Attention(AttentionLayer(layer_idx, local, local, config.head_dim, scale, None))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).split(self.local_size, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size, _freeze=True)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden)
        out: torch.Tensor = self.ln_f(hidden)
        return out


class GPT2LMHeadModel(CausalLM):
    ignored_weights: ClassVar[tuple[str, ...]] = (r"\.attn\.(masked_)?bias$",)

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        return parse_gpt2_config(raw, source)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original OpenAI checkpoints have no prefix
        if name.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()  # Conv1D stores [in, out]
        return name, tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.transformer(input_ids, positions)
        return hidden
