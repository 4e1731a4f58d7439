"""The step before a packed GGUF projection, run inside the projection's C call: the RMSNorm (with the
residual add) before q/k/v and gate/up, or the gated activation before down_proj.

Both packed kernels take it, with one calling convention: the float kernel (``gguf_cpu_kernel.py``,
``gguf_linear_prologue``) forms the rows and multiplies them as they are, the int8 one
(``gguf_int8_kernel.py``, ``gguf_linear_int8``) forms them and rounds them to int8. One C call per
projection instead of a PyTorch norm or activation and a projection; and the C decode loop
(``gguf_decode_blocks.py``) calls the same functions, so its results are the layers' bit for bit.
"""

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

# The rows a projection multiplies, formed from the caller's rows: one C text both kernels include.
ROW_PROLOGUES = r"""
enum { PLAIN = 0, RMS_NORM = 1, SILU_GATE = 2, GELU_TANH_GATE = 3 };

/* The parameters of both kernels' fused functions (FUSED_ARGTYPES below). */
#define FUSED_LINEAR_PARAMS                                                                                \
    const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *scale, const void *offset,    \
        int64_t N, int group, int four_bit, int half, float *y, int threads, int prologue,                \
        const float *residual, float *sum_out, const float *norm_weight, float eps, int unit_offset

/* Columns [c0, c1) of the row: RMS_NORM: h = norm(x + residual) (residual may be NULL; its sum of squares
   is the whole row's, in one order whatever the columns); the gates: h = act(x[:K]) * x[K:2K]. Rounded as
   the PyTorch layers round (float32 throughout). The norm's sum x + residual is stored by store_sums, once
   every thread has read the row: the caller's residual may be the sum's own buffer. */
static void form_columns(int prologue, const float* x, int64_t K, int64_t c0, int64_t c1,
                         const float* residual, const float* norm_weight, float eps, int unit_offset,
                         float* h) {
    if (prologue == RMS_NORM) {
        float squares = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            float v = residual ? x[i] + residual[i] : x[i];
            squares += v * v;
        }
        float inverse = 1.0f / sqrtf(squares / (float)K + eps);
        for (int64_t i = c0; i < c1; i++) {
            float v = residual ? x[i] + residual[i] : x[i];
            h[i] = v * inverse * (unit_offset ? 1.0f + norm_weight[i] : norm_weight[i]);
        }
    } else if (prologue == SILU_GATE) {
        for (int64_t i = c0; i < c1; i++) h[i] = x[i] / (1.0f + expf(-x[i])) * x[K + i];
    } else {
        const float root = 0.7978845608028654f;  /* sqrt(2 / pi) */
        for (int64_t i = c0; i < c1; i++) {
            float g = x[i];
            h[i] = 0.5f * g * (1.0f + tanhf(root * (g + 0.044715f * g * g * g))) * x[K + i];
        }
    }
}

/* Columns [c0, c1) of RMS_NORM's sum: sum_out = x + residual. */
static void store_sums(const float* x, int64_t c0, int64_t c1, const float* residual, float* sum_out) {
    for (int64_t i = c0; i < c1; i++) sum_out[i] = residual ? x[i] + residual[i] : x[i];
}

/* Thread t of count's share of forming M rows of K columns: whole rows [*m0, *m1) when there are as many
   rows as threads, else blocks of 32 columns [*c0, *c1) of every row (one decode row's norm or activation
   would otherwise keep the other threads waiting). The caller waits for every share before reading the
   rows or storing the sums. */
static void prologue_share(int64_t M, int64_t K, int64_t t, int64_t count, int64_t* m0, int64_t* m1,
                           int64_t* c0, int64_t* c1) {
    if (M >= count) {
        *m0 = M * t / count, *m1 = M * (t + 1) / count, *c0 = 0, *c1 = K;
    } else {
        int64_t blocks = K / 32;
        *m0 = 0, *m1 = M, *c0 = 32 * (blocks * t / count), *c1 = 32 * (blocks * (t + 1) / count);
    }
}
"""

# The prologues (the C enum above).
PLAIN, RMS_NORM, SILU_GATE, GELU_TANH_GATE = 0, 1, 2, 3
GATE_PROLOGUES = {"silu": SILU_GATE, "gelu_tanh": GELU_TANH_GATE}

_P, _I, _FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# x, M, K, codes, scale, offset, N, group, four_bit, half, y, threads, prologue, residual, sum_out,
# norm_weight, eps, unit_offset: the signature of both kernels' fused functions.
FUSED_ARGTYPES: list[Any] = [_P, _I, _I, _P, _P, _P, _I, _FLAG, _FLAG, _FLAG, _P, _FLAG, _FLAG, _P, _P, _P,
                  ctypes.c_float, _FLAG]  # fmt: skip


@dataclass(frozen=True)
class NormPrologue:
    """An RMSNorm before the projection: ``norm(x + residual)`` (no residual: ``norm(x)``)."""

    weight: torch.Tensor  # float32 [K]
    eps: float
    unit_offset: bool  # the scale is 1 + weight (Gemma)
    residual: torch.Tensor | None


def _check_shapes(
    x: torch.Tensor, cols: int, prologue: int | NormPrologue, norm: NormPrologue | None
) -> None:
    """The C loop reads what the weight's shape says: refuse inputs of another shape before it runs."""
    width = 2 * cols if prologue in GATE_PROLOGUES.values() else cols
    if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(
            f"input of shape {tuple(x.shape)} ({x.dtype}); the weight takes [rows, {width}] float32"
        )
    if norm is None:
        return
    if norm.weight.shape != (cols,) or norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
        raise ValueError(
            f"norm weight of shape {tuple(norm.weight.shape)}; the projection takes [{cols}] float32"
        )
    if norm.residual is not None and norm.residual.shape != x.shape:
        raise ValueError(f"residual of shape {tuple(norm.residual.shape)} beside input {tuple(x.shape)}")


def run_fused(
    function: Any,
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    prologue: int | NormPrologue = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[M, N]`` products of the rows formed from contiguous float32 ``x`` by ``prologue`` (``[M, K]``
    for PLAIN and a norm, ``[M, 2K]`` for a gate) with the packed weight, by ``function`` (one of the
    kernels' fused functions); and for a norm, ``x + residual`` (else None)."""
    rows = x.shape[0]
    cols = codes.shape[1] * group
    norm = prologue if isinstance(prologue, NormPrologue) else None
    _check_shapes(x, cols, prologue, norm)
    out = torch.empty(rows, codes.shape[0], dtype=torch.float32)
    total = torch.empty(rows, cols, dtype=torch.float32) if norm is not None else None
    residual = None if norm is None or norm.residual is None else norm.residual.float().contiguous()
    status = function(
        x.data_ptr(), rows, cols, codes.data_ptr(), scale.data_ptr(),
        None if offset is None else offset.data_ptr(), codes.shape[0], group,
        int(codes.dtype == torch.uint8), int(scale.dtype == torch.float16), out.data_ptr(),
        torch.get_num_threads(), RMS_NORM if norm is not None else prologue,
        None if residual is None else residual.data_ptr(), None if total is None else total.data_ptr(),
        None if norm is None else norm.weight.data_ptr(), 0.0 if norm is None else norm.eps,
        int(norm is not None and norm.unit_offset),
    )  # fmt: skip
    if status == 2:
        raise MemoryError("the packed GGUF kernel could not allocate its scratch buffers")
    if status != 0:
        raise ValueError(f"the packed GGUF kernel has no {codes.dtype} variant with groups of {group}")
    return out, total
