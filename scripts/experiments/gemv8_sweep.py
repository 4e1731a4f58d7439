"""Batch-1 GEMV with 8-bit weights (int8 / float8 e4m3, float32 scale per output row): tokenmill's CUDA-core
kernel against tensor-core and packed-asm-conversion variants, at Llama-3.1-8B's one-row shapes.

    python scripts/experiments/gemv8_sweep.py                         # GPU: all variants, int8 and fp8 (~3 min)
    python scripts/experiments/gemv8_sweep.py --variants tc_asm --dtypes int8 --verbose
    python scripts/experiments/gemv8_sweep.py --tiny                  # CPU: TRITON_INTERPRET=1, math only, tiny shapes
                                   (the interpreter gets int8->bf16 and bf16 dots wrong: tc_native dots in fp32
                                    there; inline asm does not run there: those variants are skipped)
    python scripts/experiments/gemv8_sweep.py --sm90-compile          # no GPU: compile every kernel for sm_90 (ptxas), SASS mix
    (scripts/experiments/gemv8_emulate_asm.py emulates the packed PTX bit tricks on CPU for every code and lane)

Variants (all y = x W^T * scale, x [1, K] bf16, W [N, K] 8-bit, y [1, N] bf16, float32 accumulation):
  baseline       tokenmill.kernels.gemv.gemv(x, w, weight_scale=s, out_dtype=bf16[, config=...]), no PDL
                 (as none of the variants here); 'default' = the engine's config (8, 1024, 4, 2)
  tc_native      tensor cores: x repeated into a 16-row tile, W tile converted with .to(tl.bfloat16), tl.dot
  tc_native_f16  the same with .to(tl.float16) (x converted to fp16)
  tc_asm         the same with the W conversion in packed inline PTX (int8: PRMT + HSUB2 magic number;
                 e4m3: cvt.rn.f16x2.e4m3x2), x in fp16
  tc_asm_bf16    bf16 tensor cores, packed PTX without conversion instructions (int8: PRMT into 0x43xx lanes,
                 two masks and a bf16x2 subtract; e4m3: sign-extending PRMT, shift, mask, times 2^120), x stays
                 bf16: no x conversion, which the fp16 variants redo per warp with slow F2F.F16.BF16
  cuda_core_asm  tokenmill's CUDA-core loop (products tile, one sum at the end) with the packed asm conversion
  bf16           (context, not in the default list) tokenmill's gemv on a bfloat16 copy of the weights

fp16 range risk (tc_native_f16, tc_asm, cuda_core_asm 'f16' mode): the weights convert to fp16 exactly (int8 and
every e4m3 value are fp16 values), but x is rounded from bf16 to fp16: |x| > 65504 becomes inf (bf16 reaches
3.4e38) and |x| < 6.1e-5 loses bits as an fp16 subnormal (below 6e-8 it flushes to 0). Llama's post-norm
activations and SwiGLU outputs are normally far below 65504, but outlier features of a few thousand exist; a
production kernel would need a guard (e.g. scale x by a power of two chosen per token, undone in the row scale).
Products and sums are float32 in the tensor cores (mma f32 accumulate), so only x's own range matters there.

Tensor-core layouts ('orient' in a config):
  xw: tl.dot(x16 [16, BK], trans(W16) [BK, BN]) -> [16, BN]; M = 16 (mma.sync m16n8k16), BN 32-128
  wx: tl.dot(W16 [BN, BK], x16^T [BK, 16]) -> [BN, 16]; M = BN >= 64 lets Triton use wgmma with W as operand A
x is repeated in all 16 rows (no select for zero padding); every output row/column is then the same and only
row/column 0 is stored. Configs print as 'xw bn64 bk256 w4 s3 k4' (orient, BLOCK_N, BLOCK_K, warps,
stages, K splits; k0 = the auto split, in the 'one config for every shape' lines). Split-K (grid dim 1) adds float32 partials atomically into a workspace; the last
program of each block of rows (a ticket counter) reads the sums back (atomic add of 0), zeroes them,
stores bf16 and resets its counter: one launch, no memset, the workspace is clean for the next call.
"""

import argparse
import math
import os
import sys
import time
import traceback
import zlib

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

try:
    from tokenmill.kernels.gemv import GemvConfig
    from tokenmill.kernels.gemv import gemv as tokenmill_gemv

    _TOKENMILL_ERROR = None
except Exception as exc:  # reported per variant; the others still run
    tokenmill_gemv = None
    _TOKENMILL_ERROR = f"{type(exc).__name__}: {exc}"

    class GemvConfig(tuple):  # type: ignore[no-redef]
        def __new__(cls, *a):
            return tuple.__new__(cls, a)


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FAIL_REL_ERR = 2e-2

# Llama-3.1-8B one-row projections: name -> (N, K)
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
TINY_SHAPES = {"even": (64, 256), "ragged": (80, 384)}
TINY_PER_TOKEN = {"even": 1, "ragged": 1}


# ----------------------------------------------------------------------------------------------------------
# Conversions
# ----------------------------------------------------------------------------------------------------------

# int8 -> fp16, 4 weights a call. Triton packs the 4 int8 elements into one 32-bit register ($2, element i
# in byte i) and takes the 4 fp16 results from two 32-bit registers ($0 = elements 0, 1; $1 = elements 2, 3;
# in each the lower element in the low 16 bits).
#   xor  : u_i = v_i ^ 0x80 = v_i + 128 as an unsigned byte (0..255), all 4 bytes at once
#   prmt : d = bytes of {b, a} picked by the selector's nibbles (byte 0..3 = a = u, 4..7 = b = 0x64646464);
#          0x4140 gives bytes (u0, 0x64, u1, 0x64): the fp16 pair (0x64u0, 0x64u1). 0x64xx is the fp16
#          with exponent 25 (2^10) and the 10-bit mantissa xx: 1024 + u, exactly. 0x4342 does bytes 2, 3.
#   sub  : (1024 + u) - 1152 = v, exact (1152 = 0x6480; every integer below 2048 is an fp16).
# Operands are registers (constants moved in first). $2 is read once, before $0/$1 are written, so the
# asm is right even where the register allocator gives an output the input's register.
_INT8_TO_F16_ASM = tl.constexpr("""{
.reg .b32 u, hi, k;
xor.b32 u, $2, 0x80808080;
mov.b32 hi, 0x64646464;
prmt.b32 $0, u, hi, 0x4140;
prmt.b32 $1, u, hi, 0x4342;
mov.b32 k, 0x64806480;
sub.rn.f16x2 $0, $0, k;
sub.rn.f16x2 $1, $1, k;
}""")

# float8 e4m3 -> fp16, 4 weights a call (sm_89+). cvt.rn.f16x2.e4m3x2 takes a .b16 holding two e4m3
# values and gives an f16x2 whose low half is the low byte's value and high half the high byte's (exact:
# every e4m3 value, subnormals included, is an fp16). mov.b32 {lo, hi} splits $2 into its low 16 bits
# (elements 0, 1) and high 16 bits (elements 2, 3). NaN codes (0x7F, 0xFF) give NaN.
_E4M3_TO_F16_ASM = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")

# int8 -> float32 bit patterns, 4 weights a call: bytes (u_i, 0x00, 0x00, 0x4B) are the float 2^23 + u_i;
# the caller bitcasts and subtracts 2^23 + 128. prmt's b = 0x4B000000 puts 00, 00, 00, 4B in bytes 4..7;
# selector 0x754i = bytes (i, 4, 5, 7). One PRMT per weight replaces tokenmill's sign extension + IADD.
_INT8_TO_F32_BITS_ASM = tl.constexpr("""{
.reg .b32 u, m;
xor.b32 u, $4, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 $0, u, m, 0x7540;
prmt.b32 $1, u, m, 0x7541;
prmt.b32 $2, u, m, 0x7542;
prmt.b32 $3, u, m, 0x7543;
}""")


# int8 / e4m3 -> bfloat16, 4 weights a call: the engine's own conversion (kernels/gemv_tensor_core.py,
# where each step of its packed PTX is explained), so the sweep times what the engine runs.
from tokenmill.kernels.gemv_tensor_core import _converted as _engine_converted  # noqa: E402


@triton.jit
def _asm_to_f16(w):
    """An int8 or float8e4nv tile as fp16, through the packed PTX above."""
    if w.dtype == tl.int8:
        return tl.inline_asm_elementwise(
            asm=_INT8_TO_F16_ASM, constraints="=r,=r,r", args=[w], dtype=tl.float16, is_pure=True, pack=4
        )
    else:
        bits = w.to(tl.int8, bitcast=True)
        return tl.inline_asm_elementwise(
            asm=_E4M3_TO_F16_ASM, constraints="=r,=r,r", args=[bits], dtype=tl.float16, is_pure=True, pack=4
        )


@triton.jit
def _asm_to_f32(w, MODE: tl.constexpr):
    """MODE 0: int8 through PRMT straight to float32 bits (fp8: as MODE 1); MODE 1: asm to fp16, then fp32."""
    if MODE == 0 and w.dtype == tl.int8:
        bits = tl.inline_asm_elementwise(
            asm=_INT8_TO_F32_BITS_ASM,
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        )
        return bits.to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
    else:
        return _asm_to_f16(w).to(tl.float32)


@triton.jit
def _to_mma_dtype(w, CVT: tl.constexpr, INTERP: tl.constexpr):
    if CVT == 0:
        if INTERP:  # the CPU interpreter gets int8 -> bf16 and bf16 dots wrong: float32 (the same values)
            return w.to(tl.float32)
        return w.to(tl.bfloat16)
    elif CVT == 1:
        return w.to(tl.float16)
    elif CVT == 2:
        return _asm_to_f16(w)
    else:
        return _engine_converted(w, tl.bfloat16, True)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["k_per_split", "num_splits"])
def _tc_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    ws_ptr,  # float32 [N], zero between calls (split-K partial sums)
    count_ptr,  # int32 [cdiv(N, BLOCK_N)], zero between calls (split-K tickets)
    N,
    K,
    stride_w,
    k_per_split,  # a multiple of BLOCK_K
    num_splits,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CVT: tl.constexpr,  # 0: .to(bf16); 1: .to(fp16); 2: packed asm to fp16; 3: packed asm to bf16
    W_AS_A: tl.constexpr,  # False: dot(x16 [16, BK], W^T) ("xw"); True: dot(W [BN, BK], x16^T) ("wx")
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % k_per_split == 0: no masks
    INTERP: tl.constexpr = False,  # TRITON_INTERPRET=1 (CPU check only)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)  # else the loads would not be vectorized
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + k_lo + offs_k
    pad = tl.arange(0, 16)
    if W_AS_A:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    else:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            col_ok = (k + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=col_ok, other=0.0)
        w16 = _to_mma_dtype(w, CVT, INTERP)
        x16 = x.to(w16.dtype)
        if W_AS_A:
            acc = tl.dot(w16, tl.broadcast_to(x16[:, None], (BLOCK_K, 16)), acc)
        else:
            acc = tl.dot(tl.broadcast_to(x16[None, :], (16, BLOCK_K)), tl.trans(w16), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    # every row (xw) / column (wx) of acc holds the same sums: keep the first
    if W_AS_A:
        y = acc * scale[:, None]
        offs = rows[:, None] + 0 * pad[None, :]
        keep = row_ok[:, None] & (pad[None, :] == 0)
    else:
        y = acc * scale[None, :]
        offs = rows[None, :] + 0 * pad[:, None]
        keep = row_ok[None, :] & (pad[:, None] == 0)
    if num_splits == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.atomic_add(ws_ptr + offs, y, mask=keep, sem="relaxed")
        tl.debug_barrier()  # all threads' partial sums issued before the ticket (released with it)
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of these rows: the sums are complete
            # read the sums at L2 (an atomic add of 0), then zero them for the next call (a plain store: the
            # next call's adds come after this kernel ends); the interpreter has no float atomic_xchg
            total = tl.atomic_add(ws_ptr + rows, tl.zeros([BLOCK_N], dtype=tl.float32), mask=row_ok, sem="acquire")
            tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)
            tl.store(ws_ptr + rows, tl.zeros([BLOCK_N], dtype=tl.float32), mask=row_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _cc_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0 (the prefetch past K stays masked)
):
    """CUDA-core GEMV: a [BLOCK_N, BLOCK_K] float32 products tile summed once at the end; the next weight
    tile is loaded before this one is used (as tokenmill's loop does)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    offs = tl.arange(0, BLOCK_K)
    w = tl.load(
        w_rows + offs[None, :], mask=row_ok[:, None] & (offs < K)[None, :], other=0.0, eviction_policy="evict_first"
    )
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + offs
        if EVEN:
            x = tl.load(x_ptr + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += _asm_to_f32(w, MODE) * x[None, :]
        nxt = cols + BLOCK_K  # one tile ahead; past the last column the mask reads nothing
        w = tl.load(
            w_rows + nxt[None, :],
            mask=row_ok[:, None] & (nxt < K)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    out = tl.sum(acc, axis=1) * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# Variants: configs and launches
# ----------------------------------------------------------------------------------------------------------


class TcConfig(tuple):
    """(orient, block_n, block_k, num_warps, num_stages, split) with split 0 = auto."""

    def __new__(cls, orient, bn, bk, warps, stages, split=0):
        return tuple.__new__(cls, (orient, bn, bk, warps, stages, split))

    def with_split(self, split):
        return TcConfig(*self[:5], split)

    def __str__(self):
        o, bn, bk, w, s, k = self
        return f"{o} bn{bn} bk{bk} w{w} s{s} k{k}"


class CcConfig(tuple):
    def __new__(cls, bn, bk, warps, stages, mode):
        return tuple.__new__(cls, (bn, bk, warps, stages, mode))

    def __str__(self):
        bn, bk, w, s, m = self
        return f"bn{bn} bk{bk} w{w} s{s} {'prmt-f32' if m == 0 else 'f16-f32'}"


# xw: Triton lays the M = 16 tile's warps along N (warpsPerCTA [1, warps]), so each warp does BN / 8 / warps
# mma n-tiles per k-step, and the x operand (its fp16 conversion, for the fp16 variants) is redone per warp:
# more n-tiles per warp amortize it. wx: the W tile is wgmma's register operand A; keep BN * BK / threads
# small (<= 64 fp16 registers) or it spills.
TC_CONFIGS = [
    TcConfig("xw", 32, 512, 4, 3),
    TcConfig("xw", 64, 256, 4, 3),
    TcConfig("xw", 64, 512, 4, 3),
    TcConfig("xw", 128, 256, 4, 3),
    TcConfig("xw", 32, 512, 2, 4),
    TcConfig("xw", 128, 256, 8, 3),
    TcConfig("wx", 64, 128, 4, 4),
    TcConfig("wx", 128, 128, 8, 4),
]
TC_CONFIGS_QUICK = [TC_CONFIGS[1], TC_CONFIGS[3], TC_CONFIGS[6]]
TC_CONFIGS_TINY = [
    TcConfig("xw", 16, 128, 4, 2),
    TcConfig("xw", 32, 64, 4, 2, 2),
    TcConfig("wx", 64, 128, 4, 2),
    TcConfig("wx", 64, 64, 4, 2, 3),
]
CC_CONFIGS = [CcConfig(8, 1024, 4, 2, 0), CcConfig(8, 1024, 4, 2, 1), CcConfig(16, 1024, 8, 2, 0)]
CC_CONFIGS_TINY = [CcConfig(8, 128, 4, 1, 0), CcConfig(16, 64, 4, 1, 1)]
BASE_CONFIGS = [("default", None), (4, 1024, 4, 2), (16, 1024, 4, 2)]
BASE_CONFIGS_TINY = [("default", None), (4, 128, 4, 1)]


class Ctx:
    """Per-run state: workspaces for split-K, the SM count."""

    def __init__(self, device, target_programs):
        self.device = device
        self.target_programs = target_programs
        self.buffers = {}

    def split_ws(self, key, n, n_blocks):
        if key not in self.buffers:
            self.buffers[key] = (
                torch.zeros(n, dtype=torch.float32, device=self.device),
                torch.zeros(n_blocks, dtype=torch.int32, device=self.device),
            )
        return self.buffers[key]


def auto_split(n_blocks, k_steps, target):
    """Smallest power of two of K splits giving at least `target` programs, at least 2 steps per split."""
    split = 1
    while n_blocks * split < target and split * 2 <= max(1, k_steps // 2) and split < 16:
        split *= 2
    return split


def tc_configs_for(shape, configs, ctx):
    """Each config with its splits: the auto split, and 1 unless that leaves fewer than ~1 program per SM;
    explicit splits (tiny mode) kept."""
    n, k = shape
    out = []
    for cfg in configs:
        if cfg[5]:
            out.append(cfg)
            continue
        n_blocks = triton.cdiv(n, cfg[1])
        s = auto_split(n_blocks, k // cfg[2], ctx.target_programs)
        if s == 1 or n_blocks >= ctx.target_programs // 2:  # without a split, at least ~one program per SM
            out.append(cfg.with_split(1))
        if s > 1:
            out.append(cfg.with_split(s))
    return out


def make_tc_launch(cvt):
    def launch(x, w, s, out, cfg, ctx, key):
        orient, bn, bk, warps, stages, split = cfg
        n, k = w.shape
        n_blocks = triton.cdiv(n, bn)
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
        splits = triton.cdiv(k, k_per)
        even = n % bn == 0 and k % k_per == 0
        ws, count = ctx.split_ws((key, cfg, n), n, n_blocks)  # typed buffers even when unused (k=1)
        _tc_gemv_kernel[(n_blocks, splits)](
            x,
            w,
            s,
            out,
            ws,
            count,
            n,
            k,
            w.stride(0),
            k_per,
            splits,
            BLOCK_N=bn,
            BLOCK_K=bk,
            CVT=cvt,
            W_AS_A=orient == "wx",
            EVEN=even,
            INTERP=INTERPRET,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    return launch


def cc_launch(x, w, s, out, cfg, ctx, key):
    bn, bk, warps, stages, mode = cfg
    n, k = w.shape
    _cc_gemv_kernel[(triton.cdiv(n, bn),)](
        x,
        w,
        s,
        out,
        n,
        k,
        w.stride(0),
        BLOCK_N=bn,
        BLOCK_K=bk,
        MODE=mode,
        EVEN=n % bn == 0 and k % bk == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def base_launch(x, w, s, out, cfg, ctx, key):
    if tokenmill_gemv is None:
        raise RuntimeError(f"cannot import tokenmill.kernels.gemv: {_TOKENMILL_ERROR}")
    config = None if cfg[0] == "default" else GemvConfig(*cfg)
    return tokenmill_gemv(x, w, config=config, out_dtype=torch.bfloat16, weight_scale=s)


def bf16_launch(x, w, s, out, cfg, ctx, key):
    if tokenmill_gemv is None:
        raise RuntimeError(f"cannot import tokenmill.kernels.gemv: {_TOKENMILL_ERROR}")
    config = None if cfg[0] == "default" else GemvConfig(*cfg)
    return tokenmill_gemv(x, w, config=config)


class Variant:
    def __init__(self, name, launch, configs, tiny_configs, needs_asm, expand=None, weights="8bit"):
        self.name = name
        self.launch = launch
        self.configs = configs
        self.tiny_configs = tiny_configs
        self.needs_asm = needs_asm
        self.expand = expand  # per-shape config list (splits)
        self.weights = weights
        self.nbytes = 2 if weights == "bf16" else 1  # bytes per weight, for GB/s

    def configs_for(self, shape, dtype, ctx, tiny, quick):
        cfgs = self.tiny_configs if tiny else self.configs
        if quick and not tiny:
            cfgs = {"tc": TC_CONFIGS_QUICK}.get(self.expand, cfgs[:2])
        if dtype == "fp8" and self.name == "cuda_core_asm":
            cfgs = [c for c in cfgs if c[4] == 1] or cfgs  # MODE 0 is int8 only (fp8 takes the f16 path)
        if self.expand == "tc":
            cfgs = tc_configs_for(shape, cfgs, ctx)
        return cfgs


VARIANTS = {
    "baseline": Variant("baseline", base_launch, BASE_CONFIGS, BASE_CONFIGS_TINY, False),
    "tc_native": Variant("tc_native", make_tc_launch(0), TC_CONFIGS, TC_CONFIGS_TINY, False, "tc"),
    "tc_native_f16": Variant("tc_native_f16", make_tc_launch(1), TC_CONFIGS, TC_CONFIGS_TINY, False, "tc"),
    "tc_asm": Variant("tc_asm", make_tc_launch(2), TC_CONFIGS, TC_CONFIGS_TINY, True, "tc"),
    "tc_asm_bf16": Variant("tc_asm_bf16", make_tc_launch(3), TC_CONFIGS, TC_CONFIGS_TINY, True, "tc"),
    "cuda_core_asm": Variant("cuda_core_asm", cc_launch, CC_CONFIGS, CC_CONFIGS_TINY, True),
    "bf16": Variant("bf16", bf16_launch, [("default", None)], [("default", None)], False, weights="bf16"),
}
DEFAULT_VARIANTS = "baseline,tc_native,tc_native_f16,tc_asm,tc_asm_bf16,cuda_core_asm"


def cfg_str(cfg):
    if isinstance(cfg, (TcConfig, CcConfig)):
        return str(cfg)
    if cfg[0] == "default":
        return "default"
    return "(" + ",".join(map(str, cfg)) + ")"


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------

TORCH_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized_weight(n, k, dtype, device, gen_seed):
    """Row-wise symmetric quantization of N(0, 0.02) weights: (w [N, K] int8/e4m3, scale [N] float32)."""
    g = torch.Generator(device=device).manual_seed(gen_seed)
    w = torch.empty(n, k, dtype=TORCH_DTYPES[dtype], device=device)
    scale = torch.empty(n, dtype=torch.float32, device=device)
    chunk = max(1, (1 << 26) // k)
    for r in range(0, n, chunk):
        wf = torch.randn(min(chunk, n - r), k, generator=g, device=device) * 0.02
        amax = wf.abs().amax(dim=1).clamp_min(1e-8)
        if dtype == "int8":
            sc = amax / 127.0
            w[r : r + chunk] = torch.round(wf / sc[:, None]).clamp(-127, 127).to(torch.int8)
        else:
            sc = amax / 448.0
            w[r : r + chunk] = (wf / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale[r : r + chunk] = sc
    return w, scale


def reference(x, w, scale):
    """x.float() @ (w.float() * scale[:, None]).T, in row chunks (the LM head's float32 copy is 2 GB)."""
    out = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    chunk = max(1, (1 << 27) // w.shape[1])
    xf = x.float()[0]
    for r in range(0, w.shape[0], chunk):
        out[r : r + chunk] = (w[r : r + chunk].float() * scale[r : r + chunk, None]) @ xf
    return out[None, :]


def code_weight(n, k, dtype, device):
    """w[r, c] = the 8-bit code (r + c) % 256 (e4m3 NaN codes 0x7F / 0xFF set to 0): with N = 256 every
    column holds every code once."""
    codes = (torch.arange(n, device=device)[:, None] + torch.arange(k, device=device)[None, :]) % 256
    if dtype == "int8":
        return codes.to(torch.uint8).view(torch.int8)
    codes = torch.where((codes == 0x7F) | (codes == 0xFF), torch.zeros_like(codes), codes)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def rel_err(y, ref):
    y = y.float().reshape(ref.shape)
    denom = ref.abs().max().clamp_min(1e-30)
    err = (y - ref).abs().max() / denom
    if not torch.isfinite(y).all():
        return float("inf")
    return err.item()


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


def bench(fn, rep_ms):
    """µs per call, through a CUDA graph (do_bench_cudagraph); do_bench if graph capture fails."""
    try:
        try:
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        except TypeError:  # a Triton without return_mode
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms)
        return ms * 1e3, "graph"
    except Exception as exc:
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=max(5, rep_ms // 2), rep=rep_ms, return_mode="median")
        return ms * 1e3, f"no-graph({type(exc).__name__})"


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def fake_bench(fn, cfg):
    """--fake-timing (CPU harness test): runs fn twice (rotation) and makes up a time."""
    fn()
    fn()
    return 1.0 + (hash(str(cfg)) % 1000) / 1000.0, "fake"


def short_err(exc):
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return msg if len(msg) <= 500 else msg[:120] + " ... " + msg[-380:]  # the reason is at the end


def run_codes_check(variant, dtype, cfgs_by_key, ctx, device, log):
    """Exact check of every 8-bit code: N = 256, scale 1, x one-hot at a few columns -> y must equal w[:, j]."""
    n, k = 256, 512 if not INTERPRET else 256
    w = code_weight(n, k, dtype, device)
    s = torch.ones(n, dtype=torch.float32, device=device)
    results = {}
    for cfg in cfgs_by_key:
        key = (variant.name, dtype, cfg)
        bad = 0
        try:
            for j in (0, 1, 2, 3, 5, 130, k - 1):
                x = torch.zeros(1, k, dtype=torch.bfloat16, device=device)
                x[0, j] = 1.0
                out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
                y = variant.launch(x, w, s, out, cfg, ctx, key + ("codes",)).float()[0]
                expect = w[:, j].float()
                bad += int((y != expect).sum().item())
            results[cfg] = "ok" if bad == 0 else f"FAILED({bad} of {7 * n} codes wrong)"
        except Exception as exc:
            results[cfg] = "ERROR " + short_err(exc)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter, tiny shapes, errors only (no timing)")
    ap.add_argument("--sm90-compile", action="store_true", help="compile every kernel for sm_90 here (no GPU)")
    ap.add_argument("--dtypes", default="int8,fp8")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {','.join(VARIANTS)}")
    ap.add_argument("--shapes", default=None, help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="fewer configs (3 tensor-core, 2 others)")
    ap.add_argument("--rep", type=int, default=5, help="do_bench_cudagraph rep in ms per measurement")
    ap.add_argument("--rotate-mb", type=int, default=256,
                    help="cycle over copies of the weights totalling this many MB so they stream from HBM, "
                         "not the 50 MB L2 (0: one copy)")
    ap.add_argument("--target-programs", type=int, default=0, help="split-K aims at this many programs "
                    "(default 2 per SM)")
    ap.add_argument("--no-codes-check", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=480,
                    help="stop measuring after this long (the summary is still printed)")
    ap.add_argument("--verbose", action="store_true", help="print every config's time")
    ap.add_argument("--fake-timing", action="store_true", help=argparse.SUPPRESS)  # CPU test of the harness
    args = ap.parse_args()

    if args.sm90_compile:
        return sm90_compile(args)

    t_start = time.time()
    sys.stdout.reconfigure(line_buffering=True)  # readable progress if the run is cut off
    tiny = args.tiny
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    if device == "cpu" and not INTERPRET:
        print("no CUDA device: use --tiny (Triton interpreter) or --sm90-compile")
        return 1
    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  triton {triton.__version__}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, {props.multi_processor_count} SMs, capability {props.major}.{props.minor}, "
              f"CUDA {torch.version.cuda}")
        sms = props.multi_processor_count
    else:
        print("CPU, TRITON_INTERPRET=1: math only, no timing; inline-asm variants are skipped")
        sms = 4
    ctx = Ctx(device, args.target_programs or 2 * sms)
    timing = device == "cuda" or args.fake_timing
    shapes = TINY_SHAPES if tiny else SHAPES
    per_token = TINY_PER_TOKEN if tiny else PER_TOKEN
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    dtypes = args.dtypes.split(",")
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    if tokenmill_gemv is None:
        print(f"WARNING: tokenmill gemv not importable: {_TOKENMILL_ERROR}")

    # results[(variant, dtype, shape)] = dict(best=(us, cfg), err=..., all=[(cfg, us, err, status)])
    results = {}
    broken = {}  # (variant, dtype, cfg) -> message (compile / launch error): skipped afterwards
    codes = {}
    out_of_time = False
    x_gen = torch.Generator(device=device).manual_seed(0)

    for dtype in dtypes:
        print(f"\n=== {dtype} weights ===")
        # exact per-code conversion check, every config once
        if not args.no_codes_check:
            for v in variants:
                if v.weights != "8bit":
                    continue
                if v.needs_asm and INTERPRET:
                    print(f"  codes  {v.name:14s} SKIPPED (inline asm does not run in the interpreter)")
                    continue
                cfgs = []
                for shape in shapes.values():
                    for c in v.configs_for(shape, dtype, ctx, tiny, args.quick):
                        if c not in cfgs:
                            cfgs.append(c)
                t0 = time.time()
                res = run_codes_check(v, dtype, cfgs, ctx, device, print)
                codes[(v.name, dtype)] = res
                for c, r in res.items():
                    if r != "ok":
                        print(f"  codes  {v.name:14s} {cfg_str(c):26s} {r}")
                        if r.startswith("ERROR"):
                            broken[(v.name, dtype, c)] = r
                n_ok = sum(r == "ok" for r in res.values())
                print(f"  codes  {v.name:14s} {n_ok}/{len(res)} configs exact on all 256 codes "
                      f"({time.time() - t0:.1f} s, includes compiling)")

        for sname, (n, k) in shapes.items():
            print(f"  -- {sname} N={n} K={k} (t = {time.time() - t_start:.0f} s)", flush=True)
            x = (torch.randn(1, k, generator=x_gen, device=device)).to(torch.bfloat16)
            w, scale = quantized_weight(n, k, dtype, device, gen_seed=zlib.crc32(f'{dtype}/{sname}'.encode()))
            ref = reference(x, w, scale)
            copies = 1
            if timing and args.rotate_mb > 0:
                copies = max(1, min(32, math.ceil(args.rotate_mb * 2**20 / (n * k))))
            ws_all = [w] + [w.clone() for _ in range(copies - 1)]
            ss_all = [scale] + [scale.clone() for _ in range(copies - 1)]
            wbf = None
            for v in variants:
                if v.needs_asm and INTERPRET:
                    print(f"  {sname:8s} {v.name:14s} SKIPPED (inline asm does not run in the interpreter)")
                    continue
                if v.weights == "bf16":
                    if wbf is None:
                        wbf = [(wi.float() * si[:, None]).to(torch.bfloat16) for wi, si in zip(ws_all, ss_all)]
                    wlist, slist = wbf, [None] * len(wbf)
                else:
                    wlist, slist = ws_all, ss_all
                entry = {"all": [], "best": None, "err": None}
                results[(v.name, dtype, sname)] = entry
                for cfg in v.configs_for((n, k), dtype, ctx, tiny, args.quick):
                    bkey = (v.name, dtype, cfg)
                    if time.time() - t_start > args.max_seconds:
                        if not out_of_time:
                            print(f"  !! --max-seconds {args.max_seconds:g} reached: the remaining configs are skipped")
                        out_of_time = True
                        entry["all"].append((cfg, None, None, "skipped(time)"))
                        continue
                    if bkey in broken:
                        entry["all"].append((cfg, None, None, "ERROR(see above)"))
                        continue
                    out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
                    try:
                        y = v.launch(x, wlist[0], slist[0], out, cfg, ctx, (v.name, dtype))
                        if device == "cuda":
                            torch.cuda.synchronize()
                        err = rel_err(y, ref)
                    except Exception as exc:
                        msg = short_err(exc)
                        broken[bkey] = msg
                        print(f"  {sname:8s} {v.name:14s} {cfg_str(cfg):26s} ERROR {msg}")
                        if args.verbose:
                            traceback.print_exc()
                        entry["all"].append((cfg, None, None, "ERROR"))
                        continue
                    status = "ok" if err <= FAIL_REL_ERR else "FAILED"
                    us = None
                    if timing:
                        i = [0]

                        def fn(v=v, cfg=cfg, out=out, i=i, wlist=wlist, slist=slist):
                            j = i[0]
                            i[0] = (j + 1) % len(wlist)
                            v.launch(x, wlist[j], slist[j], out, cfg, ctx, (v.name, dtype))

                        try:
                            us, how = bench(fn, args.rep) if device == "cuda" else fake_bench(fn, cfg)
                            if how != "graph":
                                status += f" {how}"
                        except Exception as exc:
                            status = "ERROR(bench) " + short_err(exc)
                    entry["all"].append((cfg, us, err, status))
                    if args.verbose or tiny:
                        t = f"{us:8.2f} us {v.nbytes * n * k / (us * 1e3):7.0f} GB/s" if us else "       -"
                        print(f"  {sname:8s} {v.name:14s} {cfg_str(cfg):26s} {t}  err {err:.2e}  {status}")
                good = [(us, cfg, err) for cfg, us, err, st in entry["all"] if st.startswith("ok") and us]
                errs = [e for _, _, e, _ in entry["all"] if e is not None]
                entry["err"] = max(errs) if errs else None
                entry["failed"] = [cfg for cfg, _, _, st in entry["all"] if not st.startswith(("ok", "skipped"))]
                if good:
                    entry["best"] = min(good, key=lambda t: t[0])
                if timing:
                    b = entry["best"]
                    line = (f"{b[0]:8.2f} us {v.nbytes * n * k / (b[0] * 1e3):7.0f} GB/s  err {b[2]:.1e}  best {cfg_str(b[1])}"
                            if b else "   no working config")
                    nf = len(entry["failed"])
                    print(f"  {sname:8s} {v.name:14s} {line}" + (f"  [{nf} configs FAILED/ERROR]" if nf else ""))
            del ws_all, ss_all, wbf, w, scale, ref
            if device == "cuda":
                torch.cuda.empty_cache()

    summary(results, variants, dtypes, shapes, per_token, codes, timing, tiny)
    print(f"\ntotal wall time {time.time() - t_start:.0f} s")
    return 0


def summary(results, variants, dtypes, shapes, per_token, codes, timing, tiny):
    print("\n" + "=" * 110)
    print("SUMMARY: best config per shape (us, GB/s of weight bytes), max rel. error over that variant's configs")
    print(f"(FAILED = max|y - ref| / max|ref| > {FAIL_REL_ERR:g}; ref = x.float() @ (w.float() * scale).T)")
    for dtype in dtypes:
        print(f"\n--- {dtype} ---")
        header = f"{'variant':14s} " + " ".join(f"{s:>24s}" for s in shapes) + f" {'per token':>22s}"
        print(header)
        for v in variants:
            cells = []
            total = 0.0
            complete = True
            flags = []
            for sname, (n, k) in shapes.items():
                e = results.get((v.name, dtype, sname))
                if e is None:
                    cells.append(f"{'skipped':>24s}")
                    complete = False
                    continue
                b = e["best"]
                if e.get("failed"):
                    flags.append(f"{sname}: {len(e['failed'])} cfg FAILED/ERROR")
                if not timing:
                    err = e["err"]
                    if err is None and all(st.startswith("skipped") for _, _, _, st in e["all"]):
                        cells.append(f"{'out of time':>24s}")
                        continue
                    st = "FAILED" if err is None or err > FAIL_REL_ERR else "ok"
                    cells.append(f"{'err ' + (f'{err:.1e}' if err is not None else '-') + ' ' + st:>24s}")
                    continue
                if b is None:
                    timed_out = all(st.startswith("skipped") for _, _, _, st in e["all"])
                    cells.append(f"{'out of time' if timed_out else 'FAILED':>24s}")
                    complete = False
                    continue
                total += per_token[sname] * b[0]
                cells.append(f"{b[0]:7.1f}us {v.nbytes * n * k / (b[0] * 1e3):5.0f}GB/s e{b[2]:.0e}")
            tot = f"{total:9.0f} us {1e6 / total:6.0f} tok/s" if complete and total > 0 else f"{'-':>22s}"
            print(f"{v.name:14s} " + " ".join(cells) + f" {tot}")
            for f in flags:
                print(f"{'':14s}   ! {f}")
        if timing:
            print("best configs:")
            for v in variants:
                parts = []
                for sname in shapes:
                    e = results.get((v.name, dtype, sname))
                    if e and e["best"]:
                        parts.append(f"{sname}={cfg_str(e['best'][1])}")
                print(f"  {v.name:14s} " + "; ".join(parts))
            print("one config for every shape (sum per token of the best single config):")
            for v in variants:
                per_cfg = {}
                for sname in shapes:
                    e = results.get((v.name, dtype, sname))
                    if not e:
                        continue
                    for cfg, us, err, st in e["all"]:
                        if us and st.startswith("ok"):
                            base = cfg.with_split(0) if isinstance(cfg, TcConfig) else cfg
                            per_cfg.setdefault(base, {}).setdefault(sname, us)
                            per_cfg[base][sname] = min(per_cfg[base][sname], us)
                full = {c: sum(per_token[s] * t for s, t in d.items()) for c, d in per_cfg.items()
                        if len(d) == len(shapes)}
                if full:
                    c, t = min(full.items(), key=lambda kv: kv[1])
                    print(f"  {v.name:14s} {t:9.0f} us  {cfg_str(c)} (best split per shape)")
        print("codes check (exact conversion of all 256 codes, per config):")
        for v in variants:
            res = codes.get((v.name, dtype))
            if res is None:
                print(f"  {v.name:14s} not run")
                continue
            bad = {cfg_str(c): r for c, r in res.items() if r != "ok"}
            print(f"  {v.name:14s} {len(res) - len(bad)}/{len(res)} ok" + (f"  bad: {bad}" if bad else ""))
    weights_per_token = sum(per_token[s] * n * k for s, (n, k) in shapes.items())
    print(f"\nweight bytes per token (8-bit): {weights_per_token / 1e9:.2f} GB; at 3.6 TB/s: "
          f"{weights_per_token / 3.6e6:.0f} us")


# ----------------------------------------------------------------------------------------------------------
# Offline compile for sm_90 (no GPU needed): checks that the PTX assembles and shows the SASS instruction mix
# ----------------------------------------------------------------------------------------------------------


def sm90_compile(args):
    import collections
    import re

    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    wty = {"int8": "*i8", "fp8": "*fp8e4nv"}
    cvts = {"tc_native": 0, "tc_native_f16": 1, "tc_asm": 2, "tc_asm_bf16": 3}
    div16 = [["tt.divisibility", 16]]
    ok = True
    for dtype in args.dtypes.split(","):
        for vname in args.variants.split(","):
            if vname in cvts:
                cfgs = TC_CONFIGS_QUICK if args.quick else TC_CONFIGS
                for cfg in cfgs:
                    orient, bn, bk, warps, stages, _ = cfg
                    sig = {
                        "x_ptr": "*bf16", "w_ptr": wty[dtype], "scale_ptr": "*fp32", "out_ptr": "*bf16",
                        "ws_ptr": "*fp32", "count_ptr": "*i32", "N": "i32", "K": "i32", "stride_w": "i32",
                        "k_per_split": "i32", "num_splits": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                        "CVT": "constexpr", "W_AS_A": "constexpr", "EVEN": "constexpr", "INTERP": "constexpr",
                    }
                    consts = {"BLOCK_N": bn, "BLOCK_K": bk, "CVT": cvts[vname], "W_AS_A": orient == "wx", "EVEN": True,
                              "INTERP": False}
                    attrs = {(i,): div16 for i in range(9)}
                    ok &= _compile_one(_tc_gemv_kernel, sig, consts, attrs, target, warps, stages,
                                       f"{dtype} {vname} {cfg}", args.verbose, collections, re)
            elif vname == "cuda_core_asm":
                for cfg in CC_CONFIGS:
                    bn, bk, warps, stages, mode = cfg
                    sig = {
                        "x_ptr": "*bf16", "w_ptr": wty[dtype], "scale_ptr": "*fp32", "out_ptr": "*bf16",
                        "N": "i32", "K": "i32", "stride_w": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                        "MODE": "constexpr", "EVEN": "constexpr",
                    }
                    consts = {"BLOCK_N": bn, "BLOCK_K": bk, "MODE": mode, "EVEN": True}
                    attrs = {(i,): div16 for i in range(7)}
                    ok &= _compile_one(_cc_gemv_kernel, sig, consts, attrs, target, warps, stages,
                                       f"{dtype} {vname} {cfg}", args.verbose, collections, re)
            else:
                print(f"{dtype} {vname}: not compiled offline (tokenmill's own kernel / bf16)")
    return 0 if ok else 1


def _compile_one(fn, sig, consts, attrs, target, warps, stages, label, verbose, collections, re):
    from triton.compiler import ASTSource

    t0 = time.time()
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    except Exception as exc:
        print(f"{label}: COMPILE ERROR {short_err(exc)}")
        if verbose:
            traceback.print_exc()
        return False
    dt = time.time() - t0
    ttgir = k.asm.get("ttgir", "")
    ptx = k.asm.get("ptx", "")
    sass = ""
    try:
        import subprocess
        import tempfile

        from triton.backends.nvidia import compiler as nvc

        cuobjdump = os.path.join(os.path.dirname(nvc.__file__), "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
    except Exception as exc:
        sass = f"(no sass: {exc})"
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?",
                                         sass, re.M))
    mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "no-mma")
    shared = k.metadata.shared if hasattr(k.metadata, "shared") else "?"
    regs = getattr(k, "n_regs", "?")
    top = ", ".join(f"{op}:{c}" for op, c in ops.most_common(12))
    spills = ops.get("STL", 0) + ops.get("LDL", 0)
    print(f"{label}: ok {dt:.1f}s  {mma}  smem {shared}  local ld/st {spills}{' SPILLS' if spills else ''}  "
          f"[{top}]")
    if verbose:
        print(ttgir[:6000])
    return True


if __name__ == "__main__":
    sys.exit(main())
