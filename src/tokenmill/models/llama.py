"""The Llama family: Llama 2/3.x, SmolLM2, Mistral and Qwen2/2.5 (the same block, different options).

Pre-norm decoder blocks: ``h = x + attn(rmsnorm(x))``, ``out = h + mlp(rmsnorm(h))``, with grouped-query
attention, rotary positions and a SwiGLU MLP.
"""

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.attention import AttentionLayer
from tokenmill.config import GGUFActivations
from tokenmill.distributed import divide, kv_head_shard, tp_rank, tp_world_size
from tokenmill.kernels.options import KernelOptions
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ConfigReader, ModelConfig
from tokenmill.models.layers import (
    GATED_ACTIVATIONS,
    Attention,
    GatedActivation,
    GatedActivationLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    PreNormLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from tokenmill.models.layers.fusable import FusableLayer
from tokenmill.models.layers.linear import ShardId

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# Checkpoint projections fused here: q/k/v into qkv_proj, gate/up into gate_up_proj (Llama and Gemma).
FUSED_QKV_GATE_UP: tuple[tuple[str, str, ShardId], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def local_heads(config: ModelConfig) -> tuple[int, int]:
    """(query heads, KV heads) this rank holds."""
    tp = tp_world_size()
    local_q = divide(config.num_heads, tp, "attention heads")
    return local_q, kv_head_shard(config.num_kv_heads, tp, tp_rank())[0]


QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def llama_sliding_windows(reader: ConfigReader, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows as transformers reads them: Mistral's window on the ``layer_types`` marked sliding
    (transformers runs such a config as Ministral), else on every layer; Qwen's only with
    ``use_sliding_window``, on the ``layer_types`` marked sliding, else on the layers from
    ``max_window_layers`` on; Llama's none."""
    window = reader.int_or("sliding_window", 0) or None
    if architecture == "MistralForCausalLM":
        first = 0
    elif architecture in QWEN_ARCHITECTURES and reader.bool_or("use_sliding_window", False):
        first = reader.int_or("max_window_layers", 28)
    else:
        return (None,) * num_layers
    types = reader.layer_types(num_layers)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return tuple(window if i >= first else None for i in range(num_layers))


def llama_biases(reader: ConfigReader, architecture: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, output projection bias, MLP bias): Qwen2 always biases q/k/v and nothing else, Mistral
    biases nothing, Qwen3 reads ``attention_bias``, Llama ``attention_bias`` and ``mlp_bias``."""
    if architecture == "Qwen2ForCausalLM":
        return True, False, False
    if architecture == "MistralForCausalLM":
        return False, False, False
    attention = reader.bool_or("attention_bias", False)
    return attention, attention, architecture == "LlamaForCausalLM" and reader.bool_or("mlp_bias", False)


def gated_activation_name(reader: ConfigReader, key: str, default: str) -> str:
    name = reader.str_or(key, default)
    if name not in GATED_ACTIVATIONS:
        raise reader.error(f"{key} '{name}' is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
    return name


def parse_llama_config(raw: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    r = ConfigReader(raw, source)
    hidden = r.require_int("hidden_size")
    heads = r.require_int("num_attention_heads")
    layers = r.require_int("num_hidden_layers")
    head_dim = r.int_or("head_dim", hidden // heads if heads else 0)
    qkv_bias, output_bias, mlp_bias = llama_biases(r, architecture)
    rope = r.rope(r.rope_parameters(), default_theta=10000.0)
    return ModelConfig(
        architecture=architecture,
        vocab_size=r.require_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.require_int("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=r.int_or("num_key_value_heads", heads),
        head_dim=head_dim,
        max_position_embeddings=rope.context_length(r.int_or("max_position_embeddings", 4096)),
        norm_eps=r.float_or("rms_norm_eps", 1e-6),
        hidden_act=gated_activation_name(r, "hidden_act", "silu"),
        tie_word_embeddings=r.bool_or("tie_word_embeddings", False),
        rope=rope,
        attention_scale=head_dim**-0.5,
        sliding_windows=llama_sliding_windows(r, architecture, layers),
        qkv_bias=qkv_bias,
        output_bias=output_bias,
        mlp_bias=mlp_bias,
        bos_token_id=r.int_or("bos_token_id", -1) if r.has("bos_token_id") else None,
        eos_token_ids=r.token_ids("eos_token_id"),
        raw=raw,
    )


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions, from the fused ``[T, q | k | v]`` projection.

    The decoder layer applies ``qkv_proj`` together with the norm before it (:class:`PreNormLinear`), so
    ``forward`` takes the projection; it attends and applies ``o_proj``.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        num_heads, num_kv_heads = local_heads(config)
        self.q_size = num_heads * config.head_dim
        self.kv_size = num_kv_heads * config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.output_bias
        )
        self.rotary_emb = rotary
        spec = AttentionLayer(
            layer_idx=layer_idx,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            scale=config.attention_scale,
            sliding_window=config.sliding_windows[layer_idx],
        )
        self.attn = Attention(spec)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(qkv)
        return self.o_proj(self.attn(q, k, v, self.rotary_emb.pending(positions, self.attn.spec.head_dim)))


class QKNormAttention(LlamaAttention, FusableLayer):
    """Llama attention with an RMSNorm over each query and key head before rotary (Qwen3, Gemma 3).

    With ``KernelOptions.rms_norm`` both norms run as one kernel, in place in the ``qkv`` projection.
    """

    norm_unit_offset: ClassVar[bool] = False  # the norms scale by 1 + w (Gemma)

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, self.norm_unit_offset)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, self.norm_unit_offset)
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        self.pdl = options.pdl
        self._norm_heads: Callable[[torch.Tensor], Triple] = self.norm_heads_torch
        if options.rms_norm:
            from tokenmill.kernels.rmsnorm import head_rms_norm_

            self._head_rms_norm_kernel = head_rms_norm_
            self._norm_heads = self.norm_heads_triton

    def split_qkv(self, qkv: torch.Tensor) -> Triple:
        return self._norm_heads(qkv)

    def norm_heads_torch(self, qkv: torch.Tensor) -> Triple:
        q, k, v = super().split_qkv(qkv)
        head_dim = self.attn.spec.head_dim
        q = self.q_norm(q.reshape(-1, head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, head_dim)).view(k.shape)
        return q, k, v

    def norm_heads_triton(self, qkv: torch.Tensor) -> Triple:
        spec = self.attn.spec
        weights = (self.q_norm.weight, self.k_norm.weight)
        if qkv.dim() != 2 or (not self.norm_unit_offset and weights[0].dtype != qkv.dtype):
            return self.norm_heads_torch(qkv)
        self._head_rms_norm_kernel(
            qkv, spec.num_heads, spec.num_kv_heads, spec.head_dim, *weights, self.q_norm.eps,
            self.norm_unit_offset, self.pdl,
        )  # fmt: skip
        return super().split_qkv(qkv)


class GatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` with gate and up fused in one projection, ``gate_up_proj``.

    The decoder layer applies ``gate_up_proj`` together with the norm before it (:class:`PreNormLinear`),
    so ``forward`` takes the projection.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: GatedActivation) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = act
        self.act_and_down_proj = GatedActivationLinear(act, self.down_proj)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.act_and_down_proj(gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: LlamaAttention) -> None:
        super().__init__()
        self.self_attn = self_attn
        act = GATED_ACTIVATIONS[config.hidden_act]()
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        # Each norm runs with the projection after it, so that the two can run as one kernel.
        self.norm_qkv_proj = PreNormLinear(self.input_layernorm, self_attn.qkv_proj)
        self.norm_gate_up_proj = PreNormLinear(self.post_attention_layernorm, self.mlp.gate_up_proj)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on ``hidden + residual``; returns its output and the residual stream, which the next
        block's input norm adds (the first block has none yet)."""
        qkv, residual = self.norm_qkv_proj(hidden, residual)
        hidden = self.self_attn(positions, qkv)
        gate_up, residual = self.norm_gate_up_proj(hidden, residual)
        return self.mlp(gate_up), residual


class LlamaModel(FusableLayer):
    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention], max_positions: int) -> None:
        super().__init__()
        assert config.rope is not None
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls(config, i, rotary)) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.configure(KernelOptions())

    def configure(self, options: KernelOptions) -> None:
        """With ``gguf_decode_blocks`` (and GGUF-packed projections): decode steps through the blocks in
        one C call where every block is a plain Llama one (see ``quantization/gguf_decode_blocks.py``)."""
        self._decode_blocks: Any = None
        if options.gguf_packed and options.gguf_decode_blocks:
            self._decode_blocks = self._plain_blocks(options.gguf_activations)

    def _plain_blocks(self, activations: GGUFActivations) -> Any:
        from tokenmill.quantization.gguf_decode_blocks import DecodeBlocks

        first = self.layers[0]
        assert isinstance(first, LlamaDecoderLayer)
        rotary = first.self_attn.rotary_emb  # one table, shared by every block
        table = rotary.cos_sin_cache
        if tp_world_size() != 1 or not DecodeBlocks.available(activations) or table.dtype != torch.float32:
            return None
        if rotary.rotary_dim != first.self_attn.attn.spec.head_dim:
            return None
        blocks = [_plain_block(layer) for layer in self.layers]
        return None if any(b is None for b in blocks) else DecodeBlocks(blocks, table, activations)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        ran = None if self._decode_blocks is None else self._decode_blocks.run(positions, hidden)
        if ran is not None:
            hidden, residual = ran
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        out, _ = self.norm(hidden, residual)
        return out


class LlamaForCausalLM(CausalLM):
    stacked_params = FUSED_QKV_GATE_UP
    attention_cls: type[LlamaAttention] = LlamaAttention
    architecture_name = "LlamaForCausalLM"

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, self.attention_cls, max_positions or config.max_position_embeddings)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        return parse_llama_config(raw, source, str(raw.get("architectures", [cls.architecture_name])[0]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden


def _plain_block(layer: nn.Module) -> Any:
    """What the C decode loop needs of a plain Llama block (``BlockWeights``), or None for any other."""
    from tokenmill.quantization.gguf_decode_blocks import BlockWeights
    from tokenmill.quantization.gguf_method import single_packed_weight

    if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp.act_fn) is not SiluAndMul:
        return None
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    qkv, o, gate_up, down = (single_packed_weight(p) for p in projections)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    if any(p.local_bias() is not None for p in projections):
        return None
    if any(n.unit_offset or n.weight.dtype != torch.float32 for n in norms):
        return None
    return BlockWeights(norms[0].weight, norms[1].weight, norms[0].eps, qkv, o, gate_up, down, attn.attn.spec)
