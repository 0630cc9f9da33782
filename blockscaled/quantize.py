"""onegemm.quantize_fp8: fp32/bf16/fp16 -> fp8 with one fp32 scale per block.

Scale rule (the same in the Triton kernel, the torch path and onegemm.testing.quantize_fp8_ref):

    amax  = max |x| over the block
    scale = max(amax / FP8_MAX, FLT_MIN)     if amax > 0
          = 1.0                              if the block is all zeros (so q = 0, scale finite)
    pow2_scale: scale -> the next power of two >= scale (exact; a power of two stays put)
    q     = clamp(x / scale, -FP8_MAX, FP8_MAX) rounded to nearest-even fp8

so x ~= q.float() * scale. The floor FLT_MIN (smallest normal fp32) keeps the scale normal for
blocks of denormals, whose amax / FP8_MAX would underflow to 0 and turn x / scale into inf.
Rounding the scale UP keeps |x| / scale <= FP8_MAX; the clamp only catches the last ulp of the
division, so values saturate at the format's max instead of becoming NaN (e4m3fn has no inf).

Non-finite input: NaN is counted as +inf in the amax, so a block holding NaN or inf gets an
inf scale and dequantises to NaN: a non-finite input gives a non-finite output, as it would
through nn.Linear. ``check_finite=True`` raises ValueError instead, at the cost of a host sync.
"""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..core import checks, configs
from ..core.dispatch import Cached, Launch, Op
from ..core.fp8 import amax_input, fp8_apply, fp8_scales
from ..core.launch import Launcher, Request
from ..core.runtime import INTERPRET, cdiv, empty, empty_strided
from ..core.scaling import (BLOCKS, INT4, INT4_MIN_GROUP, INT4_ZERO, MXFP4, MXFP4_BLOCK, MXFP4_SCALE, ROW,
                             ROW_BLOCKS, SCALE_BLOCK, TENSOR, Granularity)
from .configs import QuantKey

BLOCK_ARGS = ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK), "row", "tensor")  # quantize_fp8's block values
SCALE_RULES = ("onegemm", "torchao")  # quantize_fp8's scale_rule values (core/fp8.py)
FLT_MIN = torch.finfo(torch.float32).tiny
IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2


# ---- Triton: fused amax + scale + cast (the arithmetic: core/fp8.py) ----


@triton.jit
def quantize_kernel(
    x_ptr, q_ptr, s_ptr, amax_ptr,
    M, K, cols_per_scale,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
    POW2: tl.constexpr, ROWS_PER_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TORCHAO: tl.constexpr = False, AMAX_GIVEN: tl.constexpr = False,
):
    """q = fp8(x / scale) with one fp32 scale per ROWS_PER_SCALE x cols_per_scale block
    (TORCHAO: q = fp8(x * mult), scale = 1 / mult: core/fp8.py's two rules).

    x_ptr [M, K] (fp32/bf16/fp16), q_ptr [M, K] (fp8): element [i, j] at ptr + i*stride_m + j*stride_k.
    s_ptr [ceil(M / ROWS_PER_SCALE), ceil(K / cols_per_scale)] fp32, any strides.
    ROWS_PER_SCALE: 1 (1x128 blocks, row-wise) or BLOCK_M (128x128 blocks).
    cols_per_scale: 128 for blocks, K for row-wise (the program then loops over the row).
    AMAX_GIVEN (tensor-wise scales): amax_ptr holds the fp32 max |x| of the whole tensor (a
    grid-wide reduction, made before the launch), s_ptr the one scale (strides 0); program
    (0, 0) stores it. amax_ptr is unread otherwise.
    Grid: (cdiv(M, BLOCK_M), cdiv(K, cols_per_scale)); program (pm, pk) owns rows
    [pm*BLOCK_M, +BLOCK_M) and the pk-th column group. Two passes over the group: amax, then
    cast. The second pass re-reads x, which for a 128-column group is still in L1/L2.
    """
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < M
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pk * cols_per_scale
    k_end = tl.minimum(k_start + cols_per_scale, K)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_row = q_ptr + rows.to(tl.int64)[:, None] * stride_qm

    if AMAX_GIVEN:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(amax_ptr)
        amax = tl.where(amax == amax, amax, float("inf"))  # NaN counts as inf, as in amax_input
        s_mask = mask_m & (rows == 0) & (pk == 0)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            cols = k0 + offs_k
            mask = mask_m[:, None] & (cols < k_end)[None, :]
            x = tl.load(x_row + cols.to(tl.int64)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(amax_input(x), axis=1))
        if ROWS_PER_SCALE > 1:
            amax = tl.zeros_like(amax) + tl.max(amax, axis=0)
        # One store per scale: the first row of each ROWS_PER_SCALE group writes it.
        s_mask = mask_m & (rows % ROWS_PER_SCALE == 0)
    scale, factor = fp8_scales(amax, q_ptr.dtype.element_ty, POW2, TORCHAO)
    tl.store(s_ptr + (rows // ROWS_PER_SCALE).to(tl.int64) * stride_sm + pk * stride_sk, scale, mask=s_mask)

    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + offs_k
        mask = mask_m[:, None] & (cols < k_end)[None, :]
        x = tl.load(x_row + cols.to(tl.int64)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        q = fp8_apply(x, factor[:, None], q_ptr.dtype.element_ty, TORCHAO)
        tl.store(q_row + cols.to(tl.int64)[None, :] * stride_qk, q, mask=mask)


@triton.jit
def quantize_pair_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K,
    stride_xm, stride_xk, stride_qm, stride_sm, stride_sk, stride_tk, stride_stk, stride_stm,
    POW2: tl.constexpr, BLOCK_M: tl.constexpr, TORCHAO: tl.constexpr = False,
):
    """x's 1x128 quantisation and x.t()'s, from one read of x (quantize_fp8(x, transposed=True)),
    under either scale rule (TORCHAO: core/fp8.py).

    x_ptr [M, K] (fp32/bf16/fp16, any strides). q_ptr [M, K] fp8 (column stride 1) with its
    scales s_ptr [M, ceil(K/128)]; qt_ptr [K, M] fp8 (column stride 1): x.t()'s blocks run
    along x's rows, so each of its scales st_ptr [K, ceil(M/128)] belongs to one column of x
    and 128 of its rows.
    Grid: (cdiv(M, 128), cdiv(K, 128)); program (pm, pk) owns x's 128x128 block (pm, pk) and
    walks it BLOCK_M rows at a time (the whole block in registers spills). Pass 1: each
    column's amax over the block (x.t()'s scales). Pass 2, per BLOCK_M rows (again from
    L1/L2): their own amax and scale, both casts and both stores.
    """
    SCALE: tl.constexpr = _SCALE_BLOCK
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    cols = pk * SCALE + tl.arange(0, SCALE)
    mask_k = cols < K
    x_cols = x_ptr + cols.to(tl.int64)[None, :] * stride_xk
    dtype = q_ptr.dtype.element_ty

    col_amax = tl.zeros((SCALE,), dtype=tl.float32)
    for r0 in range(0, SCALE, BLOCK_M):
        rows = pm * SCALE + r0 + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & mask_k[None, :]
        x = tl.load(x_cols + rows.to(tl.int64)[:, None] * stride_xm, mask=mask, other=0.0).to(tl.float32)
        col_amax = tl.maximum(col_amax, tl.max(amax_input(x), axis=0))
    col_scale, col_factor = fp8_scales(col_amax, dtype, POW2, TORCHAO)
    tl.store(st_ptr + cols.to(tl.int64) * stride_stk + pm * stride_stm, col_scale, mask=mask_k)

    for r0 in range(0, SCALE, BLOCK_M):
        rows = pm * SCALE + r0 + tl.arange(0, BLOCK_M)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_cols + rows.to(tl.int64)[:, None] * stride_xm, mask=mask, other=0.0).to(tl.float32)
        scale, factor = fp8_scales(tl.max(amax_input(x), axis=1), dtype, POW2, TORCHAO)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sm + pk * stride_sk, scale, mask=mask_m)
        q = fp8_apply(x, factor[:, None], dtype, TORCHAO)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :], q, mask=mask)
        q_t = tl.trans(fp8_apply(x, col_factor[None, :], dtype, TORCHAO))  # [128 columns of x, BLOCK_M rows]
        tl.store(qt_ptr + cols.to(tl.int64)[:, None] * stride_tk + rows[None, :], q_t, mask=tl.trans(mask))


@triton.jit
def transpose_kernel(src_ptr, dst_ptr, R, C, stride_sr, stride_sc, stride_dc, stride_dr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst = src.t(), element for element (any dtype; blockscaled/ passes fp8 as uint8).

    src_ptr [R, C], element [r, c] at src_ptr + r*stride_sr + c*stride_sc; dst_ptr [C, R],
    element [c, r] at dst_ptr + c*stride_dc + r*stride_dr.
    Grid: (cdiv(R, BLOCK_R), cdiv(C, BLOCK_C)); program (pr, pc) moves the tile at rows
    pr*BLOCK_R and columns pc*BLOCK_C (Triton converts the loaded tile's layout so that the
    load and the store are both coalesced).
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    r64, c64 = rows.to(tl.int64)[:, None], cols.to(tl.int64)[None, :]
    tile = tl.load(src_ptr + r64 * stride_sr + c64 * stride_sc, mask=mask)
    tl.store(dst_ptr + c64 * stride_dc + r64 * stride_dr, tile, mask=mask)


QUANTIZE = Launcher(quantize_kernel, "quantize")
QUANTIZE_PAIR = Launcher(quantize_pair_kernel, "quantize_pair")
TRANSPOSE = Launcher(transpose_kernel, "transpose")


def granularity(block) -> Granularity:
    """quantize_fp8's ``block`` argument (checked) as the scales' Granularity."""
    return {(1, SCALE_BLOCK): ROW_BLOCKS, (SCALE_BLOCK, SCALE_BLOCK): BLOCKS, "row": ROW, "tensor": TENSOR}[block]


def _scale_shape(block: Granularity, M: int, K: int) -> tuple:
    mb, kb = cdiv(M, SCALE_BLOCK), cdiv(K, SCALE_BLOCK)
    return {ROW_BLOCKS: (M, kb), BLOCKS: (mb, kb), ROW: (M, 1), TENSOR: ()}[block]


def _quantize_triton(x: torch.Tensor, block: Granularity, dtype: torch.dtype, pow2_scale: bool,
                     transposed: bool = False, torchao: bool = False):
    """The fused kernel for 1x128, 128x128 and row scales; returns (q, scale), and with
    ``transposed`` (q_t, scale_t) of x.t() after them. ``torchao``: torchao's scale rule."""
    return _triton_quantizer(x, block, dtype, pow2_scale, transposed, torchao)(x)


def _scale_storage(block: Granularity, M: int, K: int, device):
    """An empty scale of x [M, K] in the layout the kernel writes: 1x128 outer-dim-major (a
    transposed [kb, M], torch._scaled_mm's scale_a layout; the GEMM's K loop then loads
    BLOCK_M consecutive scales, coalesced), the others row-major."""
    shape = _scale_shape(block, M, K)
    if block == ROW_BLOCKS:
        return empty(shape[::-1], dtype=torch.float32, device=device).t()
    return empty(shape, dtype=torch.float32, device=device)


def transposed_empty(K: int, M: int, dtype: torch.dtype, device, fake_like=None):
    """q_t [K, M] with rows padded to a multiple of 16 bytes (a [K, M] view of [K, M rounded up
    to 16]): a GEMM reads it K-major through TMA, which needs 16-byte aligned rows, whatever
    the token count M. ``fake_like``: a fake tensor to allocate like (torch.compile)."""
    rows = (K, cdiv(M, 16) * 16)
    full = fake_like.new_empty(rows, dtype=dtype) if fake_like is not None else empty(rows, dtype=dtype, device=device)
    return full[:, :M]


def _triton_quantizer(x: torch.Tensor, block: Granularity, dtype: torch.dtype, pow2_scale: bool,
                      transposed: bool = False, torchao: bool = False):
    """``_quantize_triton`` as a callable x -> (q, scale[, q_t, scale_t]) for inputs of x's
    signature (the plan, grid and strides fixed): what a record keeps. ``transposed``: 1x128
    by quantize_pair_kernel (one read of x); row scales by a second launch on x.t() (each of
    its scales is a column of x, over every row); 128x128 blocks are the same blocks transposed
    (the same elements over the same scales), so q_t is q's fp8 transpose, copied by
    transpose_kernel (one pass storing each tile a second time, transposed, gave wrong values
    on sm_90 with Triton 3.6, though right under the interpreter: docs/performance.md)."""
    if transposed:
        if block == ROW_BLOCKS:
            return _pair_quantizer(x, dtype, pow2_scale, torchao)
        direct = _triton_quantizer(x, block, dtype, pow2_scale, torchao=torchao)
        if block == ROW:
            return _row_pair(x, direct, dtype, pow2_scale, torchao)
        transpose = _transposer(*x.shape, dtype, x.device)

        def both(x):
            q, scale = direct(x)
            # scale_t is a copy: where scale.t() is contiguous, .contiguous() would hand back scale itself
            return q, scale, transpose(q), scale.t().clone(memory_format=torch.contiguous_format)

        return both
    M, K = x.shape
    device = x.device
    scale = _scale_storage(block, M, K, device)
    scale_shape, scale_stride = scale.shape, scale.stride()

    def outputs():
        return (empty_strided((M, K), (K, 1), dtype=dtype, device=device),
                empty_strided(scale_shape, scale_stride, dtype=torch.float32, device=device))

    launch = quantize_launch(x, block, dtype, pow2_scale, torchao)
    if block == TENSOR:
        with_amax = launch
        launch = lambda x, q, scale: with_amax(x, q, scale, tensor_amax(x))  # noqa: E731
    return _allocating(outputs, launch)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor in fp32, on x's device (one reduction read of x, no sync):
    quantize_kernel's amax for tensor-wise scales (NaN stays NaN; the kernel counts it as inf)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def _row_pair(x: torch.Tensor, direct, dtype: torch.dtype, pow2_scale: bool, torchao: bool):
    """x -> (q, scale, q_t, scale_t) with row scales: ``direct`` for x, and quantize_kernel on
    x.t() (a strided view: the loads run along x's contiguous rows) writing q_t as
    ``transposed_empty`` lays it out."""
    M, K = x.shape
    device = x.device
    x_t = x.t()
    launch_t = quantize_launch(x_t, ROW, dtype, pow2_scale, torchao, q_row_stride=transposed_empty(K, M, dtype, device).stride(0))

    def run(x):
        q, scale = direct(x)
        q_t, scale_t = transposed_empty(K, M, dtype, device), empty((K, 1), dtype=torch.float32, device=device)
        launch_t(x.t(), q_t, scale_t)
        return q, scale, q_t, scale_t

    return run


def _allocating(outputs, launch):
    """x -> the tensors ``outputs()`` makes, written by ``launch(x, *them)``: a quantiser's call."""
    def run(x):
        out = outputs()
        launch(x, *out)
        return out

    return run


def quantize_launch(x: torch.Tensor, block: Granularity, dtype: torch.dtype, pow2_scale: bool, torchao: bool = False,
                    q_row_stride: int | None = None) -> Launch:
    """quantize_kernel's launch for x's signature (1x128, 128x128, row or tensor scales): a
    core/dispatch.py Launch whose builder takes (x, q, scale[, amax]), q [M, K] with column
    stride 1 and row stride ``q_row_stride`` (default K), scale as ``_scale_storage`` lays it
    out, and for tensor scales the fp32 max |x| (``tensor_amax``); what a record that owns its
    outputs (Fp8Linear's workspace) launches. ``torchao``: torchao's scale rule (core/fp8.py)."""
    M, K = x.shape
    device = x.device
    cols_per_scale = K if block == ROW else SCALE_BLOCK
    rows_per_scale = SCALE_BLOCK if block == BLOCKS else 1
    scale0 = _scale_storage(block, M, K, device)
    q_row_stride = K if q_row_stride is None else q_row_stride
    strides = (*x.stride(), q_row_stride, 1, *(scale0.stride() if block != TENSOR else (0, 0)))

    def args(x, q, scale, amax=None):
        return (x, q, scale, scale if amax is None else amax, M, K, cols_per_scale, *strides)

    def grid(plan):
        return (cdiv(M, plan.meta["BLOCK_M"]), cdiv(K, cols_per_scale))

    def trial(plan):  # autotuning's launch, on outputs of its own (allocated only if it runs)
        QUANTIZE.launch(plan, grid(plan), args(x, empty((M, q_row_stride), dtype=dtype, device=device), scale0))

    plan = QUANTIZE.plan_for(Request(
        QuantKey(configs.m_bucket(M), K, block),
        dict(POW2=pow2_scale, ROWS_PER_SCALE=rows_per_scale, TORCHAO=torchao, AMAX_GIVEN=block == TENSOR),
        device, None, trial))
    return Launch(QUANTIZE, plan, grid(plan), args)


def _transposer(M: int, K: int, dtype: torch.dtype, device):
    """transpose_kernel's call for a row-major fp8 q [M, K]: q -> q.t() as ``transposed_empty``
    (rows padded to 16 bytes), moved as bytes (the bits are the copy's, on every device)."""
    def grid(plan):
        return (cdiv(M, plan.meta["BLOCK_R"]), cdiv(K, plan.meta["BLOCK_C"]))

    def args(q, q_t):  # both viewed as uint8
        return (q, q_t, M, K, K, 1, q_t.stride(0), 1)

    def trial(plan):  # autotuning's launch, on buffers of its own (allocated only if it runs)
        TRANSPOSE.launch(plan, grid(plan), args(empty((M, K), dtype=torch.uint8, device=device),
                                                transposed_empty(K, M, dtype, device).view(torch.uint8)))

    plan = TRANSPOSE.plan_for(Request(configs.PrepKey("transpose", configs.m_bucket(M * K, 1 << 24)), {}, device, None,
                                      trial))
    launch = Launch(TRANSPOSE, plan, grid(plan), args)

    def run(q):
        q_t = transposed_empty(K, M, dtype, device)
        launch(q.view(torch.uint8), q_t.view(torch.uint8))
        return q_t

    return run


def _pair_quantizer(x: torch.Tensor, dtype: torch.dtype, pow2_scale: bool, torchao: bool = False):
    """quantize_pair_kernel's call for x's signature: x -> (q, scale, q_t, scale_t), 1x128."""
    M, K = x.shape
    device = x.device

    def outputs():
        return (empty((M, K), dtype=dtype, device=device), _scale_storage(ROW_BLOCKS, M, K, device),
                transposed_empty(K, M, dtype, device), _scale_storage(ROW_BLOCKS, K, M, device))

    out0 = outputs()
    strides = (*x.stride(), K, *out0[1].stride(), out0[2].stride(0), *out0[3].stride())
    grid = (cdiv(M, SCALE_BLOCK), cdiv(K, SCALE_BLOCK))

    def args(x, q, scale, q_t, scale_t):
        return (x, q, scale, q_t, scale_t, M, K, *strides)

    plan = QUANTIZE_PAIR.plan_for(Request(
        QuantKey(configs.m_bucket(M), K, ROW_BLOCKS), dict(POW2=pow2_scale, TORCHAO=torchao), device, None,
        lambda plan: QUANTIZE_PAIR.launch(plan, grid, args(x, *out0))))

    return _allocating(outputs, Launch(QUANTIZE_PAIR, plan, grid, args))


# ---- torch: the CPU path (the interpreter's fp8 cast turns NaN into 384) and "tensor" ----


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, pow2_scale: bool) -> torch.Tensor:
    # Divide by a tensor, not a Python float: CUDA divides by a scalar as a multiply by its
    # reciprocal, 1 ulp off the correctly rounded quotient the kernel and the reference give.
    scale = torch.where(amax > 0, (amax / amax.new_full((), fp8_max(dtype))).clamp_min(FLT_MIN), 1.0)
    if pow2_scale:  # the bit trick of core/fp8.py `round_up_pow2`
        bits = scale.view(torch.int32)
        up = ((bits & 0x7FFFFF) != 0).to(torch.int32) * 0x800000
        scale = ((bits & 0x7F800000) + up).view(torch.float32)
    return scale


def _torchao_multiplier(amax: torch.Tensor, dtype: torch.dtype, pow2_scale: bool) -> torch.Tensor:
    """torchao's rule (core/fp8.py): FP8_MAX / max(amax, 1e-12) in float64, rounded to fp32,
    pow2: rounded down to a power of two by its exponent bits."""
    mult = (fp8_max(dtype) / amax.double().clamp_min(1e-12)).float()
    if pow2_scale:
        mult = (mult.view(torch.int32) & 0x7F800000).view(torch.float32)
    return mult


def _quantize_torch(x: torch.Tensor, block: Granularity, dtype: torch.dtype, pow2_scale: bool, torchao: bool = False):
    M, K = x.shape
    x = x.float()
    ax = x.abs()
    ax = torch.where(torch.isnan(ax), float("inf"), ax)  # NaN counts as inf (module docstring)
    rb, cb = block.rows or max(M, 1), block.cols or max(K, 1)  # None: the whole dimension
    # Zero padding to whole blocks leaves every amax unchanged (|x| >= 0).
    ax = F.pad(ax, (0, (-K) % cb, 0, (-M) % rb))
    amax = einops.reduce(ax, "(mb rb) (kb cb) -> mb kb", "max", rb=rb, cb=cb)
    fmax = fp8_max(dtype)
    if torchao:
        mult = _torchao_multiplier(amax, dtype, pow2_scale)
        scale = mult.reciprocal()
        scaled = x * einops.repeat(mult, "mb kb -> (mb rb) (kb cb)", rb=rb, cb=cb)[:M, :K]
    else:
        scale = _scale_from_amax(amax, dtype, pow2_scale)
        scaled = x / einops.repeat(scale, "mb kb -> (mb rb) (kb cb)", rb=rb, cb=cb)[:M, :K]
    q = scaled.clamp(-fmax, fmax).to(dtype).contiguous()  # row-major, as the kernel writes it, for any x
    if block == ROW_BLOCKS:
        scale = scale.t().contiguous().t()  # outer-dim-major, as the kernel writes it
    return q, scale.reshape(_scale_shape(block, M, K))


def _check_args(x, block, dtype, pow2_scale, name="x", scale_rule="onegemm"):
    checks.check_tensor(name, x, ndim=2, dtypes=IN_DTYPES)
    if not isinstance(block, str):
        block = tuple(block) if isinstance(block, (tuple, list)) else block
    checks.check_choice("block", block, BLOCK_ARGS)
    if dtype not in checks.FP8_DTYPES:
        raise checks.bad_dtype("dtype", "torch.float8_e4m3fn or torch.float8_e5m2", dtype)
    checks.check_bool("pow2_scale", pow2_scale)
    checks.check_choice("scale_rule", scale_rule, SCALE_RULES)
    return block


def quantize_fp8(x, block=(1, SCALE_BLOCK), *, dtype=torch.float8_e4m3fn, pow2_scale=False, check_finite=False,
                 transposed=False, scale_rule="onegemm"):
    """Quantise x [M, K] to fp8 with fp32 scales: x ~= q.float() * scale per block.

    block: (1, 128) -> scale [M, ceil(K/128)] (stored outer-dim-major on the GPU, the layout
        torch._scaled_mm wants for scale_a); (128, 128) -> [ceil(M/128), ceil(K/128)];
        "row" -> [M, 1]; "tensor" -> 0-dim.
    dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344); values saturate there.
    pow2_scale: round each scale up to a power of two (exact rescaling), quantising with it.
    transposed: also quantise x.t(), and return (q, scale, q_t, scale_t), where (q_t,
        scale_t) are quantize_fp8(x.t(), block) bit for bit: q_t [K, M] row-major, its rows
        padded to a multiple of 16 bytes (the alignment TMA needs, so a GEMM can read it
        whatever M is). With (1, 128) blocks x.t()'s run along M (what a weight-gradient GEMM
        dY^T @ X reduces over), from the same read of x; "row" scales x.t() per column of x
        (a second pass over x); (128, 128) blocks and "tensor" are the same blocks transposed,
        so scale_t is scale.t() and q_t is q's transpose.
    scale_rule: "onegemm" (the module docstring's rule) or "torchao", torchao's float8 rule:
        scale = 1 / m with the fp32 multiplier m = FP8_MAX / max(amax, 1e-12) (with
        pow2_scale rounded down to a power of two, as its row-wise recipe does) and
        q = fp8(clamp(x * m)), so the bits are torchao's (``q * scale`` dequantises both).
    An all-zero block gets scale 1.0 and zeros. A block holding NaN or inf gets an inf scale,
    so it dequantises to NaN (never to finite values); nothing is read back to the host, so
    the call can be captured in a CUDA graph. check_finite=True reads the scales back (a
    device sync) and raises ValueError for non-finite input instead.
    On a GPU, a fused Triton kernel (amax + scale + cast; "tensor": torch's reduction for the
    amax, then the kernel's cast); on CPU, the torch path.
    Traceable by torch.compile. Not differentiable: an x that requires grad is an error.
    """
    return QUANTIZE_FP8(x, block, dtype, pow2_scale, check_finite, transposed, scale_rule)


def _quantize_fp8_route(args):
    """quantize_fp8's checks, then the registered op's route (core/dispatch.py)."""
    x, block, dtype, pow2_scale, check_finite, transposed, scale_rule = args
    block = _check_args(x, block, dtype, pow2_scale, scale_rule=scale_rule)
    checks.check_bool("check_finite", check_finite)
    checks.check_bool("transposed", transposed)
    checks.check_not_differentiable("quantize_fp8", x=x)
    gran = granularity(block)
    op = QUANTIZE_T_OP if transposed else QUANTIZE_OP
    inner = op.route((x, str(gran), dtype, pow2_scale, check_finite, scale_rule))

    if gran != ROW_BLOCKS:
        return inner

    def run(x):
        return _flip_row_scales(*inner(x))  # the [M, kb] view of the [kb, M] storage

    return run


def _scale_view(scale, block: Granularity):
    # The registered op returns fresh contiguous tensors (not views); 1x128 scales are stored
    # [kb, M] and handed out as their transpose [M, kb] (outer-dim-major).
    return scale.t() if block == ROW_BLOCKS else scale


def _quantize_impl(x: torch.Tensor, block: str, dtype: torch.dtype, pow2_scale: bool,
                   check_finite: bool, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 on checked arguments, the block and the scale rule by name; 1x128 scales
    come back as their [ceil(K/128), M] storage (``_scale_view`` gives the [M, ceil(K/128)] view)."""
    return QUANTIZE_OP.direct(x, block, dtype, pow2_scale, check_finite, rule)


def _quantize_t_impl(x: torch.Tensor, block: str, dtype: torch.dtype, pow2_scale: bool,
                     check_finite: bool, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_quantize_impl`` of x and of x.t(): (q, scale, q_t, scale_t), scales as stored."""
    return QUANTIZE_T_OP.direct(x, block, dtype, pow2_scale, check_finite, rule)


def _quantize_record(x, block: str, dtype, pow2_scale, check_finite, rule, *, transposed=False):
    """The registered op's body for x's signature: a callable x -> (q, scale storage), with
    ``transposed`` followed by x.t()'s (q_t, scale_t storage)."""
    block = Granularity.parse(block)
    torchao = rule == "torchao"
    M, K = x.shape
    if x.numel() == 0:
        def run(x):
            out = ()
            for i, (m, k) in enumerate(((M, K), (K, M))[:1 + transposed]):
                ones = torch.ones(_scale_shape(block, m, k), device=x.device)
                q = transposed_empty(m, k, dtype, x.device) if i else torch.empty((m, k), dtype=dtype, device=x.device)
                out += (q, _scale_view(ones, block).contiguous())
            return out
        return run
    if INTERPRET:
        # Under the interpreter the kernels give these bits for finite x (tests/test_blockscaled.py),
        # but their fp8 cast turns the NaN of a non-finite block into 384, a finite value.
        def quantize(x):
            out = _quantize_torch(x, block, dtype, pow2_scale, torchao)
            if not transposed:
                return out
            q_t, scale_t = _quantize_torch(x.t(), block, dtype, pow2_scale, torchao)
            return (*out, transposed_empty(K, M, dtype, x.device).copy_(q_t), scale_t)
    else:
        quantize = _triton_quantizer(x, block, dtype, pow2_scale, transposed, torchao)
        if not check_finite:
            # The kernels' scales are their storage already (1x128: the transpose of a [kb, rows]
            # tensor, whose .t() is that tensor; the others contiguous): nothing to copy.
            if block != ROW_BLOCKS:
                return quantize
            return lambda x: _flip_row_scales(*quantize(x))

    def run(x):
        out = quantize(x)
        if check_finite and not bool(torch.isfinite(out[1]).all()):
            raise checks.bad_value("x", "finite with check_finite=True", "NaN or inf (a block's scale would be inf)")
        return tuple(_scale_view(t, block).contiguous() if i % 2 else t for i, t in enumerate(out))

    return run


def _flip_row_scales(q, scale, *transposed):
    """(q, scale.t()[, q_t, scale_t.t()]): 1x128 scales between their [rows, kb] view and its
    [kb, rows] storage, either way."""
    if not transposed:
        return q, scale.t()
    q_t, scale_t = transposed
    return q, scale.t(), q_t, scale_t.t()


def _quantize_fake(x, block, dtype, pow2_scale, check_finite, rule, *, transposed=False):
    M, K = x.shape
    gran = Granularity.parse(block)
    out = ()
    for i, (m, k) in enumerate(((M, K), (K, M))[:1 + transposed]):
        shape = _scale_shape(gran, m, k)
        out += (transposed_empty(m, k, dtype, None, x) if i else x.new_empty((m, k), dtype=dtype),
                x.new_empty(shape[::-1] if gran == ROW_BLOCKS else shape, dtype=torch.float32))
    return out


QUANTIZE_OP = Op("quantize_fp8", _quantize_impl, _quantize_fake, record=_quantize_record, tensors=1)
QUANTIZE_T_OP = Op("quantize_fp8_transposed", _quantize_t_impl, lambda *args: _quantize_fake(*args, transposed=True),
                   record=lambda *args: _quantize_record(*args, transposed=True), tensors=1)
QUANTIZE_FP8 = Cached(1, _quantize_fp8_route)


# e2m1's magnitudes, codes 0-7 (code 8 + i is -E2M1[i])
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_mxfp4(w: torch.Tensor):
    """w [..., K] (K a multiple of 32; fp32, bf16, fp16) -> MXFP4 (q float4_e2m1fn_x2 [..., K/2],
    scale float8_e8m0fnu [..., K/32]), the OCP MX rule: each 32 values' scale 2^(floor(log2
    amax) - 2) (e8m0 clamped to [0, 254]; an all-zero block 2^-127), each value / scale rounded
    to the nearest e2m1 value (ties to the even code, +-6 past it), two per byte along K, the
    first in the lower nibble. In torch, exactly (power-of-two scales divide exactly in fp32), on
    any device (checkpoints are written from CPU tensors too)."""
    checks.check_tensor("w", w, dtypes=checks.FLOAT_DTYPES, any_device=True)
    if w.dim() == 0 or w.shape[-1] % MXFP4_BLOCK:
        raise checks.bad_shape("w", f"[..., K] with K a multiple of {MXFP4_BLOCK} (MXFP4's block)", w.shape)
    x = w.detach().float().unflatten(-1, (-1, MXFP4_BLOCK))
    _, e = torch.frexp(x.abs().amax(dim=-1))  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    s = torch.where(x.abs().amax(dim=-1) > 0, (e - 1 - 2 + 127).clamp(0, 254), 0)
    a = (x.abs() * torch.ldexp(torch.ones_like(x), (127 - s)[..., None])).clamp(max=_E2M1[-1])
    table = torch.tensor(_E2M1, device=w.device)
    hi = torch.searchsorted(table, a.contiguous()).clamp(max=len(_E2M1) - 1)  # the first magnitude >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    codes = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi) | (torch.signbit(x).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).flatten(-2)
    return packed.view(MXFP4), s.to(torch.uint8).view(MXFP4_SCALE)


def dequantize_mxfp4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """quantize_mxfp4's inverse in torch: q float4_e2m1fn_x2 [..., K/2] and scale
    float8_e8m0fnu [..., K/32] -> [..., K] in ``dtype`` (exact where ``dtype`` holds the values;
    e8m0's 255 gives NaN)."""
    codes = q.view(torch.uint8)
    codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
    table = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), device=q.device)
    s = scale.view(torch.uint8).float()
    factor = torch.where(s == 255, torch.nan, torch.exp2(s - 127))
    return (table[codes].unflatten(-1, (-1, MXFP4_BLOCK)) * factor[..., None]).flatten(-2).to(dtype)


def quantize_int4(w: torch.Tensor, group: int = 32, scale_dtype: torch.dtype | None = None, *,
                  zero_point: bool = False):
    """w [..., K] (fp32, bf16, fp16; K a multiple of ``group``, a power of two >= 32) -> INT4 as
    compressed-tensors' symmetric "pack-quantized" format stores it: (q int32 [..., K/8], scale
    [..., K/group] in ``scale_dtype``, default w's dtype). Each group's scale is amax / 7.5
    (the range -8..7 over 15 steps; an all-zero group 1), rounded to scale_dtype; each value
    round(w / scale) (half to even) clamped to -8..7, stored as value + 8, eight per int32
    along K, the first in the lowest 4 bits. In torch, on any device.

    zero_point=True: asymmetric groups, GPTQ's and AWQ's min-max rule: scale = (max - min) / 15
    over the group's values and 0 (1 for a constant group), rounded to scale_dtype (bfloat16 or
    float16); zero = round(-min / scale) in 0..15; code = round(w / scale) + zero clamped to
    0..15, so w ~= (code - zero) * scale. The scale comes back with its zero point as
    ``pack_int4_zeros`` packs them (int32 [..., K/group])."""
    checks.check_tensor("w", w, dtypes=checks.FLOAT_DTYPES, any_device=True)
    if group < INT4_MIN_GROUP or group & (group - 1):
        raise checks.bad_value("group", f"a power of two >= {INT4_MIN_GROUP}", group)
    if scale_dtype is not None and scale_dtype not in checks.FLOAT_DTYPES:
        raise checks.bad_dtype("scale_dtype", "None (w's dtype), float32, bfloat16 or float16", scale_dtype)
    checks.check_bool("zero_point", zero_point)
    if w.dim() == 0 or w.shape[-1] % group:
        raise checks.bad_shape("w", f"[..., K] with K a multiple of group ({group})", w.shape)
    x = w.detach().float().unflatten(-1, (-1, group))
    if zero_point:
        scale_dtype = scale_dtype or w.dtype
        if scale_dtype not in _ZERO_SCALE_DTYPES:
            raise checks.bad_dtype("scale_dtype", "bfloat16 or float16 with zero_point=True (a zero point shares "
                                   "the 16-bit scale's int32 word)", scale_dtype)
        lo, hi = x.amin(dim=-1).clamp(max=0), x.amax(dim=-1).clamp(min=0)
        scale = torch.where(hi > lo, (hi - lo) / 15, 1.0).to(scale_dtype)
        zero = torch.round(-lo / scale.float()).clamp(0, 15)
        codes = (torch.round(x / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
        return _pack_codes(codes), pack_int4_zeros(scale, zero.to(torch.uint8))
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 7.5, 1.0).to(scale_dtype or w.dtype)
    return _pack_codes(torch.round(x / scale.float()[..., None]).clamp(-8, 7) + 8), scale


_ZERO_SCALE_DTYPES = (torch.bfloat16, torch.float16)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K / group, group] -> int32 [..., K / 8], eight per word along K, the
    first in the lowest 4 bits."""
    codes = codes.to(torch.int32).flatten(-2)
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int32)
    packed = (codes.unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.int64)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(INT4)  # the int32 bit pattern


def pack_int4_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Asymmetric INT4's scales and zero points as the kernels read them: int32 words of the
    same shape, each the scale's fp32 bits (bfloat16 or float16 scales, whose fp32 form has
    its low 13 bits zero) with the zero point (an integer 0..15, any dtype) in the low byte.
    Lossless: ``unpack_int4_zeros`` gives both back. In torch, on any device."""
    checks.check_tensor("scale", scale, dtypes=_ZERO_SCALE_DTYPES, any_device=True)
    checks.check_tensor("zero", zero, any_device=True)
    checks.check_shape("zero", zero, tuple(scale.shape), f"scale's shape {list(scale.shape)}")
    if zero.is_floating_point() or bool(((zero < 0) | (zero > 15)).any()):  # one check per conversion
        raise checks.bad_value("zero", "integers in 0..15", f"{zero.dtype} from {zero.min().item()} to "
                               f"{zero.max().item()}" if zero.numel() else zero.dtype)
    return scale.float().view(torch.int32) | zero.to(torch.int32)


def unpack_int4_zeros(scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int4_zeros``' inverse: int32 words -> (scale float32, zero uint8); the scale's
    16-bit dtype takes it back exactly."""
    checks.check_tensor("scale_zero", scale_zero, dtypes=(INT4_ZERO,), any_device=True)
    return (scale_zero & -256).view(torch.float32), (scale_zero & 0xFF).to(torch.uint8)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """quantize_int4's inverse in torch: q int32 [..., K/8] and scale [..., K/group] ->
    [..., K] in ``dtype``: (code - 8) * scale in fp32, rounded once to ``dtype``; with int32
    scales (``pack_int4_zeros``) (code - zero) * scale."""
    codes = torch.stack([(q.view(torch.uint8) & 0xF), q.view(torch.uint8) >> 4], dim=-1).flatten(-2).float()
    group = codes.shape[-1] // scale.shape[-1]
    codes = codes.unflatten(-1, (-1, group))
    if scale.dtype == INT4_ZERO:
        scale, zero = unpack_int4_zeros(scale)
        values = codes - zero.float()[..., None]
    else:
        values = codes - 8
    return (values * scale.float()[..., None]).flatten(-2).to(dtype)
