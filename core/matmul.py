"""onegemm.matmul and onegemm.linear: the launch-per-tile GEMM (tutorial-03 style)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks, splitk
from .runtime import Kernel, empty, next_pow2_bucket
from .tiles import gemm_tile, grouped_tile, make_operands
from .tma import choose_tma, flavour_meta, keep_flavours, launch_flavoured, tuned_flavours, warp_specialized


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    M_BUCKET, LAYOUT, TMA_MODE,
    ws_ptr, lock_ptr,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr = 1, WARP_SPECIALIZE: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
):
    """C = act(A @ B + bias), one program per output tile (per tile and K split with SPLIT_K).

    a_ptr [M, K], b_ptr [K, N], c_ptr [M, N]: element [i, j] at ptr + i*stride_x0 + j*stride_x1.
    bias_ptr [N] (stride_bias) or None.
    M_BUCKET, LAYOUT, TMA_MODE: autotune key only (next power of two of M; which operands
        are K-contiguous; which load flavours the tuner may pick), unused in the body.
    USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT: the TMA flavour and its operand layout
        (tiles.make_operands; core/tma.py says which calls may use it, the tuner picks).
    SPLIT_K, ws_ptr, lock_ptr: split-K (core/splitk.py): program p computes split p % SPLIT_K
        of tile p // SPLIT_K; ws_ptr fp32 [SPLIT_K * M, N] and lock_ptr int32 [tiles] are the
        partials and counters of tiles.split_k_combine (None when SPLIT_K is 1).
    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K,), tiles in grouped (GROUP_M) order.
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid // SPLIT_K, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    a, b, c = make_operands(
        a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT,
    )
    gemm_tile(
        pid_m, pid_n, a, b, c, bias_ptr, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
        ACTIVATION, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        USE_TMA=USE_TMA, A_K_CONTIG=A_K_CONTIG, B_K_CONTIG=B_K_CONTIG, EPI_SPLIT=EPI_SPLIT,
        WARP_SPECIALIZE=WARP_SPECIALIZE,
        split=pid % SPLIT_K, SPLIT_K=SPLIT_K, ws_ptr=ws_ptr, lock_ptr=lock_ptr,
    )


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
        num_warps=warps, num_stages=stages,
    )


# Hopper (H200) configs. 128x256 / 256x128 tiles with 8 warps (two consumer warpgroups)
# are what wgmma needs to approach the bf16 peak; 128x128 and 64-row tiles cover small M and
# small N, where big tiles leave most of the 132 SMs idle. BLOCK_K=128 rows are for fp8
# (same bytes per stage as BLOCK_K=64 in bf16).
MATMUL_CONFIGS = [
    _cfg(128, 256, 64, 8, 3),
    _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 4, 4),
    _cfg(64, 256, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 64, 64, 4, 5),
    _cfg(128, 256, 128, 8, 3),
    _cfg(256, 128, 128, 8, 3),
    _cfg(128, 128, 128, 8, 4),
    _cfg(64, 128, 128, 4, 4),
    _cfg(64, 64, 128, 4, 4),
    _cfg(128, 128, 32, 4, 4),
    _cfg(64, 64, 32, 4, 4),
]

# Warp-specialised (TMA only, so they carry USE_TMA): a TMA producer and two consumer
# warpgroups (core/tiles.py mma_k_loop). 4 warps, as Triton 3.6 splits a 4-warp program's
# tile between the consumers (8 gave no partitions). Measured on the H200, bf16, forced
# (bench/diagnose_blockscaled.py bf16): 128x256x64 at 0.91/0.94/0.97x cuBLAS on 4096^3 /
# 8192^3 / 8192x14336x4096, against 0.74/0.82/0.81x for the same tile with 8 warps unspecialised;
# 256x128x64 0.91/0.94/0.95x. (The persistent kernel gained nothing: persistent/matmul.py.)
WS_CONFIGS = [
    warp_specialized(_cfg(128, 256, 64, 4, 3), USE_TMA=True),
    warp_specialized(_cfg(256, 128, 64, 4, 3), USE_TMA=True),
]

# Split-K (core/splitk.py) for small M, where the tiles above leave most SMs idle: the
# 64-row tiles that M <= 64 tunes, each with 2, 4 and 8 splits. The tuner tries them only
# while SPLIT_K x the M bucket <= 512 (splitk.allowed). Measured on the H200, bf16
# (bench/results/matmul.md): 16x4096x14336 0.64x -> 0.92x cuBLAS (splitK4), 128x4096x14336
# 0.68x -> 0.87x (splitK2); the N = 14336 shapes have enough tiles and stay unsplit.
SPLIT_K_CONFIGS = splitk.with_splits([
    _cfg(64, 64, 64, 4, 5),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 64, 128, 4, 4),
    _cfg(64, 128, 128, 4, 4),
    _cfg(64, 64, 32, 4, 4),
])

# Under the interpreter: one small config. Cost grows with programs x K iterations, so CPU
# tests stay quick; 32 is also tl.dot's minimum for fp8 on the interpreter's fp16 emulation.
INTERPRET_CONFIG = _cfg(32, 32, 32, 1, 1, group_m=4)


def prune_configs(configs, args):
    """Keep the configs that suit the dtype and the M bucket (tuning fewer is faster)."""
    a = args["a_ptr"]
    itemsize = a.element_size()
    # One K step moves BLOCK_K * itemsize bytes per row: 64 for fp8 and 128 for 16-bit inputs
    # fill a 128-byte TMA/wgmma swizzle row; fp32 takes 32 to keep shared memory in budget.
    want_bk = {1: 128, 2: 64, 4: 32}[itemsize]
    m_bucket = args["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] == want_bk and splitk.allowed(c, m_bucket)]
    if m_bucket <= 64:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    return kept or configs


def prune_flavours(configs, args):
    """prune_configs, then keep the load flavours this call allows (TMA_MODE)."""
    return keep_flavours(prune_configs(configs, args), args)


# The launch-per-tile kernel tunes the load flavour with the tile shape. Measured on the H200
# in GPU time (bench/diagnose_matmul.py): each program builds its TMA descriptors in-kernel
# (about 2.4 us before its first load), so pointer loads win below ~2048^3 (512^3: 3.7 vs
# 6.0 us; 16x4096x4096: 14.6 vs 20.2 us) and TMA wins by 3-8% at 4096^3 and 8192^3.
_matmul = Kernel(
    matmul_kernel,
    tuned_flavours(MATMUL_CONFIGS + SPLIT_K_CONFIGS) + WS_CONFIGS,
    key=["M_BUCKET", "N", "K", "LAYOUT", "TMA_MODE"],
    interpret_config=INTERPRET_CONFIG,
    prune=prune_flavours,
)


def _layout(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(a.stride(1) == 1) * 2 + int(b.stride(0) == 1)


def check_matmul_inputs(a, b, bias, activation, out_dtype):
    """The checks of the matmul contract, shared by every op that offers it (matmul,
    persistent_matmul). Returns (M, N, K, out_dtype)."""
    checks.check_tensor("a", a, ndim=2)
    checks.check_tensor("b", b, ndim=2)
    checks.check_operand_dtypes(a, b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is {tuple(b.shape)}: b must be [K, N] with K = {a.shape[1]}")
    checks.check_activation(activation)
    M, K = a.shape
    N = b.shape[1]
    checks.check_bias(bias, (N,))
    checks.check_same_device(a=a, b=b, bias=bias)
    return M, N, K, checks.resolve_out_dtype(out_dtype, a.dtype)


def launch_args(a, b, c, bias, activation, tma: bool | None):
    """(args, meta) for a kernel with matmul_kernel's parameters, the flavour resolved.

    args: the positional arguments (pointers, sizes, strides, autotune key values); meta: the
    constexprs that are not part of a config. ``tma``: see core.tma.choose_tma.
    """
    M, K = a.shape
    N = b.shape[1]
    args = (
        a, b, c, bias, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0,
        next_pow2_bucket(M), _layout(a, b),
    )
    meta = dict(
        ACTIVATION=activation,
        UPCAST=checks.upcast_flag(a.dtype),
        PRECISION=checks.dot_precision(a.dtype),
        **flavour_meta(choose_tma(tma, a, b, c)),
    )
    return args, meta


def matmul(a, b, *, bias=None, activation=None, out_dtype=None, config: triton.Config | None = None, tma=None):
    """out = act(a @ b + bias), accumulated in fp32, cast to ``out_dtype``.

    a [M, K], b [K, N], any strides (b may be ``W.t()`` of an nn.Linear weight, or a slice).
    Dtypes: float16, bfloat16, float32, float8_e4m3fn / float8_e5m2 (fp8 defaults to a
    bfloat16 output). bias [N]. activation: None, "relu", "gelu", "gelu_tanh", "silu".
    ``config`` forces one triton.Config instead of autotuning (benchmarks and tests use it).
    ``tma``: None lets the autotuner choose between pointer loads and the TMA flavour
    (tensor-descriptor loads) on a Hopper GPU when a, b and the output allow TMA, and uses
    pointer loads otherwise; False forces pointers; True forces TMA or raises ValueError (see
    core/tma.py). A ``config`` from ``best_config()`` carries the flavour it was tuned with.
    """
    M, N, K, out_dtype = check_matmul_inputs(a, b, bias, activation, out_dtype)
    c = empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c

    def grid(meta):
        return (splitk.units(meta, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    args, meta = launch_args(a, b, c, bias, activation, tma)
    ws, locks = splitk.launch_buffers(_matmul, config, M, N, next_pow2_bucket(M), a.device)
    launch_flavoured(_matmul, grid, config, tma, args, {**meta, "ws_ptr": ws, "lock_ptr": locks})
    return c


def linear(x, weight, bias=None, *, activation=None):
    """F.linear semantics with an optional fused activation: act(x @ weight.T + bias).

    x [..., K], weight [N, K] (nn.Linear layout; read through ``weight.t()``, no copy),
    bias [N]. The output has x's leading dims and x's dtype.
    """
    checks.check_tensor("x", x)
    checks.check_tensor("weight", weight, ndim=2)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension [..., K], got a 0-D tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has {x.shape[-1]} features (last dim) but weight is {tuple(weight.shape)}: "
            f"weight must be [out_features, {x.shape[-1]}]"
        )
    lead = x.shape[:-1]
    out_dtype = torch.bfloat16 if x.dtype in checks.FP8_DTYPES else x.dtype
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation, out_dtype=out_dtype)
    return y.reshape(*lead, weight.shape[0])
