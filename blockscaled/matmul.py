"""onegemm.blockscaled_matmul: fp8 GEMM with torch._scaled_mm's scale conventions.

It is core's tile body (core/tiles.py gemm_tile) with its scale switches on:
- block scales (1x128 / 128x1 / 128x128) go to the K loop, which multiplies each K block's
  partial product by its scales and promotes it to the fp32 accumulator
  (acc += dot(a, b) * sa[:, None] * sb[None, :]); so BLOCK_K = 128 in every config;
- tensor-wise and row/column-wise scales are constant along K, so they go to the epilogue
  (one multiply per output element); the K loop then is core's plain fp8 loop, which still
  promotes to fp32 once per K block (max_num_imprecise_acc = BLOCK_K).

Granularity is read from the scale shapes (kb = ceil(K/128), mb = ceil(M/128), nb = ceil(N/128)):

    scale_a: numel 1 (tensor) | [M, 1] (row) | [M, kb] (1x128) | [mb, kb] (128x128)
    scale_b: numel 1 (tensor) | [1, N] (col) | [kb, N] (128x1) | [kb, nb] (128x128)

tried in that order, coarsest first. Two readings of one shape coincide only when the extra
dimension is 1 (M == 1, K <= 128, N == 1, or a single block), and then both give every
element the same multiplier, so the rule only picks the cheaper code path, never the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core import checks, configs, splitk
from ..core.launch import Launcher, Request
from ..core.runtime import cdiv, empty, interpretable, tile_grid
from ..core.tiles import gemm_tile, grouped_tile, make_operands, program_units
from ..core.tma import choose_tma, forced_flavour, layout_meta
from .quantize import BLOCK


@triton.jit
def blockscaled_matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    sa_ptr, stride_sa_m, stride_sa_k,
    sb_ptr, stride_sb_k, stride_sb_n,
    scale_m_ptr, stride_scale_m,
    scale_n_ptr, stride_scale_n,
    ws_ptr, lock_ptr,
    ACTIVATION: tl.constexpr,
    SA_ROWS_PER_SCALE: tl.constexpr, SB_COLS_PER_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr, A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False, PERSISTENT: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
):
    """C = act((A * scale_a) @ (B * scale_b) + bias), one output tile per program, or (PERSISTENT)
    one program per SM looping over the tiles.

    a_ptr [M, K], b_ptr [K, N] fp8; c_ptr [M, N]: element [i, j] at ptr + i*stride_x0 + j*stride_x1.
    sa_ptr: block scales of A, sa[i // SA_ROWS_PER_SCALE, k // 128] at
        sa_ptr + (i // SA_ROWS_PER_SCALE)*stride_sa_m + (k // 128)*stride_sa_k; or None.
    sb_ptr: block scales of B, sb[k // 128, j // SB_COLS_PER_SCALE] at
        sb_ptr + (k // 128)*stride_sb_k + (j // SB_COLS_PER_SCALE)*stride_sb_n; or None.
    scale_m_ptr / scale_n_ptr: row-wise scale of A / column-wise scale of B, element i at
        ptr + i*stride; stride 0 for a tensor-wise scalar; or None.
    bias_ptr [N] (stride_bias) or None.
    USE_TMA, A_K_CONTIG, B_K_CONTIG: core's TMA flavour (tiles.make_operands, core/tma.py);
        the scales are always read through pointers (one small vector per K block).
    WARP_SPECIALIZE: core's warp-specialised K loop (tiles.mma_k_loop).
    PERSISTENT: persistent/matmul.py's schedule (tiles.program_units): P programs, each
        taking tiles pid, pid + P, ..., so the TMA descriptors are built once per program and
        no SM waits for a new program between tiles. Off: one program per tile.
    SPLIT_K, ws_ptr, lock_ptr: split-K (core/splitk.py), as in core/matmul.py: work unit u is
        split u % SPLIT_K of tile u // SPLIT_K; the split ranges are whole K blocks, so every
        block keeps its one scale.
    Grid: runtime.tile_grid: (P,) with P = min(SM count, units) when PERSISTENT, else P = units
        = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K; tiles in grouped (GROUP_M) order.
    """
    a, b, c = make_operands(
        a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_K_CONTIG, B_K_CONTIG,
    )
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for i in tl.range(0, program_units(num_pid_m * num_pid_n * SPLIT_K, PERSISTENT)):
        unit = tl.program_id(0) + i * tl.num_programs(0)
        pid_m, pid_n = grouped_tile(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        gemm_tile(
            pid_m, pid_n, a, b, c, bias_ptr, M, N, K,
            stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
            # UPCAST off (fp8 tiles are right in the interpreter), PRECISION unused for fp8.
            ACTIVATION, False, "ieee", BLOCK_M, BLOCK_N, BLOCK_K,
            sa_ptr, stride_sa_m, stride_sa_k, SA_ROWS_PER_SCALE,
            sb_ptr, stride_sb_k, stride_sb_n, SB_COLS_PER_SCALE,
            scale_m_ptr, stride_scale_m, scale_n_ptr, stride_scale_n,
            USE_TMA, A_K_CONTIG, B_K_CONTIG, WARP_SPECIALIZE=WARP_SPECIALIZE,
            split=unit % SPLIT_K, SPLIT_K=SPLIT_K, ws_ptr=ws_ptr, lock_ptr=lock_ptr,
        )


BLOCKSCALED = Launcher(blockscaled_matmul_kernel, configs.BLOCKSCALED)

A_KINDS = ("tensor", "row", "1x128", "128x128")
B_KINDS = ("tensor", "col", "128x1", "128x128")


def scale_kind_a(scale_a: torch.Tensor, M: int, K: int) -> str:
    """Which granularity scale_a's shape gives, coarsest first (module docstring)."""
    kb, mb = cdiv(K, BLOCK), cdiv(M, BLOCK)
    shape = tuple(scale_a.shape)
    if scale_a.dim() <= 2 and scale_a.numel() == 1:
        return "tensor"
    for kind, want in (("row", (M, 1)), ("1x128", (M, kb)), ("128x128", (mb, kb))):
        if shape == want:
            return kind
    raise checks.bad_shape(
        "scale_a", f"a scalar, [M, 1] = [{M}, 1], [M, ceil(K/128)] = [{M}, {kb}] (1x128) or "
        f"[ceil(M/128), ceil(K/128)] = [{mb}, {kb}] (128x128) for a [M, K] = [{M}, {K}]", shape,
        "it fits no granularity")


def scale_kind_b(scale_b: torch.Tensor, K: int, N: int) -> str:
    kb, nb = cdiv(K, BLOCK), cdiv(N, BLOCK)
    shape = tuple(scale_b.shape)
    if scale_b.dim() <= 2 and scale_b.numel() == 1:
        return "tensor"
    for kind, want in (("col", (1, N)), ("128x1", (kb, N)), ("128x128", (kb, nb))):
        if shape == want:
            return kind
    raise checks.bad_shape(
        "scale_b", f"a scalar, [1, N] = [1, {N}], [ceil(K/128), N] = [{kb}, {N}] (128x1) or "
        f"[ceil(K/128), ceil(N/128)] = [{kb}, {nb}] (128x128) for b [K, N] = [{K}, {N}]", shape,
        "it fits no granularity")


def blockscaled_matmul(a, b, scale_a, scale_b, *, out_dtype=torch.bfloat16, bias=None, activation=None,
                       config: triton.Config | None = None, tma: bool | None = None):
    """out = act((a * scale_a) @ (b * scale_b) + bias), torch._scaled_mm's conventions.

    a [M, K], b [K, N]: float8_e4m3fn or float8_e5m2 (not both e5m2), any strides; b given as
        W.t() of an fp8 [N, K] weight is the fast (K-major) layout on Hopper.
    scale_a, scale_b: fp32 dequantisation multipliers, any strides (torch._scaled_mm's
        outer-dim-major scale_a and transposed scale_b included), granularity from the shape:
        scale_a scalar | [M, 1] | [M, ceil(K/128)] | [ceil(M/128), ceil(K/128)];
        scale_b scalar | [1, N] | [ceil(K/128), N] | [ceil(K/128), ceil(N/128)].
    out_dtype: bfloat16 (default), float16 or float32. bias [N]. activation as in matmul.
    ``config`` forces one triton.Config instead of autotuning (tests and benchmarks).
    ``tma``: as in onegemm.matmul (None: tensor-descriptor loads of a and b on Hopper when
    they allow it, pointer loads otherwise; False: pointers; True: TMA or ValueError).
    """
    checks.check_fp8("a", a)
    checks.check_fp8("b", b)
    checks.check_operand_dtypes(a, b)
    if a.shape[1] != b.shape[0]:
        raise checks.bad_shape("b", f"[K, N] with K = {a.shape[1]} (a is [M, K] = {tuple(a.shape)})", b.shape)
    checks.check_config(config)
    checks.check_tma(tma)
    M, K = a.shape
    N = b.shape[1]
    checks.check_tensor("scale_a", scale_a, dtypes=(torch.float32,))
    checks.check_tensor("scale_b", scale_b, dtypes=(torch.float32,))
    kind_a, kind_b = scale_kind_a(scale_a, M, K), scale_kind_b(scale_b, K, N)
    checks.check_activation(activation)
    checks.check_bias(bias, (N,))
    checks.check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    out_dtype = checks.resolve_out_dtype(out_dtype, a.dtype)
    return run_blockscaled(a, b, scale_a, scale_b, kind_a, kind_b, out_dtype, bias, activation, config, tma)


def run_blockscaled(a, b, scale_a, scale_b, kind_a, kind_b, out_dtype, bias=None, activation=None, config=None, tma=None):
    """blockscaled_matmul's body, on checked inputs whose scale granularities are known."""
    M, K = a.shape
    N = b.shape[1]
    c = empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c

    # Block scales -> the K loop (pointer, 2 strides, rows/cols per scale); the others ->
    # the epilogue (pointer, 1 stride; 0 broadcasts the scalar).
    sa, sa_strides, sa_rows, scale_m, scale_m_stride = None, (0, 0), 1, None, 0
    if kind_a in ("1x128", "128x128"):
        sa, sa_strides, sa_rows = scale_a, scale_a.stride(), (1 if kind_a == "1x128" else BLOCK)
    else:
        scale_m, scale_m_stride = scale_a, (0 if kind_a == "tensor" else scale_a.stride(0))
    sb, sb_strides, sb_cols, scale_n, scale_n_stride = None, (0, 0), 1, None, 0
    if kind_b in ("128x1", "128x128"):
        sb, sb_strides, sb_cols = scale_b, scale_b.stride(), (1 if kind_b == "128x1" else BLOCK)
    else:
        scale_n, scale_n_stride = scale_b, (0 if kind_b == "tensor" else scale_b.stride(1))

    layout = choose_tma(tma, a, b, c)
    scaling = f"{kind_a},{kind_b}"
    key = (a.dtype, b.dtype, out_dtype, bias is None or bias.dtype, activation, configs.m_bucket(M), N, K,
           a.stride(1) == 1, b.stride(0) == 1, layout, tma, scaling, a.get_device(), config)
    scales = (sa, *sa_strides, sb, *sb_strides, scale_m, scale_m_stride, scale_n, scale_n_stride)

    def request():
        return Request(
            configs.BlockscaledKey(configs.m_bucket(M), N, K, a.stride(1) == 1, b.stride(0) == 1,
                                   configs.flavour_mode(tma, layout is not None), scaling),
            dict(ACTIVATION=activation, SA_ROWS_PER_SCALE=sa_rows, SB_COLS_PER_SCALE=sb_cols, **layout_meta(layout)),
            a.device, forced_flavour(config, layout), lambda plan: _launch(plan, a, b, c, bias, scales),
        )

    _launch(BLOCKSCALED.plan(key, request), a, b, c, bias, scales)
    return c


def _launch(plan, a, b, c, bias, scales):
    """One launch of blockscaled_matmul_kernel with ``plan``."""
    M, K = a.shape
    N = b.shape[1]
    ws, locks = splitk.for_plan(plan.meta, a.device, M, N)
    a, b = interpretable(a), interpretable(b)
    BLOCKSCALED.launch(plan, tile_grid(M, N, plan.meta, plan.device_index), (
        a, b, c, bias, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0), *scales, ws, locks,
    ))
