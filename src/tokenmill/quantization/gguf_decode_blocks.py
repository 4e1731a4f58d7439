"""A decode step through every Llama block of a packed GGUF model in one C call (``gguf_decode_blocks``).

At batch 1 of SmolLM2 the C kernels of a step (121 int8 projections, 30 attentions) take ~7 ms and the
Python around them another ~4: each block is eight module calls, five ctypes calls with their argument
conversions, views and output allocations. This call runs the blocks' sequence in C, calling the very
same kernels with the same arguments in the same order (the projection function the layers call, with
its norm and SwiGLU prologues: ``gguf_linear_prologue`` for float32 inputs, ``gguf_linear_int16`` /
``gguf_linear_int8`` for integer ones, as ``gguf_activations`` says; the decode attention of
``attention/cpu_kernel.py``; reached through function pointers), so its results are the Python path's
bit for bit.

It takes plain Llama blocks only (no biases, no q/k norms, SwiGLU, unsharded, every projection one packed
weight, whole-head rotary in a float32 table) in steps the C attention takes (up to 16 new tokens per
sequence, float32 paged pools) and, with float32 inputs, of fewer than ``DEQUANTIZED_MIN_ROWS`` rows (more
go to BLAS in the Python loop); the model runs its Python loop otherwise.
"""

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from tokenmill.attention.backend import AttentionLayer
from tokenmill.attention.cpu_backend import CpuAttentionBackend, decode_arrays, runs_in_c
from tokenmill.attention.cpu_kernel import load_decode_attention
from tokenmill.attention.forward_context import get_forward_context
from tokenmill.config import GGUFActivations
from tokenmill.native import compile_library
from tokenmill.quantization.gguf_packed import DEQUANTIZED_MIN_ROWS, PackedWeight, fused_kernel
from tokenmill.quantization.gguf_prologue import RMS_NORM, SILU_GATE

_SOURCE = r"""
#include <stdint.h>

typedef int (*linear_fn)(const float*, int64_t, int64_t, const void*, const void*, const void*, int64_t,
                         int, int, int, float*, int, int, const float*, float*, const float*, float, int);
typedef int (*attention_fn)(const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                            int64_t, int64_t, int64_t, const float*, const int64_t*, float*, float*,
                            int64_t, const int64_t*, const int32_t*, int64_t, const int32_t*, float,
                            int64_t, float*, int);

typedef struct {
    const void* codes; const void* scale; const void* offset;
    int64_t out_features, in_features, group, four_bit, half;
} Projection;

typedef struct {
    Projection qkv, o, gate_up, down;
    const float* input_norm; const float* post_norm; double eps;
    int64_t heads, kv_heads, head_dim, window; double scale;
    float* key_pool; float* value_pool; int64_t block_size;
} Block;

typedef struct {
    int64_t rows, threads, norm_prologue, gate_prologue;
    const float* cos_sin; const int64_t* positions; const int64_t* slots; const int32_t* tables;
    int64_t table_width; const int32_t* seq_lens;
    linear_fn linear; attention_fn attend;
    float* qkv; float* attention; float* attention_out; float* gate_up; float* hidden[2];
} Step;

static int project(const Step* s, const Projection* p, const float* x, float* y, int prologue,
                   const float* residual, float* sum_out, const float* norm, double eps) {
    return s->linear(x, s->rows, p->in_features, p->codes, p->scale, p->offset, p->out_features,
                     (int)p->group, (int)p->four_bit, (int)p->half, y, (int)s->threads, prologue, residual,
                     sum_out, norm, (float)eps, 0);
}

/* Blocks [0, count) on the embeddings: block i writes its output to hidden[i % 2]; residual holds the
   residual stream (the first block's input norm stores the embeddings there). 0, or the first failing
   kernel's status (attention's plus 10). */
int llama_decode_blocks(const Block* blocks, int64_t count, const Step* s, const float* embeddings,
                        float* residual) {
    const float* hidden = embeddings;
    for (int64_t i = 0; i < count; i++) {
        const Block* b = blocks + i;
        int status = project(s, &b->qkv, hidden, s->qkv, (int)s->norm_prologue, i ? residual : 0, residual,
                             b->input_norm, b->eps);
        if (status) return status;
        int64_t width = (b->heads + 2 * b->kv_heads) * b->head_dim;
        const float* q = s->qkv;
        const float* k = q + b->heads * b->head_dim;
        const float* v = k + b->kv_heads * b->head_dim;
        status = s->attend(q, width, k, width, v, width, s->rows, b->heads, b->kv_heads, b->head_dim,
                           s->cos_sin, s->positions, b->key_pool, b->value_pool, b->block_size, s->slots,
                           s->tables, s->table_width, s->seq_lens, (float)b->scale, b->window,
                           s->attention, (int)s->threads);
        if (status) return 10 + status;
        status = project(s, &b->o, s->attention, s->attention_out, 0, 0, 0, 0, 0.0);
        if (status) return status;
        status = project(s, &b->gate_up, s->attention_out, s->gate_up, (int)s->norm_prologue, residual,
                         residual, b->post_norm, b->eps);
        if (status) return status;
        status = project(s, &b->down, s->gate_up, s->hidden[i % 2], (int)s->gate_prologue, 0, 0, 0, 0.0);
        if (status) return status;
        hidden = s->hidden[i % 2];
    }
    return 0;
}
"""

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Projection(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("offset", _P), ("out_features", _I), ("in_features", _I),
                ("group", _I), ("four_bit", _I), ("half", _I)]  # fmt: skip


class _Block(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection),
                ("input_norm", _P), ("post_norm", _P), ("eps", _D), ("heads", _I), ("kv_heads", _I),
                ("head_dim", _I), ("window", _I), ("scale", _D), ("key_pool", _P), ("value_pool", _P),
                ("block_size", _I)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I), ("threads", _I), ("norm_prologue", _I), ("gate_prologue", _I),
                ("cos_sin", _P), ("positions", _P), ("slots", _P), ("tables", _P), ("table_width", _I),
                ("seq_lens", _P), ("linear", _P), ("attend", _P), ("qkv", _P), ("attention", _P),
                ("attention_out", _P), ("gate_up", _P), ("hidden", _P * 2)]  # fmt: skip


@dataclass(frozen=True)
class BlockWeights:
    """What one plain Llama block hands the C loop (the model checks that the block is one)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    spec: AttentionLayer


@cache
def _load_library() -> ctypes.CDLL | None:
    library = compile_library("gguf_decode_blocks", _SOURCE)
    if library is None:
        return None
    library.llama_decode_blocks.restype = ctypes.c_int
    library.llama_decode_blocks.argtypes = [_P, _I, _P, _P, _P]
    return library


def _projection(weight: PackedWeight) -> _Projection:
    offset = None if weight.offset is None else weight.offset.data_ptr()
    return _Projection(weight.codes.data_ptr(), weight.scale.data_ptr(), offset, weight.out_features,
                       weight.in_features, weight.group, int(weight.four_bit),
                       int(weight.scale.dtype == torch.float16))  # fmt: skip


class DecodeBlocks:
    """The C decode loop over a model's blocks; :meth:`run` returns None for steps it does not take."""

    def __init__(
        self, blocks: list[BlockWeights], cos_sin: torch.Tensor, activations: GGUFActivations
    ) -> None:
        self.blocks = blocks
        self.cos_sin = cos_sin.contiguous()
        self.activations = activations
        # the functions the loop calls (the projection the layers' fused path calls), resolved once
        linear, attend = fused_kernel(activations), load_decode_attention()
        assert linear is not None and attend is not None  # the model checked available() first
        self._linear = ctypes.cast(linear, _P).value
        self._attend = ctypes.cast(attend.decode_attention, _P).value
        self._pools: tuple[int, ...] = ()  # the KV pools the structures point into
        self._structs: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "DecodeBlocks":
        # ctypes structures are rebuilt, not copied
        return DecodeBlocks(self.blocks, self.cos_sin, self.activations)

    @staticmethod
    def available(activations: GGUFActivations) -> bool:
        kernels = (_load_library(), fused_kernel(activations), load_decode_attention())
        return all(kernel is not None for kernel in kernels)

    def run(
        self, positions: torch.Tensor, embeddings: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every block, or None where the step is not one the C loop takes."""
        ctx = get_forward_context()
        caches, metadata = ctx.kv_caches, ctx.metadata
        if not isinstance(ctx.backend, CpuAttentionBackend) or caches is None:
            return None
        if len(caches) != len(self.blocks):  # a pool for each block, no more, no fewer
            return None
        if embeddings.dtype != torch.float32 or embeddings.dim() != 2:
            return None
        if self.activations == "float32" and embeddings.shape[0] >= DEQUANTIZED_MIN_ROWS:
            return None
        width = self.blocks[0].qkv.out_features
        probe = embeddings.new_empty(embeddings.shape[0], width)
        spec = self.blocks[0].spec
        views = probe.view(-1, width // spec.head_dim, spec.head_dim)  # heads laid out as the kernel reads
        if not runs_in_c(views, views, views, metadata, caches[0]):
            return None
        blocks = self._bind(caches)
        rows = embeddings.shape[0]
        arrays = decode_arrays(metadata)
        hidden = [torch.empty_like(embeddings), torch.empty_like(embeddings)]
        residual = torch.empty_like(embeddings)
        scratch = {
            "qkv": probe,
            "attention": embeddings.new_empty(rows, spec.num_heads * spec.head_dim),
            "attention_out": torch.empty_like(embeddings),
            "gate_up": embeddings.new_empty(rows, self.blocks[0].gate_up.out_features),
        }
        positions = positions.to(torch.int64).contiguous()
        step = _Step(
            rows, torch.get_num_threads(), RMS_NORM, SILU_GATE, self.cos_sin.data_ptr(), positions.data_ptr(),
            arrays.slots.data_ptr(), arrays.tables.data_ptr(), arrays.tables.shape[1],
            arrays.seq_lens.data_ptr(), self._linear, self._attend,
            *(tensor.data_ptr() for tensor in scratch.values()), (_P * 2)(*(h.data_ptr() for h in hidden)),
        )  # fmt: skip
        embeddings = embeddings.contiguous()
        library = _load_library()
        assert library is not None
        status = library.llama_decode_blocks(
            ctypes.addressof(blocks),
            len(self.blocks),
            ctypes.addressof(step),
            embeddings.data_ptr(),
            residual.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"the C decode blocks failed with status {status}")
        return hidden[(len(self.blocks) - 1) % 2], residual

    def _bind(self, caches: Any) -> Any:
        """The blocks' structures, rebuilt when the KV pools they point into are not the ones bound."""
        pools = tuple(ptr for cache in caches for ptr in (cache.key.data_ptr(), cache.value.data_ptr()))
        if pools != self._pools:
            structs = (_Block * len(self.blocks))()
            for i, (block, cache) in enumerate(zip(self.blocks, caches, strict=True)):
                spec = block.spec
                structs[i] = _Block(
                    _projection(block.qkv), _projection(block.o), _projection(block.gate_up),
                    _projection(block.down), block.input_norm.data_ptr(), block.post_norm.data_ptr(),
                    block.eps, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.sliding_window or 0,
                    spec.scale, cache.key.data_ptr(), cache.value.data_ptr(), cache.block_size,
                )  # fmt: skip
            self._structs, self._pools = structs, pools
        return self._structs
