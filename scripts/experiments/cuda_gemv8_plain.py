"""Exploration for issue 18: would a hand-written CUDA GEMV for 8-bit weights beat the Triton one?

Builds a small int8 GEMV in CUDA C++ (``torch.utils.cpp_extension.load_inline``: needs nvcc and ninja, as
the device image has) and times it beside ``tokenmill.kernels.gemv.gemv`` (the engine's Triton kernel and
its configs) on Llama-3.1-8B's batch-1 projection shapes, with no prologue. Each call of a timed graph reads
another copy of the weight, the copies together several times the L2, so the weights stream from memory
as in decode. Every variant is checked against float64.

The CUDA kernel: each warp takes ``R`` output rows; each lane reads 16 codes of a row per load (16-byte
streaming loads, ``U`` loads of each row in flight), turns them into floats with a byte permute and one
float subtraction (no int-to-float conversions, which run at 16 a clock per SM on Hopper), multiplies them
by the input read through the read-only cache, and the warp sums its lanes at the end. The kernel with
the engine's prologues fused is in reports/gpu/quantized-llama-3.1-8b/cuda-gemv8/cuda-gemv8.patch.

    PYTHONPATH=src python scripts/experiments/cuda_gemv8_plain.py   (from scripts/experiments, or with it
    on PYTHONPATH: it imports graph_timing.py)
"""

import functools

import torch
from graph_timing import graph_micros
from torch.utils.cpp_extension import load_inline

from tokenmill.kernels import gemv as triton_gemv

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <cuda_bf16.h>
#include <c10/cuda/CUDAStream.h>

__device__ __forceinline__ int4 load_streaming(const int8_t* p) {
    int4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

/* acc += sum_i code_i * x[i] for the four signed codes of `word`: 0x4B0000XX is the float 2^23 + XX, so
   with XX the code + 128 one subtraction of 2^23 + 128 gives the code exactly. */
__device__ __forceinline__ void dot4(float& acc, uint32_t word, const float* x) {
    uint32_t biased = word ^ 0x80808080u;
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        float code = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7650 + i)) - 8388736.0f;
        acc = fmaf(code, x[i], acc);
    }
}

__device__ __forceinline__ void widen16(uint4 a, uint4 b, float* x) {
    uint32_t v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        x[2 * i] = __uint_as_float(v[i] << 16);
        x[2 * i + 1] = __uint_as_float(v[i] & 0xffff0000u);
    }
}

template <int R, int U>
__global__ void __launch_bounds__(128) gemv_int8(const int8_t* __restrict__ w,
                                                 const __nv_bfloat16* __restrict__ x,
                                                 const float* __restrict__ scale,
                                                 __nv_bfloat16* __restrict__ y, int n, int k) {
    const int lane = threadIdx.x & 31;
    const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (row0 >= n) return;
    float acc[R];
    #pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (int k0 = lane * 16; k0 < k; k0 += 512 * U) {
        int4 codes[U][R];
        #pragma unroll
        for (int u = 0; u < U; u++)
            #pragma unroll
            for (int r = 0; r < R; r++)
                codes[u][r] = k0 + u * 512 < k ? load_streaming(w + (size_t)(row0 + r) * k + k0 + u * 512)
                                               : make_int4(0, 0, 0, 0);
        #pragma unroll
        for (int u = 0; u < U; u++) {
            int col = k0 + u * 512;
            if (col < k) {
                const uint4* xp = reinterpret_cast<const uint4*>(x + col);
                float xf[16];
                widen16(__ldg(xp), __ldg(xp + 1), xf);
                #pragma unroll
                for (int r = 0; r < R; r++) {
                    dot4(acc[r], (uint32_t)codes[u][r].x, xf);
                    dot4(acc[r], (uint32_t)codes[u][r].y, xf + 4);
                    dot4(acc[r], (uint32_t)codes[u][r].z, xf + 8);
                    dot4(acc[r], (uint32_t)codes[u][r].w, xf + 12);
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; r++) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < R; r++)
            if (row0 + r < n) y[row0 + r] = __float2bfloat16(acc[r] * scale[row0 + r]);
    }
}

template <int R, int U>
void launch(torch::Tensor w, torch::Tensor x, torch::Tensor scale, torch::Tensor y) {
    int n = w.size(0), k = w.size(1);
    int rows_per_block = 4 * R;
    dim3 grid((n + rows_per_block - 1) / rows_per_block);
    gemv_int8<R, U><<<grid, 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
        w.data_ptr<int8_t>(), reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>()),
        scale.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(y.data_ptr<at::BFloat16>()), n, k);
}

void gemv_int8_launch(torch::Tensor w, torch::Tensor x, torch::Tensor scale, torch::Tensor y, int64_t rows,
                      int64_t unroll) {
    TORCH_CHECK(w.size(1) % 16 == 0, "K must be a multiple of 16");
#define CASE(R, U) if (rows == R && unroll == U) return launch<R, U>(w, x, scale, y);
    CASE(1, 2) CASE(1, 4) CASE(1, 8) CASE(2, 2) CASE(2, 4)
    CASE(4, 1) CASE(4, 2) CASE(4, 4) CASE(8, 1) CASE(8, 2)
#undef CASE
    TORCH_CHECK(false, "no such variant");
}
"""
CPP_DECL = (
    "void gemv_int8_launch(torch::Tensor w, torch::Tensor x, torch::Tensor scale, torch::Tensor y, "
    "int64_t rows, int64_t unroll);"
)
VARIANTS = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2)]
SHAPES = {  # Llama-3.1-8B, one rank: (out, in)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
STREAM_BYTES = 512 * 2**20  # the weight copies of one timed graph: several times the 60 MB L2


def build() -> object:
    return load_inline(
        "tm_cuda_gemv8",
        cpp_sources=CPP_DECL,
        cuda_sources=CUDA_SOURCE,
        functions=["gemv_int8_launch"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "--use_fast_math"],
        verbose=False,
    )


def time_shape(ext: object, n: int, k: int) -> None:
    copies = max(2, min(32, STREAM_BYTES // (n * k)))
    weights = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(copies)]
    scale = torch.rand(n, device="cuda") / 64
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.double() @ weights[0].double().t()) * scale.double()
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def relerr(got: torch.Tensor) -> float:
        return float((got.double() - ref).norm() / ref.norm())

    triton_err = relerr(triton_gemv.gemv(x, weights[0], weight_scale=scale))
    micros = graph_micros(
        [functools.partial(triton_gemv.gemv, x, w, weight_scale=scale) for w in weights], 20
    )
    rate = n * k / micros / 1e3
    print(f"{n}x{k} triton (engine config) {micros:7.2f} us {rate:6.0f} GB/s err {triton_err:.1e}")
    results = []
    for rows, unroll in VARIANTS:
        ext.gemv_int8_launch(weights[0], x, scale, out, rows, unroll)  # type: ignore[attr-defined]
        err = relerr(out)
        launch = ext.gemv_int8_launch  # type: ignore[attr-defined]
        us = graph_micros([functools.partial(launch, w, x, scale, out, rows, unroll) for w in weights], 20)
        results.append((us, rows, unroll, err))
    for us, rows, unroll, err in sorted(results)[:4]:
        rate = n * k / us / 1e3
        print(f"  cuda R={rows} U={unroll} {us:7.2f} us {rate:6.0f} GB/s err {err:.1e}  ({micros / us:.2f}x)")


def main() -> None:
    ext = build()
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name, (n, k) in SHAPES.items():
        print(name, flush=True)
        time_shape(ext, n, k)


if __name__ == "__main__":
    main()
