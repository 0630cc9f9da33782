"""The sm_90 body of the block-scaled FP8 tile, written in Gluon (docs/hopper.md, "Two K-loop bodies").

Block-scaled FP8 promotes each K block's product to the fp32 accumulator with its scales:
``acc += dot(a_k, b_k) * sa_k[:, None] * sb_k``. In Triton's language the promotion of block k
waits for block k's wgmma, so the tensor cores idle while it runs. This body issues block k's
wgmma asynchronously and promotes block k-1 while it runs, which Triton 3.6 can only express
in Gluon (``triton.experimental.gluon``).

What it shares with core's Triton body (core/tiles.py): the tile order (``swizzle_tile``, the
persistent walk of ``program_units``), the scale conventions (``Scales``: SA_ROWS / SB_COLS
rows and columns per scale, 1 or 128), and the epilogue (``tiles.epilogue``: epilogue scales,
bias, activation; then the out dtype's store). Only the K loop and the store path differ.

Structure (one program per SM, persistent over 128 x BLOCK_N output tiles):
- a loader warp streams A [128, 128] and W [BLOCK_N, 128] K blocks through a ring of STAGES
  shared-memory slots with TMA, with a ``ready`` barrier (TMA bytes landed) and an ``empty``
  barrier (both consumers have finished reading) per slot;
- two consumer warpgroups, independent partitions with their own schedule, each own 64 rows
  of the tile: the default partition rows 0-63, a worker partition rows 64-127;
- each consumer runs the K loop in groups of K_GROUP blocks, unrolled: issue block j's wgmma,
  wait until only it is in flight, promote block j-1. A group ends drained (wait for none in
  flight): a loop-carried in-flight accumulator made ptxas serialise every wgmma (C7515).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import checks, configs
from .dispatch import Launch
from .launch import Launcher, Request
from .runtime import INTERPRET, cdiv, sm_count
from .tiles import NO_VECTOR, Operand, Scales, Vector, epilogue, swizzle_tile
from .tma import tma_layout

ROWS = gl.constexpr(64)  # rows per consumer warpgroup: the M of one warpgroup's wgmma


@triton.constexpr_function
def _acc_layout(block_n):
    # one warpgroup ([4, 1] warps) over [ROWS, block_n]; fp8 wgmma takes K = 32 per instruction
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 32])


@gluon.jit
def _tile_origin(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    pid_m, pid_n = swizzle_tile(tile, gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr):
    """The TMA loader: every K block of every tile this program owns, in the consumers' order."""
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    k_blocks = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for kb in range(k_blocks):
            s = it % STAGES
            # a fresh barrier has completed no phase: waiting for parity 1 passes at once
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kb * BLOCK_K], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, kb * BLOCK_K], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _block_scales(scales, kb, rows, mask_m, off_m, off_n, cols, mask_n, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr):
    """K block kb's scales of these rows and columns: a vector for 1x128 / 128x1 blocks, a
    scalar where one 128-wide block covers the tile (128x128: BLOCK_M and BLOCK_N <= 128)."""
    if SA_ROWS == 1:
        sa = gl.load(scales.a.ptr + rows.to(gl.int64) * scales.a.stride0 + kb * scales.a.stride1, mask=mask_m,
                     other=0.0)
    else:
        sa = gl.load(scales.a.ptr + (off_m // SA_ROWS) * scales.a.stride0 + kb * scales.a.stride1)
    if SB_COLS == 1:
        sb = gl.load(scales.b.ptr + kb * scales.b.stride0 + cols.to(gl.int64) * scales.b.stride1, mask=mask_n,
                     other=0.0)
    else:
        sb = gl.load(scales.b.ptr + kb * scales.b.stride0 + (off_n // SB_COLS) * scales.b.stride1)
    return sa, sb


@gluon.jit
def _promote(acc, raw, sa, sb, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr):
    """acc + raw * sa[rows] * sb[cols], with the two scale factors folded first where one is a
    scalar (one multiply-add per element)."""
    if SB_COLS == 1:
        if SA_ROWS == 1:
            return acc + raw * sa[:, None] * sb[None, :]
        else:
            return acc + raw * (sb * sa)[None, :]
    else:
        if SA_ROWS == 1:
            return acc + raw * (sa * sb)[:, None]
        else:
            return acc + raw * (sa * sb)


@gluon.jit
def _issue(a_bufs, b_bufs, ready, it, HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Start the wgmma of the K block in slot ``it % STAGES`` on this consumer's rows."""
    # use_acc=False ignores the accumulator's value; a zeros tensor kept live across the loop
    # would hold 64 more registers per thread
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, _acc_layout(BLOCK_N))
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    a = a_bufs.index(s).slice(HALF * ROWS, ROWS, dim=0)
    return warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _consume_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, scales, bias,
                       HALF: gl.constexpr, ACTIVATION: gl.constexpr, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, K_GROUP: gl.constexpr):
    """One consumer warpgroup: rows HALF * 64 .. HALF * 64 + 63 of every tile, K loop and epilogue."""
    layout: gl.constexpr = _acc_layout(BLOCK_N)
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    k_blocks = gl.cdiv(K, BLOCK_K)
    groups = k_blocks // K_GROUP
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = off_m + HALF * ROWS
        rows = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        mask_m = rows < M
        mask_n = cols < N
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
        # Scales are loaded one K block ahead of their wgmma's issue (two ahead of their
        # promotion): an L2 round trip is about as long as one block's wgmma.
        last = k_blocks - 1
        sa_n, sb_n = _block_scales(scales, 0, rows, mask_m, off_m, off_n, cols, mask_n, SA_ROWS, SB_COLS)
        for g in range(groups):
            kb = g * K_GROUP
            sa, sb = sa_n, sb_n
            sa_n, sb_n = _block_scales(scales, gl.minimum(kb + 1, last), rows, mask_m, off_m, off_n, cols, mask_n,
                                       SA_ROWS, SB_COLS)
            raw = _issue(a_bufs, b_bufs, ready, it, HALF, BLOCK_N, STAGES)
            for j in gl.static_range(1, K_GROUP):
                next_sa, next_sb = sa_n, sb_n
                sa_n, sb_n = _block_scales(scales, gl.minimum(kb + j + 1, last), rows, mask_m, off_m, off_n, cols,
                                           mask_n, SA_ROWS, SB_COLS)
                next_raw = _issue(a_bufs, b_bufs, ready, it + j, HALF, BLOCK_N, STAGES)
                # block j - 1 is done once at most one wgmma (block j's) is in flight
                raw = warpgroup_mma_wait(num_outstanding=1, deps=(raw, ))
                mbarrier.arrive(empty.index((it + j - 1) % STAGES))
                acc = _promote(acc, raw, sa, sb, SA_ROWS, SB_COLS)
                # Pass acc through a wait that lets block j run on: the promotion cannot then
                # sink below the next block's issue, where three raw tiles would be live (spills).
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                raw, sa, sb = next_raw, next_sa, next_sb
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw, ))
            mbarrier.arrive(empty.index((it + K_GROUP - 1) % STAGES))
            acc = _promote(acc, raw, sa, sb, SA_ROWS, SB_COLS)
            it += K_GROUP
        for kb in range(groups * K_GROUP, k_blocks):  # the K blocks left over, one at a time
            sa, sb = sa_n, sb_n
            sa_n, sb_n = _block_scales(scales, gl.minimum(kb + 1, last), rows, mask_m, off_m, off_n, cols, mask_n,
                                       SA_ROWS, SB_COLS)
            raw = _issue(a_bufs, b_bufs, ready, it, HALF, BLOCK_N, STAGES)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw, ))
            mbarrier.arrive(empty.index(it % STAGES))
            acc = _promote(acc, raw, sa, sb, SA_ROWS, SB_COLS)
            it += 1

        acc = epilogue(acc, rows, cols, mask_m, mask_n, ACTIVATION, scales, bias)
        tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)  # clipped at M and N
    tma.store_wait(pendings=0)


@gluon.jit
def blockscaled_wgmma_kernel(A, B, C, M, N, K, scales, bias,
                             ACTIVATION: gl.constexpr, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             K_GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """C = epilogue(sum over K blocks of (A_k @ B_k) * scale_a_k * scale_b_k), on sm_90.

    A: Operand over fp8 [M, K] with stride1 == 1 (row-major), 16-byte aligned rows.
    B: Operand over fp8 [K, N] with stride0 == 1: the transpose of a K-major weight W [N, K],
       which the kernel reads as W (rows of stride B.stride1), the layout fp8 wgmma takes.
    C: Operand over [M, N] (bf16, fp16 or fp32) with stride1 == 1 and 16-byte aligned rows:
       tiles leave through TMA stores, which clip at M and N.
    scales: core's Scales. .a: Operand over scale_a [M or ceil(M/128), ceil(K/128)] (SA_ROWS
       rows per scale: 1 or 128); .b: Operand over scale_b [ceil(K/128), N or ceil(N/128)]
       (SB_COLS = 1 or 128); .m / .n: epilogue Vectors (unused by onegemm's dispatch: None).
    bias: Vector over [N] or a None pointer. ACTIVATION as tiles.activate.
    BLOCK_M = 128 (two 64-row consumers), BLOCK_K = 128 (one scale block per K step);
    BLOCK_N <= 128 when SB_COLS = 128. CONSUMER_REGS: registers per thread of the worker consumer.
    Grid: (min(tiles, SMs),); each program walks tiles pid, pid + grid, ... in GROUP_M order.
    """
    gl.static_assert(BLOCK_M == 2 * ROWS)
    gl.static_assert(BLOCK_K == 128)
    gl.static_assert(SA_ROWS == 1 or SA_ROWS % BLOCK_M == 0)
    gl.static_assert(SB_COLS == 1 or SB_COLS % BLOCK_N == 0)
    dtype: gl.constexpr = A.ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], B.ptr.dtype.element_ty)
    a_desc = tma.make_tensor_descriptor(A.ptr, [M, K], [A.stride0, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(B.ptr, [N, K], [B.stride1, 1], [BLOCK_N, BLOCK_K], b_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(B.ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer

    out_dtype: gl.constexpr = C.ptr.dtype.element_ty
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], out_dtype)
    c_desc = tma.make_tensor_descriptor(C.ptr, [M, N], [C.stride0, 1], [ROWS, BLOCK_N], c_layout)
    c_smem0 = gl.allocate_shared_memory(out_dtype, [ROWS, BLOCK_N], c_layout)
    c_smem1 = gl.allocate_shared_memory(out_dtype, [ROWS, BLOCK_N], c_layout)

    # Partition arguments are written inline: a tuple bound to a name first turns its
    # constexprs into runtime values (Gluon 3.6).
    gl.warp_specialize([
        (_consume_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_smem0, M, N, K, scales, bias, 0, ACTIVATION,
                              SA_ROWS, SB_COLS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, K_GROUP)),
        (_consume_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_smem1, M, N, K, scales, bias, 1, ACTIVATION,
                              SA_ROWS, SB_COLS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, K_GROUP)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 40])


# ---------------------------------------------------------------------------- host side

BLOCKSCALED_WGMMA = Launcher(blockscaled_wgmma_kernel, configs.BLOCKSCALED_WGMMA)

# rows (scale_a) / columns (scale_b) per K-block scale, for the granularities this body serves
SA_ROWS = {"1x128": 1, "128x128": 128}
SB_COLS = {"128x1": 1, "128x128": 128}


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def on_sm90(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 GPU and kernels compile for it (not the interpreter)."""
    return not INTERPRET and t.is_cuda and _sm90(t.get_device())


def k_major_layout(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether TMA can read a [M, K] and b [K, N] K-major and write c [M, N] row-major: the
    only layout this body takes (fp8 wgmma reads both operands K-major from shared memory)."""
    layout = tma_layout(a, b, c)
    return layout is not None and layout.a_k_contig and layout.b_k_contig and a.shape[1] > 0


def wgmma_body(a, b, c, kind_a: str, kind_b: str, tma: bool | None, config) -> bool:
    """The one decision between core's two bodies of a block-scaled FP8 GEMM: this Gluon body
    on an sm_90 GPU for block scales on both operands (1x128 or 128x128 scale_a, 128x1 or
    128x128 scale_b), TMA-readable K-major operands and M >= configs.WGMMA_MIN_M; core's Triton
    body otherwise (other GPUs, the interpreter, other granularities and layouts, tma=False).

    A forced ``config`` decides by its kind (configs.is_wgmma); a Gluon config on operands
    this body cannot take is a ValueError naming what stands in the way.
    """
    if config is not None and not configs.is_wgmma(config):
        return False
    if config is None and a.shape[0] < configs.WGMMA_MIN_M:
        return False  # decode-sized calls: decided before the layout checks, off their host time
    why = None
    if not on_sm90(a):
        why = "an sm_90 GPU (Triton's interpreter and other GPUs run core's Triton body)"
    elif kind_a not in SA_ROWS or kind_b not in SB_COLS:
        why = f"block scales on both operands (scale_a 1x128 or 128x128, scale_b 128x1 or 128x128; got {kind_a}, {kind_b})"
    elif tma is False:
        why = "TMA loads (tma=False asks for pointer loads)"
    elif not k_major_layout(a, b, c):
        why = ("K-major a [M, K] and b = W.t() with 16-byte aligned rows, K > 0, and an output row of a multiple "
               "of 16 bytes")
    if config is None:
        return why is None
    if why is not None:
        raise checks.bad_value("config", f"a Triton-body config: the Gluon body (K_GROUP) needs {why}", configs.label(config))
    return True


def run_wgmma(a, b, c, scale_a, scale_b, kind_a, kind_b, bias, activation, key: configs.WgmmaKey, config=None):
    """c = act((a * scale_a) @ (b * scale_b) + bias) through this body, on operands
    ``wgmma_body`` accepted; ``key``: the call's WgmmaKey (tuning tables)."""
    wgmma_launch(a, b, c, kind_a, kind_b, bias, activation, key, config, scale_a, scale_b).run(c, a, b, scale_a, scale_b, bias)


def wgmma_launch(a, b, c, kind_a, kind_b, bias, activation, key: configs.WgmmaKey, config=None, scale_a=None,
                 scale_b=None) -> Launch:
    """This body's launch for operands shaped like a, b, c (``wgmma_body`` accepted them):
    a core/dispatch.py Launch whose builder takes (c, a, b, scale_a, scale_b, bias).
    scale_a, scale_b: the call's scales, for autotuning's trial launches."""
    M, K = a.shape
    N = b.shape[1]

    def build(c, a, b, scale_a, scale_b, bias):
        return (Operand(a, *a.stride()), Operand(b, *b.stride()), Operand(c, *c.stride()), M, N, K,
                Scales(a=Operand(scale_a, *scale_a.stride()), b=Operand(scale_b, *scale_b.stride())),
                NO_VECTOR if bias is None else Vector(bias, bias.stride(0)))

    def launch_of(plan):
        tiles = cdiv(M, plan.meta["BLOCK_M"]) * cdiv(N, plan.meta["BLOCK_N"])
        return Launch(BLOCKSCALED_WGMMA, plan, (min(tiles, sm_count(plan.device_index)),), build)

    plan = BLOCKSCALED_WGMMA.plan_for(Request(
        key, dict(ACTIVATION=activation, SA_ROWS=SA_ROWS[kind_a], SB_COLS=SB_COLS[kind_b]), a.device, config,
        lambda plan: launch_of(plan).run(c, a, b, scale_a, scale_b, bias)))
    return launch_of(plan)
